"""Bad input found by the CLI audit, through the real CLI: one `error:` line, a non-zero
exit, no traceback; and a benchmark that fails part-way keeps what it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.chat_model import make_chat_model
from tests.helpers.cli import TINY, assert_one_line_error, invoke

# Checked before the model would load (it does not exist): nothing runs in vain.
NO_MODEL = ["--model", "/nonexistent/model", "--device", "cpu"]


@pytest.mark.parametrize("args, fragment", [
    # torch's generators take seeds below 2**64; above, loading failed with
    # "Overflow when unpacking long long".
    (["generate", "hi", *TINY, "--seed", str(2**64)], "seed must be at most 18446744073709551615"),
    # Ignored without a word by the uni backend.
    (["generate", "hi", *TINY, "--ray-address", "10.0.0.1:6379"],
     "--ray-address is for the ray backend"),
    # A blank argument (an unset shell variable) was sent as a prompt.
    (["generate", "hi", "  ", *NO_MODEL], "prompt argument 2 is empty"),
    (["generate", "", *NO_MODEL], "prompt argument 1 is empty"),
    # An empty file said "no prompts: pass them as arguments or with --file".
    (["generate", *NO_MODEL, "--file", "/dev/null"],
     "/dev/null holds no prompts (one per line; blank lines are skipped)"),
    (["generate", "hi", "--no-chat", "--system", "Be brief.", *NO_MODEL],
     "--system needs the chat template"),
    # A graph mode that another flag turns off ran without graphs, saying nothing.
    (["generate", "hi", *TINY, "--cuda-graph-mode", "full_decode", "--enforce-eager"],
     "--cuda-graph-mode full_decode replays cuda graphs, which --enforce-eager turns off"),
    (["generate", "hi", *TINY, "--cuda-graph-mode", "piecewise", "--no-cuda-graphs"],
     "--no-cuda-graphs turns off"),
    (["generate", "hi", *TINY, "--cuda-graph-mode", "piecewise", "--no-compile"],
     "--no-compile turns off"),
    # Step limits no machine holds: a one-line out-of-memory error, not "internal error".
    # (4 PB: above any 64-bit address space, so no overcommit setting lets it through.)
    (["generate", "hi", *TINY, "--max-num-seqs", str(10**15)], "out of memory"),
    # Options another bench mode reads were ignored: a sweep and no HF baseline.
    (["bench", *NO_MODEL, "--baseline", "hf"],
     "--baseline applies to --mode throughput, not to --mode sweep"),
    (["bench", *NO_MODEL, "--mode", "throughput", "--sizes", "1,2"], "--sizes applies to"),
    (["bench", *NO_MODEL, "--mode", "throughput", "--request-rate", "4"],
     "--request-rate applies to --mode latency"),
    (["bench", *NO_MODEL, "--mode", "latency", "--modes", "eager"], "--modes applies to"),
    (["bench", *NO_MODEL, "--startup", "--steps", "4"], "not to --startup alone"),
    # Found only once the model had loaded.
    (["bench", *NO_MODEL, "--mode", "throughput", "--random-range-ratio", "2"],
     "--random-range-ratio must be in [0, 1)"),
    # Read after --startup's two engine starts; now before anything runs.
    (["bench", *NO_MODEL, "--startup", "--mode", "sweep", "--sizes", "0"], "sizes must be >= 1"),
    # Named alone, with its value (the message listed all five counts).
    (["bench", *NO_MODEL, "--steps", "0"], "error: --steps must be >= 1, got 0"),
    (["profile", *NO_MODEL, "--context", "0"], "error: --context must be >= 1, got 0"),
    (["bench", *NO_MODEL, "--mode", "throughput", "--output-len", "-2"],
     "error: --output-len must be >= 1, got -2"),
    # A choice error read "Invalid value for '--tracer': Value error, 'foo' is not ...".
    (["profile", "--tracer", "foo"], "Invalid value for '--tracer': 'foo' is not one of"),
    # --gemv's values, and the pair that contradicts itself (config.SkinnyLinearConfig).
    (["generate", "hi", *NO_MODEL, "--gemv", "fast"], "unknown gemv backend 'fast'"),
    (["generate", "hi", *NO_MODEL, "--gemv", "cublas", "--gemv-fuse"],
     "--gemv-fuse runs the fused layers on the Triton GEMV"),
    # os.access says yes (to root, and to /proc); the write after the run then failed.
    (["bench", *NO_MODEL, "--json", "/proc/llmfast-bench.json"], "cannot write --json"),
])
def test_bad_input_is_one_line_error(args, fragment):
    assert_one_line_error(invoke(*args), fragment)


def test_bad_input_traceback_under_debug():
    result = invoke("generate", "hi", *TINY, "--top-k", "-2", "--debug")
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "error: top_k must be" in result.stderr


def test_system_prompt_on_a_model_without_chat_template(tmp_path):
    model = make_chat_model(tmp_path / "m", chat_template=False)
    result = invoke("generate", "hi", "--system", "Be brief.", "--model", str(model),
                    "--device", "cpu", "--max-tokens", "2")
    assert_one_line_error(result, "--system needs a chat template, and this model has none")


def test_seed_at_the_top_of_the_range_runs():
    result = invoke("generate", "hi", *TINY, "--seed", str(2**64 - 1), "--max-tokens", "2",
                    "--temperature", "1")
    assert result.exit_code == 0, result.output


def test_json_that_cannot_be_written_after_the_run_is_saved_elsewhere(tmp_path):
    from rich.console import Console

    from llmfast.bench import BenchError
    from llmfast.cli.bench.command import write_outputs

    report = {"runs": {"default": {"sweep": [{"batch_size": 1}]}}}
    gone = tmp_path / "gone" / "sweep.json"  # its directory went away during the run
    with pytest.raises(BenchError, match="cannot write --json") as info:
        write_outputs(report, gone, None, Console(stderr=True))
    saved = Path(str(info.value).rsplit("the report is saved in ", 1)[1])
    try:
        assert json.loads(saved.read_text()) == report
    finally:
        saved.unlink()


@pytest.mark.parametrize("where", ["start", "sweep"])
def test_bench_failing_in_its_second_mode_keeps_the_first(where, tmp_path, monkeypatch):
    """`--modes eager,compiled` whose compiled run fails, at its engine's start (where a
    compiler crashes) or in its sweep (the engine up): the eager sweep is printed and
    written to --json (marked incomplete) before the one error line. The second run's
    engine is an eager one (its mode's overrides replaced): compiling the model only to
    fail after it cost the test ~30 s."""
    import llmfast.bench as bench_pkg
    import llmfast.cli.bench.command as bench_cli

    monkeypatch.setitem(bench_cli.EXEC_MODES, "compiled", bench_cli.EXEC_MODES["eager"])
    module, name = (bench_cli, "load_llm") if where == "start" else (bench_pkg, "run_sweep")
    real = getattr(module, name)
    calls = []

    def second_call_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("compiler crashed")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, second_call_fails)
    out = tmp_path / "sweep.json"
    result = invoke("bench", *TINY, "--sizes", "1,2", "--context", "4", "--steps", "2",
                    "--modes", "eager,compiled", "--json", str(out))
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: internal error: RuntimeError: compiler crashed (run with --debug "
                      "for the traceback)"]
    assert "decode sweep" in result.stdout
    report = json.loads(out.read_text())
    assert report["incomplete"] == "RuntimeError: compiler crashed"
    assert list(report["runs"]) == ["eager"]
    assert [p["batch_size"] for p in report["runs"]["eager"]["sweep"]] == [1, 2]


def test_graph_mode_none_with_eager_and_bench_eager_with_a_graph_mode_run():
    """Not conflicts: mode none asks for no graphs; bench's eager run drops the graph mode
    meant for its graphs run."""
    assert invoke("generate", "hi", *TINY, "--cuda-graph-mode", "none", "--enforce-eager",
                  "--max-tokens", "2").exit_code == 0
    result = invoke("bench", *TINY, "--cuda-graph-mode", "piecewise", "--modes", "eager",
                    "--sizes", "1", "--steps", "2", "--context", "4")
    assert result.exit_code == 0, result.output


def test_cache_variable_naming_an_unknown_home(tmp_path):
    """$LLMFAST_CACHE=~user/... of no such user: `llmfast --help` still works (the entry
    point's bytecode cache is skipped), and a command that uses the cache says which
    variable is wrong in one line, with no traceback."""
    env = {**os.environ, "LLMFAST_CACHE": "~llmfast_no_such_user_here/cache"}
    helped = subprocess.run([sys.executable, "-m", "llmfast", "--help"], env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert helped.returncode == 0 and "generate" in helped.stdout, helped.stderr
    pulled = subprocess.run([sys.executable, "-m", "llmfast", "pull"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, check=False)
    assert pulled.returncode != 0
    lines = pulled.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), pulled.stderr
    assert "$LLMFAST_CACHE" in lines[0] and "Traceback" not in pulled.stderr


def test_generate_with_standard_output_closed_says_so():
    """`>&-`: Python's sys.stdout is None; the completions had nowhere to go (lost with
    exit 0, or an 'internal error' with --json)."""
    for extra in ("", " --json -"):
        proc = subprocess.run(
            ["bash", "-c", f"{sys.executable} -m llmfast generate --model random:tiny "
                           f"--device cpu --max-tokens 2{extra} hi >&-"],
            capture_output=False, stderr=subprocess.PIPE, text=True, timeout=300, check=False)
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert lines == ["error: standard output is closed: the completions would be lost; "
                         "redirect it instead (e.g. > out.txt)"], proc.stderr


def test_bench_json_never_overwrites_a_file_that_is_not_a_bench_report(tmp_path):
    """--json naming some other JSON file (a typo away from the report) is refused before
    the model loads and the file is left as it was; an earlier report is replaced."""
    precious = tmp_path / "precious.json"
    precious.write_text('{"mine": 1}')
    result = invoke("bench", *NO_MODEL, "--json", str(precious))
    assert_one_line_error(result, "is not an llmfast bench report")
    assert precious.read_text() == '{"mine": 1}'
    report = tmp_path / "report.json"
    report.write_text('{"llmfast_bench_version": 1}')
    result = invoke("bench", *TINY, "--sizes", "1", "--steps", "2", "--context", "4",
                    "--json", str(report))
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["config"]["mode"] == "sweep"


def test_a_failing_start_up_child_says_why_without_the_module_path():
    """`bench --startup` runs the engine in child processes; a setting the child refuses
    comes back as the child's own message, not as `llmfast.config.ConfigError: ...`."""
    result = invoke("bench", *TINY, "--enforce-eager", "--startup", "--max-model-len",
                    "100000000")
    line = assert_one_line_error(result, "the start-up process failed: max-model-len 100000000")
    assert "llmfast." not in line and "Error:" not in line
