"""Command help at 80 columns (the default terminal, and any pipe): every flag name whole,
no line past the width, the common engine flags in `--help` and all of them in
`--help-all`. The flags checked come from the commands' parameters and EngineArgs, not
from the help text."""

from __future__ import annotations

import re

import click
import pytest
import typer.main

from llmfast.cli.help import COMMON_ENGINE_FLAGS
from llmfast.cli.main import app
from llmfast.engine.flags import engine_flags
from typer.testing import CliRunner

ENGINE_COMMANDS = ["chat", "generate", "bench", "profile", "serve"]


def _help(*args: str, columns: int = 80) -> str:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})
    assert result.exit_code == 0, result.output
    return result.stdout


def _has_whole(text: str, flag: str) -> bool:
    """`--max-model-len` as a whole word: not cut (`--max-model-…`), not a prefix of
    another flag."""
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def _long_names(command: str) -> list[str]:
    cmd = typer.main.get_command(app).commands[command]
    ctx = click.Context(cmd, info_name=command)
    return [o for p in cmd.get_params(ctx) if not p.hidden
            for o in (*p.opts, *p.secondary_opts) if o.startswith("--")]


def _engine_names(common_only: bool) -> list[str]:
    return [o for flag in engine_flags() if not common_only or flag.name in COMMON_ENGINE_FLAGS
            for decl in flag.decls for o in decl.split("/") if o.startswith("--")]


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_help_all_at_80_columns_shows_every_flag_whole(command):
    text = _help(command, "--help-all")
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    names = _long_names(command)
    assert set(_engine_names(common_only=False)) <= set(names)  # EngineArgs: all flags
    missing = [name for name in names if not _has_whole(text, name)]
    assert not missing, missing
    assert "Examples" in text and f"llmfast {command}" in text


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_help_at_80_columns_shows_own_and_common_flags(command):
    text = _help(command, "--help")
    assert max(len(line) for line in text.splitlines()) <= 80
    assert len(text.splitlines()) < 100  # was 230-280 lines before the compact layout
    engine = set(_engine_names(common_only=False))
    own = [name for name in _long_names(command) if name not in engine]
    common = _engine_names(common_only=True)
    assert "--model" in common and "--enforce-eager" in common
    missing = [name for name in own + common if not _has_whole(text, name)]
    assert not missing, missing
    rare = [name for name in engine - set(common) if _has_whole(text, name)]
    assert not rare, rare  # those are --help-all's
    assert "--help-all" in text


def test_help_all_groups_engine_flags_by_topic():
    text = _help("generate", "--help-all")
    panels = [m.group(1) for m in re.finditer(r"╭─ (.+?) ─", text)]
    assert panels[:2] == ["Arguments", "Options"]
    assert panels[2:] == ["Model", "Memory and scheduling", "Compilation and CUDA graphs",
                          "Parallelism", "Speculative decoding"]  # every field has a topic
    # A flag's help sits beside its name, wrapped in the help column, not below it.
    line = next(line for line in text.splitlines() if "--max-num-seqs INT" in line)
    assert "Most requests in one step." in line


def test_wide_terminal_keeps_lines_readable():
    text = _help("chat", "--help", columns=300)
    assert max(len(line) for line in text.splitlines()) <= 100


def test_arguments_are_named_as_the_usage_line_names_them():
    # `serve [MODEL]` in the usage line, and MODEL in the Arguments panel (not MODEL_ARG,
    # the parameter's Python name).
    text = _help("serve", "--help")
    assert "serve [OPTIONS] [MODEL]" in text
    panel = text.split("╭─ Arguments")[1].split("╰")[0]
    assert re.search(r"│ MODEL\s+The model", panel) and "MODEL_ARG" not in text
    assert re.search(r"│ PROMPTS\.\.\.\s", _help("generate", "--help"))
