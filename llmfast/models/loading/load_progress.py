"""Weight-loading progress in bytes: the loader counts what it has written, and the
`progress(stage, fraction)` callback (the CLI's bar) shows the stage as
`loading weights 1.21/2.47 GB at 3.10 GB/s`."""

from __future__ import annotations

import time

import torch

from llmfast.utils.progress import Progress


class ByteProgress:
    """Reports at most every `interval_s` (a 1B model has ~150 tensors, an 8B one ~300;
    the bar need not redraw for each). On CUDA the device is synchronised before each
    report, so GB/s counts bytes that have landed, not bytes queued."""

    def __init__(self, stage: str, total_bytes: int, progress: Progress | None,
                 device: torch.device, interval_s: float = 0.1) -> None:
        self.stage = stage
        self.total_bytes = max(total_bytes, 1)
        self.progress = progress
        self.device = device
        self.interval_s = interval_s
        self.done_bytes = 0
        self.t0 = time.perf_counter()
        self._last_report = -float("inf")

    def add(self, nbytes: int) -> None:
        self.done_bytes += nbytes
        if self.progress is not None and time.perf_counter() - self._last_report >= self.interval_s:
            self._report()

    def finish(self) -> float:
        """Waits for the device and reports the end; returns the bytes per second."""
        self._sync()
        if self.progress is not None:
            self._report()
        return self.done_bytes / max(time.perf_counter() - self.t0, 1e-9)

    def label(self, elapsed_s: float) -> str:
        rate = self.done_bytes / max(elapsed_s, 1e-9) / 1e9
        return (f"{self.stage} {self.done_bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB "
                f"at {rate:.2f} GB/s")

    def _report(self) -> None:
        self._sync()
        now = time.perf_counter()
        self._last_report = now
        assert self.progress is not None
        self.progress(self.label(now - self.t0), min(self.done_bytes / self.total_bytes, 1.0))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
