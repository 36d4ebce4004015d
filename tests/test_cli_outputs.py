"""What the commands write: `--json PATH` (or `-`, standard output) with one meaning on
generate and bench, generate saying it stopped at max tokens, `--plot` refused before
the run without matplotlib, `--version`."""

from __future__ import annotations

import json
import sys

from tests.helpers.cli import TINY, assert_one_line_error, invoke

NO_MODEL = ["--model", "/nonexistent/model", "--device", "cpu"]
SHORT = [*TINY, "--max-tokens", "3", "--ignore-eos", "--temperature", "0"]
SWEEP = ["--sizes", "1", "--steps", "2", "--context", "4"]


def test_generate_json_to_a_file_keeps_the_text_on_stdout(tmp_path):
    out = tmp_path / "out.json"
    result = invoke("generate", "hello", "there", *SHORT, "--json", str(out))
    assert result.exit_code == 0, result.output
    records = json.loads(out.read_text())
    assert [r["prompt"] for r in records] == ["hello", "there"]
    for record in records:  # the text printed is the text recorded
        assert record["text"] in result.stdout and len(record["token_ids"]) == 3
    assert f"wrote {out}" in result.stderr


def test_generate_json_dash_is_stdout_alone():
    result = invoke("generate", "hello", *SHORT, "--json", "-")
    assert result.exit_code == 0, result.output
    (record,) = json.loads(result.stdout)
    assert record["finish_reason"] == "length"


def test_generate_says_it_stopped_at_max_tokens():
    one = invoke("generate", "hello", *SHORT)
    assert one.exit_code == 0, one.output
    assert "stopped at max tokens (3; raise --max-tokens for more)" in one.stderr
    two = invoke("generate", "hello", "there", *SHORT)
    assert "2 of 2 stopped at max tokens" in two.stderr
    # A completion that ends by itself (a stop string at once) says nothing of the kind.
    done = invoke("generate", "hello", *TINY, "--max-tokens", "3", "--temperature", "0",
                  "--json", "-")
    (record,) = json.loads(done.stdout)
    said = "stopped at max tokens" in done.stderr
    assert said == (record["finish_reason"] == "length")
    # Cut by the context's end before --max-tokens: it says so, not "max tokens".
    ctx = invoke("generate", "hello", *TINY, "--max-tokens", "500", "--ignore-eos",
                 "--max-model-len", "32", "--json", "-")
    assert ctx.exit_code == 0, ctx.output
    (record,) = json.loads(ctx.stdout)
    assert record["finish_reason"] == "length" and len(record["token_ids"]) < 500
    assert "stopped at the context's end (max-model-len 32, prompt included)" in ctx.stderr
    assert "max tokens" not in ctx.stderr


def test_generate_interrupted_writes_what_finished(tmp_path, monkeypatch):
    """Ctrl-C once one of two prompts finished (raised where it lands while generate
    waits, between engine steps): that completion is printed and recorded, the other is
    marked interrupted, exit 130."""
    import contextlib

    import llmfast.cli.generate as generate_cli

    @contextlib.contextmanager
    def interrupting_progress(description, console=None):
        def progress(done, total):
            if done >= 1:
                raise KeyboardInterrupt
        yield progress

    monkeypatch.setattr(generate_cli, "count_progress", interrupting_progress)
    out = tmp_path / "out.json"
    # Both run to the context's end (max-model-len 64), the longer prompt 8 tokens sooner.
    result = invoke("generate", "hi", *TINY, "--max-tokens", "100", "--ignore-eos",
                    "--max-model-len", "64", "--json", str(out), "--no-chat",
                    "--file", str(_lines(tmp_path, "ten bytes!")))
    assert result.exit_code == 130, result.output
    records = json.loads(out.read_text())
    assert [r["finish_reason"] for r in records] == ["interrupted", "length"]
    assert records[0]["text"] is None and len(records[1]["token_ids"]) > 0
    assert records[1]["text"] in result.stdout
    assert "interrupted: 1 of 2 completions finished" in result.stderr


def _lines(tmp_path, *lines):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bench_json_dash_is_stdout_alone():
    result = invoke("bench", *TINY, *SWEEP, "--json", "-")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # nothing else on stdout: it parses
    assert report["config"]["sizes"] == [1]
    assert "decode sweep" in result.stderr  # the table went to stderr


def test_json_path_errors_name_the_fix():
    assert_one_line_error(invoke("generate", *SHORT, "--json", "hello"),
                          "--json takes a file name ending in .json, or - for standard output")
    assert_one_line_error(invoke("generate", "hello", *SHORT, "--json"),
                          "use --json path, or --json - for standard output")
    assert_one_line_error(invoke("generate", "hello", *SHORT, "--json", "/nonexistent/x.json"),
                          "does not exist")


def test_plot_without_matplotlib_fails_before_the_run(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    # The model does not exist: had the check waited for the run, that error came first.
    assert_one_line_error(invoke("bench", *NO_MODEL, "--plot", str(tmp_path / "p.png")),
                          "--plot needs matplotlib: pip install matplotlib, or drop --plot")


def test_version():
    from llmfast import __version__

    for flag in ("--version", "-V"):
        result = invoke(flag)
        assert result.exit_code == 0
        assert result.stdout.startswith(f"llmfast {__version__} (torch ")
