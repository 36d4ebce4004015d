"""NVTX ranges for the engine's phases.

On CUDA the ranges go to NVTX (seen by nsys); while a torch profiler runs they are also
`record_function` ranges, so a CPU trace carries the same names. With neither, a range
costs a few hundred nanoseconds: `record_function` alone is a dispatcher call (~10 us),
and the engine opens several ranges per step.
"""

from __future__ import annotations

import functools

import torch

try:
    import nvtx as _nvtx
except ImportError:  # the nvtx package is a dependency, but keep CPU use working without it
    _nvtx = None


@functools.cache
def _nvtx_enabled() -> bool:
    return _nvtx is not None and torch.cuda.is_available()


class _Range:
    __slots__ = ("_annotate", "_record", "_timer", "_token", "name")

    def __init__(self, name: str, timer=None) -> None:
        self.name = name
        self._record = None
        self._annotate = None
        self._timer = timer
        self._token = None

    def __enter__(self) -> None:
        if self._timer is not None:
            self._token = self._timer.begin(self.name)
        if torch.autograd._profiler_enabled():
            self._record = torch.profiler.record_function(self.name)
            self._record.__enter__()
        if _nvtx_enabled():
            self._annotate = _nvtx.annotate(self.name)
            self._annotate.__enter__()

    def __exit__(self, *exc) -> None:
        if self._annotate is not None:
            self._annotate.__exit__(*exc)
        if self._record is not None:
            self._record.__exit__(*exc)
        if self._token is not None:
            self._timer.end(self._token)


def nvtx_range(name: str, timer=None) -> _Range:
    """`with nvtx_range("schedule"): ...`; with a `PhaseTimer` (llmfast.profiling.phase_timing),
    the range is also timed on the host and, on CUDA, on the device."""
    return _Range(name, timer)
