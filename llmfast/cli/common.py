"""What every `llmfast` command shares: the engine flags, the error boundary (one-line
`error: ...` on stderr, a traceback only under --debug), logging, and the start-up
progress bar.

The engine flags are declared once and appended to each command's signature by
`engine_command`, so every command takes them without repeating thirty lines of options.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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

logger = logging.getLogger(__name__)

ENGINE_PANEL = "Engine"


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


# ---------------------------------------------------------------------- parsing

_BYTES = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str, flag: str = "--kv-cache-memory") -> int:
    """`512MiB`, `2GiB`, `1.5GB`, `512M` (binary), or plain bytes."""
    match = _BYTES.match(text)
    unit = (match[2] or "").lower() if match else None
    if match is None or unit not in _UNITS:
        raise typer.BadParameter(
            f"cannot read {text!r} as a size; use e.g. 512MiB, 2GiB or a number of bytes",
            param_hint=f"'{flag}'")
    value = int(float(match[1]) * _UNITS[unit])
    if value <= 0:
        raise typer.BadParameter(f"the size must be > 0, got {text!r}", param_hint=f"'{flag}'")
    return value


# ---------------------------------------------------------------------- sampling flags

# Shared by chat and generate (their defaults differ, so each command sets its own).
Temperature = Annotated[float, typer.Option("--temperature", "-t",
                                            help="Sampling temperature; 0 is greedy.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1].")]
TopK = Annotated[int, typer.Option("--top-k", help="Keep the k likeliest tokens; 0 = off.")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", help="Most tokens to generate.")]
IgnoreEos = Annotated[bool, typer.Option("--ignore-eos", help="Do not stop at end-of-text.")]
System = Annotated[str | None, typer.Option("--system", "-s", help="System prompt.")]


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


def _opt(*decls: str, help: str, **kwargs: Any) -> Any:
    return typer.Option(*decls, help=help, rich_help_panel=ENGINE_PANEL, **kwargs)


# name -> (type, Option, default). Order is the order in --help.
_ENGINE_FLAGS: dict[str, tuple[Any, Any, Any]] = {
    "model": (str | None, _opt(
        "--model", "-m",
        help="A local HF Llama directory, a .gguf file, random:PRESET (tiny, smollm2-135m, "
             "llama-3.2-1b, ...) or 'default'.  [default: SmolLM2-135M-Instruct, fetched once]"),
        None),
    "dtype": (str | None, _opt(
        "--dtype",
        help="float32, bfloat16 or float16.  [default: float32 on CPU, bfloat16 on CUDA]"),
        None),
    "device": (str | None, _opt("--device", help="auto, cpu, cuda or cuda:N.  [default: auto]"),
               None),
    "seed": (int | None, _opt("--seed", help="Seed of the engine's random state (random "
                                             "weights, sampling).  [default: 0]"), None),
    "max_num_seqs": (int | None, _opt(
        "--max-num-seqs", help="Most requests in one step.  [default: 256 on CPU, 512 on CUDA]"),
        None),
    "max_num_batched_tokens": (int | None, _opt(
        "--max-num-batched-tokens",
        help="Token budget of one step.  [default: 2048 on CPU, 8192 on CUDA]"), None),
    "max_model_len": (int | None, _opt(
        "--max-model-len", help="Longest sequence (prompt + output). [default: the model's, "
                                "at most 8192]"), None),
    "block_size": (int | None, _opt("--block-size", help="Tokens per KV-cache block."), None),
    "kv_cache_memory": (str | None, _opt(
        "--kv-cache-memory", help="KV-cache size on CPU, e.g. 512MiB, 2GiB or bytes."), None),
    "gpu_memory_utilization": (float | None, _opt(
        "--gpu-memory-utilization", help="Fraction of GPU memory llmfast may use (0, 1]."), None),
    "enforce_eager": (bool, _opt("--enforce-eager",
                                 help="Plain PyTorch: no torch.compile, no CUDA graphs."), False),
    "compile": (bool | None, _opt(
        "--compile/--no-compile", help="torch.compile the model.  [default: on for CUDA]"), None),
    "no_cuda_graphs": (bool, _opt("--no-cuda-graphs",
                                  help="Run compiled without replaying CUDA graphs "
                                       "(= --cuda-graph-mode none)."), False),
    "cuda_graph_mode": (str | None, _opt(
        "--cuda-graph-mode",
        help="none, piecewise, full_decode or full_and_piecewise: full graphs of the whole "
             "forward for pure-decode steps, piecewise graphs for the others.  [default: "
             "full_and_piecewise on CUDA; off on CPU]"), None),
    "cuda_graph_sizes": (str | None, _opt(
        "--cuda-graph-sizes", help="Padded sizes to capture: 1,2,4,8 or 8..256:8."), None),
    "no_prefix_caching": (bool, _opt("--no-prefix-caching",
                                     help="Do not reuse KV blocks of shared prefixes."), False),
    "debug": (bool, _opt("--debug", help="Debug logging; tracebacks on errors."), False),
}


def _engine_options(values: dict[str, Any]) -> EngineOptions:
    from llmfast.bench import parse_sizes
    from llmfast.config import parse_cuda_graph_mode

    kwargs: dict[str, Any] = {}
    for name in ("dtype", "device", "seed", "max_num_seqs", "max_num_batched_tokens",
                 "max_model_len", "block_size", "gpu_memory_utilization", "compile"):
        if values[name] is not None:
            kwargs[name] = values[name]
    if values["kv_cache_memory"] is not None:
        kwargs["kv_cache_memory"] = parse_bytes(values["kv_cache_memory"])
    if values["enforce_eager"]:
        kwargs["enforce_eager"] = True
    if values["no_cuda_graphs"]:
        kwargs["cuda_graphs"] = False
    if values["cuda_graph_mode"] is not None:
        kwargs["cuda_graph_mode"] = parse_cuda_graph_mode(values["cuda_graph_mode"]).value
    if values["no_prefix_caching"]:
        kwargs["enable_prefix_caching"] = False
    if values["cuda_graph_sizes"] is not None:
        kwargs["cuda_graph_sizes"] = tuple(parse_sizes(values["cuda_graph_sizes"],
                                                       flag="--cuda-graph-sizes"))
    model = values["model"]
    return EngineOptions(model=None if model in (None, "", "default") else model,
                         debug=values["debug"], engine_kwargs=kwargs)


def engine_command(func: Callable[..., Any]) -> Callable[..., Any]:
    """Give a command the engine flags (it receives them as `opts: EngineOptions`) and run
    it inside the error boundary with logging set up."""
    sig = inspect.signature(func, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "opts"]
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                          annotation=Annotated[kind, option])
        for name, (kind, option, default) in _ENGINE_FLAGS.items()
    ]

    @functools.wraps(func)
    def wrapper(**kwargs: Any) -> Any:
        debug = bool(kwargs.get("debug"))
        setup_logging(debug)
        with cli_errors(debug):
            opts = _engine_options({name: kwargs.pop(name) for name in _ENGINE_FLAGS})
            return func(opts=opts, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + extra)  # type: ignore[attr-defined]
    return wrapper


# ---------------------------------------------------------------------- errors, logging


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions whose message is meant for the user: shown as one line."""
    from llmfast.config import ConfigError
    from llmfast.worker.kv_cache_sizing import KVCacheOutOfMemory, KVCacheTooSmall
    from llmfast.models.default_model import DefaultModelError
    from llmfast.models.loader import LoadError
    from llmfast.core.request import RequestRejected
    from llmfast.sampling_params import SamplingParamsError

    return (ConfigError, LoadError, RequestRejected, SamplingParamsError, KVCacheTooSmall,
            KVCacheOutOfMemory, DefaultModelError, ValueError, OSError)


def one_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


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
        print_error(one_line(e))
        raise typer.Exit(1) from None
    except Exception as e:  # noqa: BLE001 - the last line of defence before a traceback
        if debug:
            traceback.print_exc()
        if type(e).__name__ == "OutOfMemoryError":  # torch's, without importing torch here
            print_error("out of device memory; lower --max-num-seqs, --max-num-batched-tokens "
                        "or --gpu-memory-utilization, or use a smaller model")
            raise typer.Exit(1) from None
        print_error(f"internal error: {type(e).__name__}: {one_line(e)}"
                    + ("" if debug else " (run with --debug for the traceback)"))
        raise typer.Exit(1) from None


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
def stage_progress(console: Console | None = None) -> Iterator[Callable[[str, float | None], None]]:
    """A `progress(stage, fraction)` callback for start-up and the model fetch: one bar whose
    label is the current stage; a fraction of None shows an indeterminate bar."""
    with make_progress(console) as bar:
        task = bar.add_task("starting the engine", total=None)

        def report(stage: str, fraction: float | None) -> None:
            if fraction is None:
                bar.update(task, description=stage, total=None)
            else:
                bar.update(task, description=stage, total=1.0, completed=fraction)

        yield report


@contextlib.contextmanager
def count_progress(description: str, console: Console | None = None
                   ) -> Iterator[Callable[[int, int], None]]:
    """A `progress(done, total)` callback for runners and LLM.generate."""
    with make_progress(console) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def load_llm(opts: EngineOptions, console: Console | None = None, **overrides: Any):
    """Build the LLM with a start-up progress bar (fetch, load, KV cache, compile, capture)."""
    from llmfast.llm import LLM

    with stage_progress(console) as report:
        return LLM(opts.model, progress=report, **opts.with_overrides(**overrides))


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
    kw = opts.engine_kwargs
    for name in ("dtype", "device", "seed", "max_num_seqs", "max_num_batched_tokens",
                 "max_model_len", "block_size", "kv_cache_memory", "gpu_memory_utilization"):
        if name in kw:
            argv += ["--" + name.replace("_", "-"), str(kw[name])]
    if kw.get("enforce_eager"):
        argv.append("--enforce-eager")
    if "compile" in kw:
        argv.append("--compile" if kw["compile"] else "--no-compile")
    if kw.get("cuda_graphs") is False:
        argv.append("--no-cuda-graphs")
    if "cuda_graph_mode" in kw:
        argv += ["--cuda-graph-mode", str(kw["cuda_graph_mode"])]
    if "cuda_graph_sizes" in kw:
        argv += ["--cuda-graph-sizes", ",".join(map(str, kw["cuda_graph_sizes"]))]
    if kw.get("enable_prefix_caching") is False:
        argv.append("--no-prefix-caching")
    if opts.debug:
        argv.append("--debug")
    return argv
