"""NVTX ranges for the engine's phases.

On CUDA the ranges go to NVTX (seen by nsys); everywhere they are also torch-profiler
`record_function` ranges, so a CPU trace carries the same names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

try:
    import nvtx as _nvtx
except ImportError:  # the nvtx package is a dependency, but keep CPU use working without it
    _nvtx = None


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    with torch.profiler.record_function(name):
        if _nvtx is not None and torch.cuda.is_available():
            with _nvtx.annotate(name):
                yield
        else:
            yield
