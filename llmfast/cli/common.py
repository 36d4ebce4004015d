"""What every `llmfast` command shares: the engine flags, the error boundary (one-line
`error: ...` on stderr, a traceback only under --debug), logging, and the start-up
progress bar.

The engine flags are the fields of `EngineArgs` (see engine/args.py to add one);
`engine_command` appends them to each command's signature, so every command that builds
an engine takes the same flags.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)

from llmfast.cli.help import ENGINE_PREFIX, HelpAll
from llmfast.engine.flags import engine_flags
from llmfast.utils.errors import one_line
from llmfast.utils.progress import CountProgress, OnceStage
from llmfast.utils.progress import Progress as StageProgress

logger = logging.getLogger(__name__)

ENGINE_PANEL = "Engine"


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


# ---------------------------------------------------------------------- sampling flags

# Shared by chat and generate (their defaults differ, so each command sets its own).
Temperature = Annotated[float, typer.Option("--temperature", "-t",
                                            help="Sampling temperature; 0 is greedy.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1].")]
TopK = Annotated[int, typer.Option(
    "--top-k", help="Keep the k likeliest tokens; 0 or -1 = off.")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", help="Most tokens to generate.")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at end-of-text.")]
System = Annotated[str | None, typer.Option("--system", "-s", help="System prompt.")]
# One meaning on every command: a file name, or - for standard output.
JsonPath = Annotated[str | None, typer.Option(
    "--json", metavar="PATH", show_default=False,
    help="Also write the results as JSON to PATH (.json), or to standard output with - "
         "(the text then goes to stderr).")]


def check_json_path(path: str | None) -> None:
    """--json, before the model loads: - or a writable file name ending in .json."""
    if path is None or path == "-":
        return
    if not path.lower().endswith(".json"):
        raise ValueError(f"--json takes a file name ending in .json, or - for standard "
                         f"output; got {path!r}")
    from llmfast.cli.bench.checks import check_writable

    check_writable(Path(path), "--json")


# ---------------------------------------------------------------------- engine flags


@dataclass(frozen=True)
class EngineOptions:
    """The common flags after parsing: `engine_kwargs` holds only what the user set, so
    EngineArgs' own defaults apply to the rest."""

    model: str | None
    debug: bool
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def with_overrides(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.engine_kwargs, **kwargs}


_PREFIX = ENGINE_PREFIX  # the engine flags' parameter names; keeps them apart from a command's


def _engine_parameters() -> list[inspect.Parameter]:
    """One keyword parameter per EngineArgs field, plus --debug; all default to None (or
    off), so only the flags the user gave reach `engine_kwargs`."""
    params = [
        inspect.Parameter(
            _PREFIX + flag.name, inspect.Parameter.KEYWORD_ONLY, default=None,
            annotation=Annotated[flag.value_type | None, typer.Option(
                *flag.decls, help=flag.help, rich_help_panel=ENGINE_PANEL, show_default=False)])
        for flag in engine_flags()
    ]
    params.append(inspect.Parameter(
        _PREFIX + "debug", inspect.Parameter.KEYWORD_ONLY, default=False,
        annotation=Annotated[bool, typer.Option(
            "--debug", help="Debug logging; tracebacks on errors.", rich_help_panel=ENGINE_PANEL)]))
    # Not passed to the command (expose_value=False): it prints the help and exits.
    params.append(inspect.Parameter("help_all", inspect.Parameter.KEYWORD_ONLY,
                                    default=HelpAll, annotation=bool))
    return params


def _engine_options(values: dict[str, Any]) -> EngineOptions:
    """EngineOptions from the engine parameters' values (field name -> value or None)."""
    kwargs: dict[str, Any] = {}
    for flag in engine_flags():
        value = values.get(flag.name)
        if value is None:
            continue
        if flag.parse is not None:
            try:
                value = flag.parse(value)
            except ValueError as e:
                raise typer.BadParameter(str(e), param_hint=f"'{flag.decls[0]}'") from None
        kwargs[flag.name] = value
    model = kwargs.pop("model", None)
    return EngineOptions(model=None if model in (None, "", "default") else model,
                         debug=bool(values.get("debug")), engine_kwargs=kwargs)


def engine_command(func: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command the engine flags (it receives them as `opts: EngineOptions`) and run
    it inside the error boundary with logging set up."""
    sig = inspect.signature(func, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "opts"]

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        kwargs.pop("help_all", None)  # typer passes it (False) although not exposed
        engine_values = {name.removeprefix(_PREFIX): kwargs.pop(name)
                         for name in list(kwargs) if name.startswith(_PREFIX)}
        debug = bool(engine_values.get("debug"))
        setup_logging(debug)
        with cli_errors(debug):
            return func(opts=_engine_options(engine_values), **kwargs)

    wrapper.__signature__ = sig.replace(  # type: ignore[attr-defined]
        parameters=own + _engine_parameters())
    return wrapper


# ---------------------------------------------------------------------- errors, logging


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions whose message is meant for the user: shown as one line."""
    from llmfast.config import ConfigError
    from llmfast.core.request import RequestRejected
    from llmfast.executor import ExecutorError
    from llmfast.models.sources.default_model import DefaultModelError
    from llmfast.models.loading.load_error import LoadError
    from llmfast.sampling_params import SamplingParamsError
    from llmfast.worker.startup.kv_cache_sizing import KVCacheOutOfMemory, KVCacheTooSmall

    return (ConfigError, LoadError, RequestRejected, SamplingParamsError, KVCacheTooSmall,
            KVCacheOutOfMemory, DefaultModelError, ExecutorError, ValueError, OSError)


def print_error(message: str) -> None:
    # markup=False: a message may contain [brackets] (paths, token lists).
    stderr_console().print(f"error: {message}", markup=False, soft_wrap=True, style="red")


@contextlib.contextmanager
def cli_errors(debug: bool) -> Iterator[None]:
    """The CLI boundary: a known error becomes `error: ...` and exit 1; anything else is a
    bug, reported the same way with a pointer to --debug. Ctrl-C exits 130 quietly."""
    try:
        yield
    except (typer.Exit, typer.Abort, typer.TyperException):
        raise
    except KeyboardInterrupt:
        stderr_console().print("interrupted", style="dim")
        raise typer.Exit(130) from None
    except _user_errors() as e:
        if debug:
            traceback.print_exc()
        print_error(one_line(e, max_chars=None))
        raise typer.Exit(1) from None
    except Exception as e:  # noqa: BLE001 - the last line of defence before a traceback
        if debug:
            traceback.print_exc()
        if _is_out_of_memory(e):
            print_error(_out_of_memory_message(e))
            raise typer.Exit(1) from None
        print_error(f"internal error: {type(e).__name__}: {one_line(e, max_chars=None)}"
                    + ("" if debug else " (run with --debug for the traceback)"))
        raise typer.Exit(1) from None


_CPU_ALLOC_FAILED = "can't allocate memory"  # torch's DefaultCPUAllocator, a RuntimeError
_ASKED_BYTES = re.compile(r"tried to allocate (\d+) bytes")


def _is_out_of_memory(e: BaseException) -> bool:
    # torch's OutOfMemoryError (CUDA), named so that torch is not imported here.
    return type(e).__name__ == "OutOfMemoryError" or (
        isinstance(e, RuntimeError) and _CPU_ALLOC_FAILED in str(e))


def _out_of_memory_message(e: BaseException) -> str:
    """One line for an allocation that failed: on CPU the asked size, usually from a step
    limit far above what the machine holds (`--max-num-seqs 99999999999`)."""
    asked = _ASKED_BYTES.search(str(e))
    where = ("device memory" if type(e).__name__ == "OutOfMemoryError" else "memory") + (
        f" ({int(asked[1]) / 2**30:.1f} GiB asked at once)" if asked else "")
    # --gpu-memory-utilization means nothing to the CPU's allocator.
    size_flag = ("--gpu-memory-utilization" if type(e).__name__ == "OutOfMemoryError"
                 else "--kv-cache-memory")
    return (f"out of {where}; lower --max-num-seqs, --max-num-batched-tokens or "
            f"{size_flag}, or use a smaller model")


def setup_logging(debug: bool) -> None:
    from rich.logging import RichHandler

    handler = RichHandler(console=stderr_console(), show_time=debug, show_path=debug,
                          markup=False, rich_tracebacks=False)
    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                        format="%(message)s", handlers=[handler], force=True)
    # Libraries we call are chatty at DEBUG; keep llmfast's own debug lines readable.
    for name in ("torch", "transformers", "matplotlib", "PIL", "filelock", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


# ---------------------------------------------------------------------- progress


def make_progress(console: Console | None = None) -> Progress:
    """A transient bar on stderr; off when stderr is not a terminal (logs, pipes, CI),
    where a bar would only leave blank lines behind."""
    console = console or stderr_console()
    return Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
        TaskProgressColumn(), TimeElapsedColumn(),  # no percentage while indeterminate
        console=console, transient=True, disable=not console.is_terminal,
    )


@contextlib.contextmanager
def stage_progress(console: Console | None = None, description: str = "starting the engine"
                   ) -> Iterator[StageProgress]:
    """A `progress(stage, fraction)` callback for start-up and the model fetch: one bar whose
    label is the current stage; a fraction of None shows an indeterminate bar. Where no
    bar is drawn (stderr not a terminal), a stage done once per model (download,
    conversion: a `OnceStage`) is a plain line, once."""
    console = console or stderr_console()
    printed: set[str] = set()
    with make_progress(console) as bar:
        task = bar.add_task(description, total=None)

        def report(stage: str, fraction: float | None) -> None:
            if isinstance(stage, OnceStage) and not console.is_terminal \
                    and stage not in printed:
                printed.add(stage)
                console.print(stage, markup=False, highlight=False, soft_wrap=True)
            if fraction is None:
                bar.update(task, description=stage, total=None)
            else:
                bar.update(task, description=stage, total=1.0, completed=fraction)

        yield report


@contextlib.contextmanager
def count_progress(description: str, console: Console | None = None
                   ) -> Iterator[CountProgress]:
    """A `progress(done, total)` callback for runners and LLM.generate."""
    with make_progress(console) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def load_llm(opts: EngineOptions, console: Console | None = None, **overrides: Any):
    """Build the LLM with a start-up progress bar (fetch, load, KV cache, compile, capture)."""
    from llmfast.llm import LLM

    with stage_progress(console) as report:
        return LLM(opts.model, progress=report, **opts.with_overrides(**overrides))


def sweep_overrides(sizes: Sequence[int], opts: EngineOptions) -> dict[str, int]:
    """Room for the largest batch in one step (`sweep_engine_limits`): raise the engine
    limits the user did not set; a limit the user set below the largest size is an error."""
    from llmfast.bench import sweep_engine_limits
    from llmfast.engine.args import default_step_limits, resolve_device

    kw = opts.engine_kwargs
    defaults = default_step_limits(resolve_device(kw.get("device", "auto")))
    return sweep_engine_limits(max(sizes), kw.get("max_num_seqs"),
                               kw.get("max_num_batched_tokens"), defaults)


def engine_stats(engine) -> dict[str, Any]:
    """Scheduler / prefix-cache statistics as a dict (engine.stats() gives a dataclass)."""
    import dataclasses

    stats = engine.stats()
    if dataclasses.is_dataclass(stats):
        return dataclasses.asdict(stats)
    return dict(stats or {})


def engine_argv(opts: EngineOptions) -> list[str]:
    """The engine flags that reproduce `opts` on another command line (a re-run of this
    process, e.g. under nsys)."""
    argv = ["--model", opts.model] if opts.model else []
    for flag in engine_flags():
        if flag.name in opts.engine_kwargs:
            argv += flag.to_argv(opts.engine_kwargs[flag.name])
    if opts.debug:
        argv.append("--debug")
    return argv
