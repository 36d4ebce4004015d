"""Driving `llmfast` in process through Typer's CliRunner, and the one-line error check."""

from __future__ import annotations

from typer.testing import CliRunner

from llmfast.cli.main import app

TINY = ["--model", "random:tiny", "--device", "cpu"]  # random weights, no tokenizer


def invoke(*args: str, input: bytes | str | None = None):
    # Wide enough that Rich never shortens a flag name in --help.
    return CliRunner().invoke(app, list(args), input=input, env={"COLUMNS": "200"})


def assert_one_line_error(result, fragment: str = "") -> str:
    """The command failed with exactly one `error: ...` line on stderr, no traceback."""
    assert result.exit_code != 0, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in result.output
    assert fragment.lower() in lines[0].lower(), lines[0]
    return lines[0]
