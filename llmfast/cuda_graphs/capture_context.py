"""Capture-time process state: `graph_capture(name)` and the side stream captures run on.

Capture allocates many small Python objects (graph handles, weak output views); with
the heap frozen the collector does not rescan it for every one of hundreds of graphs.
The freeze is a counted hold (llmfast.utils.gc_freeze), so an engine's own hold and this one
compose: the heap is unfrozen only when the last hold ends.

CUDA graphs are captured on a side stream (capture on the default stream is an error).
`CaptureStream` keeps ONE such stream per model's graphs for every capture: per-stream
lazy state (cuBLAS workspaces are kept per handle and stream) is then created by the
first warm-up forward, outside any capture, and graphs sharing a memory pool share it
best when captured on one stream (torch.cuda.graph's note on `pool`). A fresh stream
for a later capture would allocate that state inside the capture.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

import torch

from llmfast.utils.gc_freeze import gc_frozen

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def graph_capture(name: str) -> Iterator[None]:
    start = time.perf_counter()
    with gc_frozen():
        try:
            yield
        finally:
            logger.debug("%s: %.2f s", name, time.perf_counter() - start)


class CaptureStream:
    """`with capture_stream.current():` makes the capture side stream current (CUDA; a
    no-op elsewhere, e.g. for the CPU emulation). The side stream first waits for the
    current stream's queued work (the buffers it filled), and the current stream waits
    for the side stream afterwards, so no host synchronisation is needed either way."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self.num_uses = 0

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        self.num_uses += 1
        if self.device.type != "cuda":
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        origin = torch.cuda.current_stream(self.device)
        stream.wait_stream(origin)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            origin.wait_stream(stream)
