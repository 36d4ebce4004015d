"""How many threads torch's intra-op pool runs on a CPU: the cores this process may
really use, chosen at engine start-up.

torch starts with one thread per core of the affinity mask, and its OpenMP threads meet
at a barrier after every parallel op. A core that another process keeps busy makes every
op wait for the thread sharing it (a time slice, milliseconds, hundreds of ops per
decode step): on the 2-core CPU VM one busy process beside a batch-1 decode took it from
~29 ms to ~500 ms per step with 2 threads, ~70 ms with 1 (profiles/cpu.md). So
the count is: the cores of the affinity mask, at most the cgroup's CPU quota, less the
cores other processes kept busy while the weights loaded. `OMP_NUM_THREADS` (or a count
set with `torch.set_num_threads` before the engine starts) is the user's and is kept.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# The shortest window the load of other processes is measured over: /proc/stat counts
# in ticks of 10 ms, so 0.1 s on 2 cores is 20 ticks.
MIN_SAMPLE_S = 0.1

# The count this module last set, so that a later engine in the same process tells it
# from one the user set (and chooses again).
_chosen: list[int] = []


@dataclass(frozen=True)
class CpuTimes:
    """Clock ticks from /proc: of the allowed CPUs (busy, all) and of this process."""

    busy: int
    total: int
    own: int


def read_cpu_times(cpus: frozenset[int], stat_text: str, self_stat_text: str) -> CpuTimes:
    """`CpuTimes` from the text of /proc/stat and /proc/self/stat, counting the lines of
    `cpus` only. Busy is everything but idle and iowait (steal included: the hypervisor's
    other guests held the core)."""
    busy = total = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal [guest guest_nice: in user]
        ticks = [int(v) for v in rest.split()[:8]]
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    # The command name (field 2) may hold spaces: fields after its ')' from 3 on.
    fields = self_stat_text.rpartition(")")[2].split()
    own = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return CpuTimes(busy, total, own)


def sample_cpu_times(cpus: frozenset[int] | None = None) -> CpuTimes | None:
    """This moment's `CpuTimes` for the CPUs this process may run on; None where /proc
    cannot tell (not Linux)."""
    cpus = allowed_cpus() if cpus is None else cpus
    try:
        return read_cpu_times(cpus, Path("/proc/stat").read_text(),
                              Path("/proc/self/stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def others_busy_cores(before: CpuTimes, after: CpuTimes, num_cpus: int) -> float:
    """Cores that other processes kept busy between two samples (0 where no time passed)."""
    elapsed = (after.total - before.total) / max(num_cpus, 1)  # ticks per CPU
    if elapsed <= 0:
        return 0.0
    others = (after.busy - before.busy) - (after.own - before.own)
    return max(others, 0) / elapsed


def allowed_cpus() -> frozenset[int]:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def cgroup_cpu_quota(cgroup_text: str, root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the process's cgroups allow (quota / period; the tightest along its path),
    None without a limit. `cgroup_text`: /proc/self/cgroup. v2 (`cpu.max`, "max 100000"
    when unlimited) and v1 (`cpu.cfs_quota_us`, -1 when unlimited)."""
    limits = []
    for line in cgroup_text.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one hierarchy
            for folder in _up_to(root, path):
                quota = _read_first(folder / "cpu.max")
                if quota and quota[0] != "max" and len(quota) > 1:
                    limits.append(int(quota[0]) / int(quota[1]))
        elif "cpu" in controllers.split(","):
            for folder in _up_to(root / "cpu", path) + _up_to(root / "cpu,cpuacct", path):
                quota, period = (_read_first(folder / "cpu.cfs_quota_us"),
                                 _read_first(folder / "cpu.cfs_period_us"))
                if quota and period and int(quota[0]) > 0:
                    limits.append(int(quota[0]) / int(period[0]))
    return min(limits) if limits else None


def _up_to(root: Path, path: str) -> list[Path]:
    """`root/path` and each of its parents up to `root`."""
    parts = [p for p in path.strip("/").split("/") if p]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _read_first(path: Path) -> list[str] | None:
    try:
        return path.read_text().split()
    except (OSError, ValueError):
        return None


def choose_cpu_threads(num_allowed: int, quota: float | None, others_busy: float) -> int:
    """Threads for the intra-op pool: the allowed cores, at most the quota's whole CPUs,
    less the cores others keep busy (rounded: 0.4 of a core busy still leaves it to us),
    at least 1.

    Worked example, 2 cores, no quota: quiet (others 0.05) -> 2; one busy process beside
    the weight loading (it got ~0.7 of a core while we competed) -> round(1.3) = 1.
    """
    limit = num_allowed if quota is None else min(num_allowed, max(1, math.floor(quota)))
    capacity = num_allowed if quota is None else min(num_allowed, quota)
    return max(1, min(limit, round(capacity - others_busy)))


def cpu_threads_set_by_user(num_allowed: int) -> bool:
    """OMP_NUM_THREADS, or torch.set_num_threads to another count than torch's default
    (one per allowed core) and not by this module."""
    import torch

    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return True
    current = torch.get_num_threads()
    return current != num_allowed and current not in _chosen[-1:]


def configure_cpu_threads(before: CpuTimes | None, started: float) -> int | None:
    """Set torch's intra-op threads from the cores free now (`choose_cpu_threads`), the
    load of others measured since `before` (taken at `started`, a perf_counter time;
    waits until MIN_SAMPLE_S has passed). Returns the count set, None where the user set
    one (kept) or /proc cannot tell."""
    import torch

    cpus = allowed_cpus()
    if before is None or cpu_threads_set_by_user(len(cpus)):
        return None
    time.sleep(max(0.0, MIN_SAMPLE_S - (time.perf_counter() - started)))
    after = sample_cpu_times(cpus)
    if after is None:
        return None
    try:
        quota = cgroup_cpu_quota(Path("/proc/self/cgroup").read_text())
    except (OSError, ValueError):
        quota = None
    others = others_busy_cores(before, after, len(cpus))
    threads = choose_cpu_threads(len(cpus), quota, others)
    torch.set_num_threads(threads)
    _chosen[:] = [threads]
    logger.info("CPU threads: %d (%d cores allowed, cgroup quota %s, %.2f cores busy with "
                "other processes; OMP_NUM_THREADS sets them)", threads, len(cpus),
                "none" if quota is None else f"{quota:g}", others)
    return threads
