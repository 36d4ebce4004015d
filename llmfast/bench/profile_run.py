"""The profiling driver behind `llmfast profile`: a short decode workload, traced either
by Nsight Systems (the process re-runs itself under `nsys profile`) or by the torch
profiler (a Chrome/Perfetto JSON trace plus a markdown table of the top ops).

Both traces carry the engine's phase ranges from `llmfast.profiling.nvtx_ranges.nvtx_range`:
schedule, prepare_inputs, forward[<padded size>] (or forward[<size> full graph]), sample,
wait_output, update,
detokenize. The phase table itself comes from a `PhaseTimer` (host clock and CUDA events,
llmfast.profiling.phase_timing), not from the profiler: under CUDA graphs the profiler sees the
forward's launches, not its device time.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import re
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PHASES = ("schedule", "prepare_inputs", "forward", "sample", "wait_output", "update",
          "detokenize")
NSYS_TRACE = "trace"  # nsys adds .nsys-rep
TORCH_TRACE = "trace.json"
TOP_OPS = "top_ops.md"
NSYS_STATS = "nsys-stats.txt"


class ProfileError(ValueError):
    """A profile that cannot be taken as asked; the message is one user-facing line."""


# ---------------------------------------------------------------------- output directory


def model_label(spec: str | None) -> str:
    """A directory-safe name for a --model value."""
    if spec is None:
        from llmfast.models.sources.default_model import DEFAULT_MODEL_NAME

        return DEFAULT_MODEL_NAME
    name = Path(spec.rstrip("/")).name if not spec.startswith("random:") else spec
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "model"


def default_profile_dir(model: str | None, root: Path = Path("profiles"),
                        now: datetime.datetime | None = None) -> Path:
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return root / f"{stamp}-{model_label(model)}"


PROFILE_FILES = ("summary.json", TORCH_TRACE, TOP_OPS, f"{NSYS_TRACE}.nsys-rep", NSYS_STATS)


def prepare_profile_dir(path: Path, reuse: bool = False) -> bool:
    """Create the directory and prove it writable now, before any slow work; returns
    whether this call created it. A directory that already holds a profile is refused
    (its results would be overwritten) unless `reuse` (the run nsys starts inside the
    directory its parent just prepared)."""
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ProfileError(
            f"cannot write the profile directory {path}: {e.strerror or e}") from None
    held = [name for name in PROFILE_FILES if (path / name).exists()]
    if held and not reuse:
        raise ProfileError(f"{path} already holds a profile ({', '.join(held)}); "
                           "choose another --out or move it away")
    return created


@contextlib.contextmanager
def removed_if_failed(path: Path, created: bool) -> Iterator[None]:
    """A run that fails leaves no empty directory it created behind."""
    try:
        yield
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                path.rmdir()  # only if empty: whatever was written stays
        raise


# ---------------------------------------------------------------------- nsys


def nsys_command(nsys: str, out_dir: Path, inner_argv: Sequence[str]) -> list[str]:
    """`nsys profile` around the inner run. CUDA-graph replays are traced per node so the
    kernels inside a graph show up under their NVTX ranges."""
    return [nsys, "profile", "-t", "cuda,nvtx,osrt", "--cuda-graph-trace=node",
            "-o", str(out_dir / NSYS_TRACE), "--force-overwrite=true", *inner_argv]


def nsys_stats_command(nsys: str, report: Path) -> list[str]:
    return [nsys, "stats", "--force-export=true", str(report)]


@dataclass
class NsysResult:
    returncode: int
    report: Path | None  # the .nsys-rep, if nsys wrote one
    stats: Path | None  # the `nsys stats` summary


def run_nsys(nsys: str, out_dir: Path, inner_argv: Sequence[str],
             env: dict[str, str] | None = None) -> NsysResult:
    """Run the inner command under nsys, then summarise the report with `nsys stats`."""
    command = nsys_command(nsys, out_dir, inner_argv)
    logger.info("running %s", " ".join(command))
    try:
        code = subprocess.run(command, env=env, check=False).returncode
    except OSError as e:
        raise ProfileError(f"cannot run {nsys}: {e.strerror or e}") from None
    report = out_dir / f"{NSYS_TRACE}.nsys-rep"
    if not report.is_file():
        return NsysResult(code, None, None)
    stats_path = out_dir / NSYS_STATS
    try:
        stats = subprocess.run(nsys_stats_command(nsys, report), capture_output=True,
                               text=True, check=False)
        stats_path.write_text(stats.stdout + (stats.stderr and f"\n{stats.stderr}"))
    except OSError as e:
        logger.warning("nsys stats failed: %s", e)
        return NsysResult(code, report, None)
    return NsysResult(code, report, stats_path)


# ---------------------------------------------------------------------- workload


def run_decode_workload(engine, sizes: Sequence[int], steps: int, context: int,
                        seed: int = 0) -> list:
    """For each size: prefill a batch of `context`-token prompts, then `steps` decode
    steps (the sweep workload of `llmfast bench`)."""
    from llmfast.bench import run_sweep_point

    return [run_sweep_point(engine, size, context, steps, seed=seed) for size in sizes]




# ---------------------------------------------------------------------- torch profiler


@dataclass
class TorchProfile:
    trace: Path
    top_ops: Path
    phases: dict[str, dict[str, float]]  # name -> {"count", "total_ms"}
    result: Any  # what the workload returned


def timed_workload(engine, workload: Callable[[], Any]):
    """Run `workload` with a PhaseTimer on the engine: (its result, per-phase stats)."""
    from llmfast.profiling.phase_timing import PhaseTimer

    timer = PhaseTimer(engine.config.device)
    engine.set_phase_timer(timer)
    try:
        result = workload()
    finally:
        engine.set_phase_timer(None)
    return result, timer.summary()


def torch_profile(workload: Callable[[], Any], out_dir: Path, cuda: bool,
                  phases_md: Callable[[], str] | None = None) -> TorchProfile:
    """`phases_md`, called after the run, gives the phase table for top_ops.md (else the
    profiler's own wall time of each phase range)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from llmfast.utils.native_stderr import native_stderr_without

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = profile(activities=activities)
    with native_stderr_without():  # Kineto's USDT start/stop lines
        prof.start()
    try:
        result = workload()
        if cuda:
            torch.cuda.synchronize()
    finally:
        with native_stderr_without():
            prof.stop()
    trace = out_dir / TORCH_TRACE
    prof.export_chrome_trace(str(trace))
    averages = prof.key_averages()
    phases = phase_totals(averages)
    top = out_dir / TOP_OPS
    table = phases_md() if phases_md is not None else phases_markdown(phases)
    top.write_text("## Engine phases\n\n" + table
                   + "\n## Top ops\n\n" + top_ops_markdown(averages, cuda))
    return TorchProfile(trace, top, phases, result)


def is_phase(name: str) -> bool:
    return name in PHASES or name.startswith("forward[")


def phase_totals(averages) -> dict[str, dict[str, float]]:
    """Inclusive wall time of each phase range, summed over the run."""
    return {
        e.key: {"count": e.count, "total_ms": e.cpu_time_total / 1000}
        for e in averages if is_phase(e.key)
    }


def phases_markdown(phases: dict[str, dict[str, float]]) -> str:
    lines = ["| phase | calls | total ms | ms per call |", "|---|---:|---:|---:|"]
    for name, p in phases.items():
        lines.append(f"| `{name}` | {p['count']} | {p['total_ms']:.3f} | "
                     f"{p['total_ms'] / max(p['count'], 1):.3f} |")
    return "\n".join(lines) + "\n"


def top_ops_markdown(averages, cuda: bool, limit: int = 25) -> str:
    """The ops with the most self time (device time on CUDA), as a markdown table."""
    def self_time(e) -> float:
        return getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total

    ops = sorted((e for e in averages if not is_phase(e.key)), key=self_time, reverse=True)
    total = sum(self_time(e) for e in ops) or 1.0
    unit = "device" if cuda else "CPU"
    lines = [f"| op | calls | self {unit} ms | % | total CPU ms |", "|---|---:|---:|---:|---:|"]
    for e in ops[:limit]:
        name = e.key.replace("|", "\\|")
        lines.append(f"| `{name}` | {e.count} | {self_time(e) / 1000:.3f} | "
                     f"{100 * self_time(e) / total:.1f} | {e.cpu_time_total / 1000:.3f} |")
    return "\n".join(lines) + "\n"
