"""Engine flags come from the `EngineArgs` fields: every command that builds an engine
shows exactly those flags, the CLI and `LLM(...)` read values the same way (one size
parser, one byte parser), and `engine_argv` writes back what was parsed."""

from __future__ import annotations

import re
from dataclasses import fields

import pytest
import typer
from typer.testing import CliRunner

from llmfast.cli.common import EngineOptions, engine_argv, engine_command
from llmfast.cli.main import app
from llmfast.config import ConfigError
from llmfast.engine.args import EngineArgs
from llmfast.engine.flags import engine_flags, engine_kwargs_from_argv
from llmfast.utils.flag_values import FlagValueError, parse_bytes, parse_sizes
from tests.helpers.cli import assert_one_line_error, invoke
from tests.helpers.engine_config import engine_config

# Commands that build no engine; any other command must take the engine flags.
NO_ENGINE = {"pull"}


def _engine_panel_flags(help_text: str) -> set[str]:
    """The option names in `--help-all`'s engine panels (Rich boxes other than Arguments
    and Options), plus --debug (in Options)."""
    names = {"--debug"} if re.search(r"(?<![\w-])--debug(?![\w-])", help_text) else set()
    inside = False
    for line in help_text.splitlines():
        if line.startswith("╭─ "):
            inside = not re.match(r"^╭─ (Arguments|Options) ─", line)
        elif line.startswith("╰"):
            inside = False
        elif inside:
            # "│ -m, --model TEXT   help │", "│ --compile / --no-compile   help │"; a
            # wrapped help line starts with spaces.
            row = line.removeprefix("│ ")
            if row.startswith("-"):
                names.update(re.findall(r"(?<![\w-])--?[a-z][a-z0-9-]*", row.split("  ")[0]))
    return names


def _commands() -> list[str]:
    group = typer.main.get_command(app)
    return sorted(group.commands)


def test_every_engine_command_shows_exactly_the_engine_args_fields():
    expected = {name for flag in engine_flags() for name in flag.names} | {"--debug"}
    # Each field is a flag (a new field needs no other edit to appear here).
    assert [flag.name for flag in engine_flags()] == [f.name for f in fields(EngineArgs)]
    engine_commands = [c for c in _commands() if c not in NO_ENGINE]
    assert {"chat", "generate", "bench", "profile"} <= set(engine_commands)
    for command in engine_commands:
        result = invoke(command, "--help-all")
        assert result.exit_code == 0, result.output
        assert _engine_panel_flags(result.stdout) == expected, command
    pull = invoke("pull", "--help").stdout
    assert "--max-num-seqs" not in pull


def test_help_shows_field_defaults_and_size_syntax():
    lines = invoke("generate", "--help-all").stdout.splitlines()
    text = " ".join(" ".join(line.strip("│ ").split()) for line in lines)  # help unwrapped
    assert "[default: 0.9]" in text  # gpu_memory_utilization, from the field
    assert "1..8 = 1,2,4,8" in text  # --cuda-graph-sizes explains a..b


def _parse(argv: list[str]) -> tuple[int, EngineOptions | None, str]:
    """Run a probe command with the engine flags; what it received."""
    got: dict[str, EngineOptions] = {}

    def probe(*, opts: EngineOptions) -> None:
        got["opts"] = opts

    probe_app = typer.Typer()
    probe_app.command()(engine_command(probe))
    result = CliRunner().invoke(probe_app, argv)
    return result.exit_code, got.get("opts"), result.output


def test_flags_reach_engine_kwargs_and_round_trip():
    argv = ["--model", "random:tiny", "--dtype", "bfloat16", "--device", "cpu", "--seed", "3",
            "--max-num-seqs", "7", "--kv-cache-memory", "1MiB", "--no-compile",
            "--enforce-eager", "--no-cuda-graphs", "--cuda-graph-sizes", "1..8",
            "--no-prefix-caching", "--num-gpu-blocks-override", "64", "--debug"]
    code, opts, output = _parse(argv)
    assert code == 0, output
    assert opts.model == "random:tiny" and opts.debug
    assert opts.engine_kwargs == {
        "dtype": "bfloat16", "device": "cpu", "seed": 3, "max_num_seqs": 7,
        "kv_cache_memory": 2**20, "compile": False, "enforce_eager": True,
        "cuda_graphs": False, "cuda_graph_sizes": (1, 2, 4, 8), "enable_prefix_caching": False,
        "num_gpu_blocks_override": 64}
    # The kwargs are exactly what LLM(...) takes.
    assert EngineArgs.from_kwargs(model=opts.model, **opts.engine_kwargs).cuda_graph_sizes \
        == (1, 2, 4, 8)
    code, again, _ = _parse(engine_argv(opts))
    assert code == 0 and again == opts
    code, unset, _ = _parse([])
    assert code == 0 and unset == EngineOptions(model=None, debug=False)
    _, default, _ = _parse(["--model", "default"])
    assert default.model is None


def test_argv_reads_back_as_the_cli_reads_it():
    """Scripts that pass a server's flags to an in-process engine (bench_serve's
    --engine-baseline) read them as the CLI does."""
    argv = ["--model", "random:tiny", "--dtype", "bfloat16", "--device", "cpu", "--seed", "3",
            "--max-num-seqs", "7", "--kv-cache-memory=1MiB", "--no-compile",
            "--enforce-eager", "--cuda-graph-sizes", "1..8", "--no-prefix-caching",
            "--gpu-memory-utilization", "0.5", "--cuda-graph-mode", "piecewise"]
    code, opts, output = _parse(argv)
    assert code == 0, output
    assert engine_kwargs_from_argv(argv) == {"model": "random:tiny", **opts.engine_kwargs}
    assert engine_kwargs_from_argv(engine_argv(opts)) == engine_kwargs_from_argv(argv)
    for bad, fragment in ((["--nope", "1"], "not an engine flag"),
                          (["--max-num-seqs"], "needs a value"),
                          (["--max-num-seqs", "many"], "--max-num-seqs many"),
                          (["--kv-cache-memory", "12XB"], "cannot read '12XB'")):
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            engine_kwargs_from_argv(bad)


@pytest.mark.parametrize("spec, expected", [
    ("1..8", (1, 2, 4, 8)),
    ("1,2,4,8", (1, 2, 4, 8)),
    ("8..32:8", (8, 16, 24, 32)),
    ("1,2,8..32:8", (1, 2, 8, 16, 24, 32)),
])
def test_cuda_graph_sizes_read_like_bench_sizes(spec, expected):
    code, opts, output = _parse(["--cuda-graph-sizes", spec])
    assert code == 0, output
    assert opts.engine_kwargs["cuda_graph_sizes"] == expected
    assert EngineArgs.from_kwargs(cuda_graph_sizes=spec).cuda_graph_sizes == expected


def test_piecewise_graph_sizes_reach_the_compile_config():
    code, opts, output = _parse(["--piecewise-graph-sizes", "1..512"])
    assert code == 0, output
    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
    assert opts.engine_kwargs["piecewise_graph_sizes"] == sizes
    args = EngineArgs.from_kwargs(model="random:tiny", device="cpu",
                                  max_num_batched_tokens=200, **opts.engine_kwargs)
    compile_config = engine_config(args)[0].compile
    assert compile_config.piecewise_graph_sizes == sizes[:8]  # <= the step budget
    default = EngineArgs.from_kwargs(model="random:tiny", device="cpu")
    assert engine_config(default)[0].compile.piecewise_graph_sizes is None


@pytest.mark.parametrize("argv, fragment", [
    (["--cuda-graph-sizes", "8..1"], "backwards"),
    (["--piecewise-graph-sizes", "8..1"], "backwards"),
    (["--cuda-graph-sizes", "none"], "cannot parse"),
    (["--kv-cache-memory", "lots"], "512MiB"),
])
def test_bad_flag_values_are_usage_errors(argv, fragment):
    result = invoke("generate", "hi", *argv)
    line = assert_one_line_error(result, fragment)
    assert result.exit_code == 2 and argv[0] in line


def test_llm_keywords_are_the_fields():
    args = EngineArgs.from_kwargs(kv_cache_memory="2GiB", max_num_seqs=4)
    assert args.kv_cache_memory == 2 * 2**30 and args.max_num_seqs == 4
    with pytest.raises(ConfigError, match="unknown engine argument.*max_batch"):
        EngineArgs.from_kwargs(max_batch=4)
    with pytest.raises(FlagValueError, match="cannot read"):
        EngineArgs.from_kwargs(kv_cache_memory="lots")


# ---------------------------------------------------------------------- the parsers


@pytest.mark.parametrize("spec, expected", [
    ("1..512", (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)),
    ("1..8", (1, 2, 4, 8)),
    ("3..20", (3, 6, 12)),
    ("8..32:8", (8, 16, 24, 32)),
    ("1,8,64", (1, 8, 64)),
    ("64, 1 ,8,8", (1, 8, 64)),
    ("1,2,8..32:8", (1, 2, 8, 16, 24, 32)),
    ("7", (7,)),
    ("5..5", (5,)),
])
def test_parse_sizes(spec, expected):
    assert parse_sizes(spec) == expected


@pytest.mark.parametrize("spec, fragment", [
    ("0..8", ">= 1"),
    ("8..1", "backwards"),
    ("a..b", "cannot parse"),
    ("1..100000", "above the limit"),
    ("1..10000000000000:1", "above the limit"),
    ("", "empty"),
    ("1,,2", "cannot parse"),
    ("0", ">= 1"),
    ("1..8:0", "step"),
    ("-1..8", "cannot parse"),
    ("1.5", "cannot parse"),
])
def test_parse_sizes_errors(spec, fragment):
    with pytest.raises(FlagValueError, match=fragment):
        parse_sizes(spec)


def test_parse_sizes_custom_limit():
    with pytest.raises(FlagValueError, match="limit 8"):
        parse_sizes("1..16", limit=8)


@pytest.mark.parametrize("text, expected", [
    ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1048576", 2**20), ("1.5GB", 1_500_000_000),
    ("64k", 64 * 1024), ("8 MiB", 8 * 2**20), ("100b", 100),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "5 parsecs", "-1MiB", "0", "1.5.2GB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(FlagValueError):
        parse_bytes(text)
