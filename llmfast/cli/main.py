"""The `llmfast` command: chat, generate, bench, profile, serve, pull.

This module only assembles the Typer app; each command lives in its own module here.
All parse and usage errors, like the commands' own errors, come out as one line
`error: ...` on stderr with a non-zero exit (2 for usage errors, 1 otherwise).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from llmfast.cli.bench.command import BENCH_EXAMPLES, bench
from llmfast.cli.chat.command import CHAT_EXAMPLES, chat
from llmfast.cli.common import engine_command, print_error
from llmfast.cli.help import CompactHelpCommand
from llmfast.cli.generate import GENERATE_EXAMPLES, generate
from llmfast.cli.profile import PROFILE_EXAMPLES, profile
from llmfast.cli.pull import PULL_EXAMPLES, pull
from llmfast.cli.serve import SERVE_EXAMPLES, serve
from llmfast.utils.bytecode import keep_bytecode
from llmfast.utils.paths import cache_dir


class _OneLineErrorGroup(TyperGroup):
    """Click shows usage errors as a box with the usage text; llmfast promises one line."""

    def main(self, args: Any = None, prog_name: str | None = None,
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        try:
            result = super().main(args=args, prog_name=prog_name, complete_var=complete_var,
                                  standalone_mode=False, **extra)
            code = result if isinstance(result, int) else 0
        except typer.TyperException as e:  # click's ClickException (typer vendors click)
            ctx = getattr(e, "ctx", None)
            if type(e).__name__ == "NoArgsIsHelpError" and ctx is not None:
                typer.echo(ctx.get_help())
                code = 0
            else:
                hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
                # Some typer versions pass a converter's ValueError on as "Value error, ...".
                message = e.format_message().replace("\n", " ").replace(": Value error, ", ": ")
                if "'--json' requires an argument" in message:  # it was a switch on generate
                    message += " Use --json PATH, or --json - for standard output."
                print_error(message + hint)
                code = getattr(e, "exit_code", 1)
        except typer.Abort:
            code = 130
        if standalone_mode:
            sys.exit(code)
        return code


def _show_version(value: bool) -> None:
    """--version: llmfast's version, and torch's (from its metadata: no import)."""
    if not value:
        return
    import importlib.metadata
    import platform

    from llmfast.version import __version__

    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    typer.echo(f"llmfast {__version__} (torch {torch}, Python {platform.python_version()})")
    raise typer.Exit()


def _root(version: Annotated[bool, typer.Option(
        "--version", "-V", is_eager=True, callback=_show_version,
        help="Show the version and exit.")] = False) -> None:
    """A small, fast LLM inference engine for Llama, Mistral, Qwen and Gemma 3 models."""


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="llmfast",
        cls=_OneLineErrorGroup,
        help="A small, fast LLM inference engine for Llama, Mistral, Qwen and Gemma 3 models.",
        no_args_is_help=True,
        add_completion=False,
        rich_markup_mode="markdown",
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.callback()(_root)
    commands = (("chat", chat, CHAT_EXAMPLES), ("generate", generate, GENERATE_EXAMPLES),
                ("bench", bench, BENCH_EXAMPLES), ("profile", profile, PROFILE_EXAMPLES),
                ("serve", serve, SERVE_EXAMPLES))
    for name, func, examples in commands:
        app.command(name, epilog=examples, cls=CompactHelpCommand)(engine_command(func))
    app.command("pull", epilog=PULL_EXAMPLES, cls=CompactHelpCommand)(pull)
    return app


app = build_app()


def main() -> None:
    # Before any command imports torch: a start-up without cached bytecode recompiles
    # ~2,500 modules (llmfast/utils/bytecode.py).
    # A $LLMFAST_CACHE naming an unknown home (a ValueError): no bytecode cache; the
    # commands that use the cache say what is wrong, in one line.
    with contextlib.suppress(ValueError):
        keep_bytecode(cache_dir())
    app()
