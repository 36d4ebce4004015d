"""Host and device time of the engine's phases, while profiling.

A `PhaseTimer` handed to the engine (`LLMEngine.set_phase_timer`) times every phase
range (schedule, prepare_inputs, forward[N], sample, wait_output, update, detokenize) on
the host clock, and on CUDA also records an event pair on the current stream: the time
between them is the phase's span on the device timeline. Under CUDA graphs the forward's
host time is a few replay launches while its device span is the real compute, so the
two columns differ; a host phase's device span only says how far the device moved
meanwhile, and is left out.

Device timestamps are put on the host clock through one reference event synchronised at
the start, so the host phases can be intersected with the device's busy intervals
(forward and sample spans): the host time spent while the device computes is overlapped
work, the goal of async scheduling. Nothing here runs unless a timer is installed.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch

# Phases whose work is queued on the device; the others are host-only.
DEVICE_PHASES = ("prepare_inputs", "forward", "sample")


def phase_name(range_name: str) -> str:
    """`forward[64]` -> `forward`."""
    return range_name.split("[", 1)[0]


@dataclass
class PhaseStats:
    calls: int
    host_ms: float  # total over the calls
    device_ms: float | None  # total device span (CUDA, device phases), else None
    overlap_ms: float | None  # host time inside the device's busy intervals (CUDA)

    def as_dict(self) -> dict:
        return {"count": self.calls, "host_ms": self.host_ms, "device_ms": self.device_ms,
                "overlap_ms": self.overlap_ms, "total_ms": self.host_ms}


class PhaseTimer:
    def __init__(self, device: torch.device | str, clock=time.perf_counter) -> None:
        """`clock`: the host clock (seconds); e.g. `time.thread_time` on a CPU host to
        leave out the time other processes take the core (the device columns and the
        overlap need the wall clock: on CUDA it must stay `perf_counter`)."""
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda and clock is not time.perf_counter:
            raise ValueError("on CUDA the phase timer's host clock must be time.perf_counter")
        self._clock = clock
        # (phase, host start, host end, device start event, device end event)
        self._records: list[tuple[str, float, float, object, object]] = []
        self._ref_event = None
        self._ref_host = 0.0
        if self.cuda:
            self._ref_event, self._ref_host = _reference_event()

    def begin(self, name: str) -> tuple:
        event = None
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        return (phase_name(name), self._clock(), event)

    def end(self, token: tuple) -> None:
        name, host_start, start_event = token
        host_end = self._clock()
        end_event = None
        if start_event is not None:
            end_event = torch.cuda.Event(enable_timing=True)
            end_event.record()
        self._records.append((name, host_start, host_end, start_event, end_event))

    # ------------------------------------------------------------------ results

    def _device_interval(self, start_event, end_event) -> tuple[float, float]:
        """The events' times on the host clock, in seconds."""
        ref = self._ref_event
        return (self._ref_host + ref.elapsed_time(start_event) / 1e3,
                self._ref_host + ref.elapsed_time(end_event) / 1e3)

    def per_call_ms(self, name: str, device: bool = True) -> list[float]:
        """Each call's time of a phase: device span on CUDA (device phases), else host."""
        if self.cuda and device:
            torch.cuda.synchronize()
            return [start.elapsed_time(end) for n, _, _, start, end in self._records
                    if n == name]
        return [(end - start) * 1e3 for n, start, end, _, _ in self._records if n == name]

    def clear(self) -> None:
        self._records.clear()

    def summary(self) -> dict[str, PhaseStats]:
        """Per phase, in first-seen order. Synchronises the device (call it after the run)."""
        if self.cuda:
            torch.cuda.synchronize()
        busy: list[tuple[float, float]] = []
        device_ms: dict[str, float] = {}
        if self.cuda:
            for name, _, _, start, end in self._records:
                if name in DEVICE_PHASES:
                    device_ms[name] = device_ms.get(name, 0.0) + start.elapsed_time(end)
                    if name != "prepare_inputs":  # copies: the device is not computing
                        busy.append(self._device_interval(start, end))
        busy = _merge(busy)
        stats: dict[str, PhaseStats] = {}
        for name, host_start, host_end, _, _ in self._records:
            s = stats.setdefault(name, PhaseStats(0, 0.0, device_ms.get(name),
                                                  0.0 if self.cuda else None))
            s.calls += 1
            s.host_ms += (host_end - host_start) * 1e3
            if self.cuda:
                s.overlap_ms += _intersection(host_start, host_end, busy) * 1e3
        return stats


def _reference_event() -> tuple[torch.cuda.Event, float]:
    """An event and the host time it completed at, to put device times on the host clock.

    On an idle device the event completes a few microseconds after it is recorded; the
    host polls for it (`query`, no blocking sync: waking from `synchronize` takes tens
    of microseconds, which would shift every device interval that much later than the
    host phases it is compared with) and takes the middle of [record, seen done]."""
    torch.cuda.synchronize()
    event = torch.cuda.Event(enable_timing=True)
    before = time.perf_counter()
    event.record()
    while not event.query():
        pass
    return event, (before + time.perf_counter()) / 2


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _intersection(start: float, end: float, merged: list[tuple[float, float]]) -> float:
    """Length of [start, end] inside the sorted, disjoint `merged` intervals."""
    i = max(bisect.bisect_right(merged, (start, float("inf"))) - 1, 0)
    total = 0.0
    while i < len(merged) and merged[i][0] < end:
        total += max(0.0, min(end, merged[i][1]) - max(start, merged[i][0]))
        i += 1
    return total


def phases_table_rows(stats: dict[str, PhaseStats]) -> list[list[str]]:
    """Rows for a table: phase, calls, host ms/call, device ms/call, host overlapped %."""
    rows = []
    for name, s in stats.items():
        per = s.host_ms / max(s.calls, 1)
        dev = "—" if s.device_ms is None else f"{s.device_ms / max(s.calls, 1):.3f}"
        overlap = "—" if s.overlap_ms is None else f"{100 * s.overlap_ms / max(s.host_ms, 1e-9):.0f}%"
        rows.append([name, str(s.calls), f"{per:.3f}", dev, overlap])
    return rows


PHASE_COLUMNS = ("phase", "calls", "host ms/call", "device ms/call", "host overlapped")


def phases_markdown(stats: dict[str, PhaseStats]) -> str:
    lines = ["| " + " | ".join(PHASE_COLUMNS) + " |", "|---|---:|---:|---:|---:|"]
    lines += ["| `" + r[0] + "` | " + " | ".join(r[1:]) + " |" for r in phases_table_rows(stats)]
    return "\n".join(lines) + "\n"
