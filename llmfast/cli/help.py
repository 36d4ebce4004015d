"""Command help that reads at 80 columns: every flag name whole, the command's own options
first, the engine flags in small panels by topic.

Typer's own layout puts each option in a six-column table (long name, short name,
negative name, type, help), so at 80 columns the engine panel's help column shrinks to a
few characters and long names are cut (`--tensor-parallel-…`). Here a row is the flag
with its value (`--max-model-len INT`, `--compile / --no-compile`) in a column as wide as the
longest name (a longer one gets a line of its own), then its help wrapped beside it.

`--help` lists the engine flags people use (COMMON_ENGINE_FLAGS); `--help-all` lists
every one. A flag that is not in PANELS (a new EngineArgs field) lands in "Engine".
"""

from __future__ import annotations

import enum
import io
import shutil
import textwrap
from typing import Any

import typer
from rich.console import Console
from rich.markdown import Markdown
from rich.panel import Panel
from rich.text import Text
from typer.core import TyperCommand

from llmfast.engine.flags import engine_flags

ENGINE_PREFIX = "engine__"  # the engine flags' parameter names (common.py)

# Shown by --help: the flags a first run, a chat on a bigger model or a server reaches for.
COMMON_ENGINE_FLAGS = ("model", "device", "dtype", "seed", "max_model_len", "max_num_seqs",
                       "kv_cache_memory", "gpu_memory_utilization", "enforce_eager", "debug")

# Engine flag -> panel; the panels in this order after the command's own options.
PANELS = {
    "Model": ("model", "dtype", "device", "quantization", "seed", "chat_template",
              "generation_config"),
    "Memory and scheduling": ("max_model_len", "max_num_seqs", "max_num_batched_tokens",
                              "block_size", "kv_cache_memory", "kv_cache_dtype",
                              "gpu_memory_utilization", "num_gpu_blocks_override",
                              "enable_prefix_caching", "async_scheduling"),
    "Compilation and CUDA graphs": ("enforce_eager", "compile", "cuda_graphs",
                                    "cuda_graph_mode", "cuda_graph_sizes",
                                    "piecewise_graph_sizes", "gemv", "gemv_fuse"),
    "Parallelism": ("tensor_parallel_size", "distributed_executor_backend", "ray_address"),
    "Speculative decoding": ("speculative_method", "speculative_model",
                             "num_speculative_tokens", "ngram_prompt_lookup_min",
                             "ngram_prompt_lookup_max"),
    "Options": ("debug",),  # with the command's own options
}
OTHER_ENGINE_PANEL = "Engine"
ENGINE_PANELS = tuple(t for t in (*PANELS, OTHER_ENGINE_PANEL) if t != "Options")
HELP_ALL_KEY = "llmfast_help_all"
NAME_WIDTH_MAX = 30  # a flag name longer than this gets its own line
MAX_WIDTH = 100  # wider terminals: still this wide, for readable lines


def panel_of(field_name: str) -> str:
    for panel, names in PANELS.items():
        if field_name in names:
            return panel
    return OTHER_ENGINE_PANEL


def engine_field_names() -> tuple[str, ...]:
    return tuple(flag.name for flag in engine_flags()) + ("debug",)


def show_all_help(ctx: typer.Context, value: bool) -> None:
    """The --help-all callback: the help with every engine flag, then exit."""
    if value and not ctx.resilient_parsing:
        ctx.meta[HELP_ALL_KEY] = True
        typer.echo(ctx.get_help(), color=ctx.color)
        raise typer.Exit()


HelpAll = typer.Option(
    False, "--help-all", is_eager=True, expose_value=False, callback=show_all_help,
    help="Show this message with every engine flag, and exit.")


class CompactHelpCommand(TyperCommand):
    """A Typer command whose help is rendered by `render_help`."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        formatter.write(render_help(self, ctx, full=bool(ctx.meta.get(HELP_ALL_KEY))))


def help_width() -> int:
    return min(shutil.get_terminal_size((80, 24)).columns, MAX_WIDTH)


def render_help(command: Any, ctx: Any, *, full: bool, width: int | None = None) -> str:
    width = width or help_width()
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=ctx.color, highlight=False,
                      color_system="standard" if ctx.color else None)
    pieces = " ".join(command.collect_usage_pieces(ctx))
    console.print(Text.assemble(("Usage: ", "bold"), f"{ctx.command_path} {pieces}"),
                  soft_wrap=False)
    if command.help:
        console.print()
        console.print(Markdown(command.help.split("\f")[0]))
    params = [p for p in command.get_params(ctx) if not getattr(p, "hidden", False)]
    num_engine = sum(_panel(p)[0] in ENGINE_PANELS for p in params)
    panels: dict[str, list[tuple[str, str]]] = {}
    for param in params:
        panel, common = _panel(param)
        if panel in ENGINE_PANELS and not full:
            if not common:
                continue
            # --help: the common engine flags in one panel.
            panel = f"Engine (common flags; --help-all lists all {num_engine})"
        panels.setdefault(panel, []).append((_name(param, ctx), _help(param)))
    console.print()
    for title in _ordered(panels):
        console.print(_options_panel(title, panels[title], width))
    if command.epilog:
        console.print()
        console.print(Markdown(command.epilog))
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines()) + "\n"


def _panel(param: Any) -> tuple[str, bool]:
    """(panel title, shown by --help)."""
    name = param.name or ""
    if not name.startswith(ENGINE_PREFIX):
        kind = "Arguments" if param.param_type_name == "argument" else "Options"
        return getattr(param, "rich_help_panel", None) or kind, True
    field = name.removeprefix(ENGINE_PREFIX)
    return panel_of(field), field in COMMON_ENGINE_FLAGS


def _ordered(panels: dict[str, list]) -> list[str]:
    """Arguments, Options, the command's own panels, then the engine's."""
    rank = {"Arguments": 0, "Options": 1} | {t: 3 + i for i, t in enumerate(ENGINE_PANELS)}
    return sorted(panels, key=lambda t: rank.get(t, 3 + len(ENGINE_PANELS)
                                               if t.startswith("Engine (") else 2))


def _name(param: Any, ctx: Any) -> str:
    """`-f, --file PATH`, `--compile / --no-compile`, `--ignore-eos`, `PROMPTS...`."""
    if param.param_type_name == "argument":
        return (param.metavar or param.name.upper()) + ("..." if param.nargs != 1 else "")
    longs = [o for o in param.opts if o.startswith("--")]
    shorts = [o for o in param.opts if not o.startswith("--")]
    negative = [o for o in param.secondary_opts if o.startswith("--")]
    name = " / ".join([", ".join(shorts + longs), *negative])
    metavar = _metavar(param, ctx)
    return f"{name} {metavar}" if metavar else name


def _metavar(param: Any, ctx: Any) -> str:
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return ""
    if param.metavar:
        return param.metavar
    shown = (param.display_type_rich(ctx=ctx) or "").strip("<>")
    if "|" in shown:
        return "{" + shown + "}"
    return {"int": "INT", "float": "FLOAT", "path": "PATH", "bool": ""}.get(shown, "TEXT")


def _help(param: Any) -> str:
    text = " ".join((param.help or "").split())
    if "[default:" in text or not getattr(param, "show_default", False):
        return text
    if isinstance(param.show_default, str):
        return f"{text}  [default: {param.show_default}]"
    default = param.default
    if default is None or (getattr(param, "is_flag", False) and default is False) \
            or default in ((), []):
        return text
    if isinstance(default, bool):
        default = "on" if default else "off"
    elif isinstance(default, enum.Enum):
        default = default.value
    elif isinstance(default, (list, tuple)):
        default = ", ".join(map(str, default))
    return f"{text}  [default: {default}]"


def _options_panel(title: str, rows: list[tuple[str, str]], width: int) -> Panel:
    inner = width - 4  # the panel's borders and padding
    name_width = min(max(len(name) for name, _ in rows), NAME_WIDTH_MAX)
    help_width = max(inner - name_width - 2, 20)
    text = Text()
    for i, (name, help_text) in enumerate(rows):
        lines = textwrap.wrap(help_text, help_width, break_on_hyphens=False) or [""]
        if i:
            text.append("\n")
        text.append(name, style="bold cyan")
        if len(name) > name_width:  # its own line; the help below, in the help column
            text.append("\n" + " " * (name_width + 2))
        else:
            text.append(" " * (name_width + 2 - len(name)))
        text.append(("\n" + " " * (name_width + 2)).join(lines))
    return Panel(text, title=title, title_align="left", border_style="dim", width=width)


