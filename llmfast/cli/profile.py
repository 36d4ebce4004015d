"""`llmfast profile`: trace a short decode workload with nsys (when on PATH) or the
torch profiler, into `profiles/<timestamp>-<model>/`."""

from __future__ import annotations

import enum
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from llmfast.cli.common import (
    EngineOptions,
    engine_argv,
    load_llm,
    stderr_console,
    sweep_overrides,
)
from llmfast.utils.flag_values import SIZES_HELP, parse_sizes

PROFILE_EXAMPLES = """\
**Examples**

* `llmfast profile`  (batches of 1 and 8, 8 decode steps each, default model)

* `llmfast profile --sizes 1,64,256 --steps 16 --out profiles/h100-decode`

* `llmfast profile --model random:tiny --tracer torch`  (force the torch profiler)

With `nsys` on PATH the run is re-executed under `nsys profile` (open `trace.nsys-rep`
in nsys-ui); otherwise a torch-profiler trace `trace.json` is written (open it at
ui.perfetto.dev) with a `top_ops.md` table. Both show the engine's phases: schedule,
prepare_inputs, forward[N], sample, update, detokenize.
"""

# Set in the environment of the run under nsys, so it does not start nsys again.
_UNDER_NSYS = "LLMFAST_UNDER_NSYS"


class Tracer(str, enum.Enum):
    auto = "auto"
    nsys = "nsys"
    torch = "torch"
    none = "none"


def profile(
    *,
    opts: EngineOptions,
    sizes: Annotated[str, typer.Option("--sizes", help="Batch sizes to profile: "
                                       f"{SIZES_HELP}.")] = "1,8",
    steps: Annotated[int, typer.Option("--steps", help="Decode steps per size.")] = 8,
    context: Annotated[int, typer.Option("--context", help="Prompt tokens per request.")] = 64,
    out: Annotated[str | None, typer.Option("--out", "-o", help="Output directory.  "
                                             "[default: profiles/<timestamp>-<model>]",
                                             show_default=False)] = None,
    tracer: Annotated[Tracer, typer.Option("--tracer", help="auto: nsys if on PATH, else "
                                           "torch; none: only NVTX ranges (used under "
                                           "nsys).")] = Tracer.auto,
) -> None:
    """Profile a short decode workload (nsys or torch profiler) with the engine's phases."""
    from llmfast.cli.bench.checks import check_counts
    from llmfast.bench.profile_run import (
        default_profile_dir,
        prepare_profile_dir,
        removed_if_failed,
    )

    size_list = parse_sizes(sizes)
    check_counts({"--steps": steps, "--context": context})
    under_nsys = bool(os.environ.get(_UNDER_NSYS))
    nsys = shutil.which("nsys")
    if tracer is Tracer.nsys and nsys is None:
        raise ValueError("--tracer nsys: nsys is not on PATH (install Nsight Systems)")
    if out is not None and not out.strip():  # Path("") is the current directory
        raise ValueError("--out must not be empty (leave it out for the default directory)")
    out_dir = Path(out) if out is not None else default_profile_dir(opts.model)
    created = prepare_profile_dir(out_dir, reuse=under_nsys)
    err = stderr_console()
    con = Console(highlight=False, soft_wrap=True)  # never break a path across lines
    with removed_if_failed(out_dir, created):
        if tracer in (Tracer.auto, Tracer.nsys) and nsys and not under_nsys:
            inner = [sys.executable, "-m", "llmfast", "profile", "--sizes", sizes,
                     "--steps", str(steps), "--context", str(context), "--out", str(out_dir),
                     "--tracer", "none", *engine_argv(opts)]
            _profile_with_nsys(nsys, out_dir, inner, con, err)
            return
        kind = "none" if tracer in (Tracer.none, Tracer.nsys) or under_nsys else "torch"
        _profile_in_process(opts, size_list, steps, context, out_dir, kind, con, err)


def _profile_with_nsys(nsys: str, out_dir: Path, inner: list[str], con: Console,
                       err: Console) -> None:
    from llmfast.bench.profile_run import run_nsys

    err.print(f"running under {nsys} profile ...", style="dim")
    result = run_nsys(nsys, out_dir, inner, env={**os.environ, _UNDER_NSYS: "1"})
    if result.returncode != 0:
        raise ValueError(f"the profiled run failed under nsys (exit {result.returncode})")
    if result.report is None:
        raise ValueError(f"nsys wrote no report into {out_dir}")
    con.print(f"nsys report: {result.report}  (open it in Nsight Systems: nsys-ui "
              f"{result.report})", markup=False)
    if result.stats is not None:
        con.print(f"summary:     {result.stats}  (nsys stats)", markup=False)


def _profile_in_process(opts: EngineOptions, sizes: tuple[int, ...], steps: int, context: int,
                        out_dir: Path, kind: str, con: Console, err: Console) -> None:
    import dataclasses

    from llmfast.bench import environment_info, rank_device_facts, warm_up
    from llmfast.bench.profile_run import run_decode_workload, timed_workload, torch_profile
    from llmfast.profiling.phase_timing import phases_markdown

    llm = load_llm(opts, err, **sweep_overrides(sizes, opts))
    engine = llm.engine
    seed = opts.engine_kwargs.get("seed", 0)
    warm_up(engine)  # outside the trace: first-call costs would dominate it

    stats = {}

    def workload():
        points, stats["phases"] = timed_workload(
            engine, lambda: run_decode_workload(engine, sizes, steps, context, seed))
        return points

    summary = {"sizes": sizes, "steps": steps, "context": context, "tracer": kind,
               "model": engine.source.name,
               "environment": environment_info(rank_device_facts(engine.runner_info)),
               "startup": dict(engine.startup_times)}
    if kind == "torch":
        with err.status("profiling with the torch profiler ..."):
            traced = torch_profile(workload, out_dir, engine.config.device.startswith("cuda"),
                                   phases_md=lambda: phases_markdown(stats["phases"]))
        points = traced.result
    else:  # under nsys: the NVTX ranges are the trace
        points = workload()
    executor = engine.executor
    workers_note = _workers_note(executor.backend, executor.world_size) \
        if executor.local_runner is None else None
    summary["async_scheduling"] = engine.async_scheduling
    summary["executor"] = {"backend": executor.backend, "world_size": executor.world_size,
                           "note": workers_note}
    summary["phases"] = {name: s.as_dict() for name, s in stats["phases"].items()}
    summary["sweep"] = [dataclasses.asdict(p) for p in points]
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    con.print(_phase_table(stats["phases"], engine.async_scheduling, workers_note))
    if kind == "torch":
        con.print(f"trace:   {traced.trace}  (open it at https://ui.perfetto.dev or "
                  "chrome://tracing)", markup=False)
        con.print(f"top ops: {traced.top_ops}", markup=False)
    con.print(f"summary: {out_dir / 'summary.json'}", markup=False)


def _workers_note(backend: str, world_size: int) -> str:
    return (f"the model runs in {world_size} {backend} worker(s): prepare_inputs, forward "
            "and sample run there, untimed and (torch profiler) untraced here; wait_output "
            "is this process waiting for rank 0's tokens")


def _phase_table(phases, async_scheduling: bool, workers_note: str | None = None):
    """The phase table; on a CPU (no CUDA events) the device columns, empty, are left
    out and the title says the times are host times."""
    from rich.table import Table

    from llmfast.profiling.phase_timing import PHASE_COLUMNS, phases_table_rows

    rows = phases_table_rows(phases)
    timed = any(s.device_ms is not None for s in phases.values())
    keep = [i for i, col in enumerate(PHASE_COLUMNS)
            if timed or col not in ("device ms/call", "host overlapped")]
    mode = "async scheduling" if async_scheduling else "synchronous loop"
    source = "device time from CUDA events" if timed else "host time; no device timing on CPU"
    caption = ("host overlapped: the share of the phase's host time spent while the device "
               "computed a forward or a sample") if timed else None
    notes = [n for n in (caption, workers_note) if n]
    table = Table(title=f"engine phases ({mode}; {source})",
                  caption="\n".join(notes) if notes else None)
    for i in keep:
        table.add_column(PHASE_COLUMNS[i], justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(row[i] for i in keep))
    return table
