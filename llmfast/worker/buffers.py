"""`CpuGpuBuffer`: one persistent array seen three ways.

`.np` (numpy view for vectorised host maths), `.cpu` (pinned tensor on CUDA machines,
so the host-to-device copy is asynchronous) and `.gpu` (the device tensor the model
reads; on a CPU machine it *is* `.cpu`, so no copy happens). Allocated once; the
device tensor's address never changes, which CUDA-graph replay relies on.
"""

from __future__ import annotations

import numpy as np
import torch


class CpuGpuBuffer:
    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=pin)
        self.np: np.ndarray = self.cpu.numpy()
        self.gpu = self.cpu if device.type == "cpu" else torch.zeros_like(self.cpu, device=device)

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first `n` rows (all if None) to the device; returns the device view."""
        if n is None:
            if self.gpu is not self.cpu:
                self.gpu.copy_(self.cpu, non_blocking=True)
            return self.gpu
        if self.gpu is not self.cpu:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]


class StagingBuffer:
    """Pinned host memory and a device tensor for a per-step array whose size varies
    (padded penalty token ids, stop ids, step counters): `stage(array)` copies it to the
    device without a host sync. Grows (reallocates) only when a larger array comes.

    The host side is rewritten each step: on CUDA the runner waits for the previous
    step's input copies to finish before it writes (see ModelRunner), so a copy still in
    flight never reads a half-written buffer.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = dtype
        self.device = device
        self.cpu = torch.empty(0, dtype=dtype)
        self.gpu = self.cpu
        self._np = self.cpu.numpy()

    def _grow(self, numel: int) -> None:
        numel = max(numel, 2 * self.cpu.numel(), 256)
        pin = self.device.type == "cuda"
        self.cpu = torch.empty(numel, dtype=self.dtype, pin_memory=pin)
        self._np = self.cpu.numpy()
        self.gpu = self.cpu if not pin else torch.empty(numel, dtype=self.dtype,
                                                          device=self.device)

    def stage(self, array: np.ndarray) -> torch.Tensor:
        """The device copy of `array` (same shape), valid until the next `stage`."""
        numel = array.size
        # `not self.cpu.numel()`: before the first growth `.gpu` is the empty CPU tensor,
        # so an empty first array would come back on the CPU, not the device.
        if numel > self.cpu.numel() or not self.cpu.numel():
            self._grow(numel)
        self._np[:numel] = array.reshape(-1)
        if self.gpu is not self.cpu:
            self.gpu[:numel].copy_(self.cpu[:numel], non_blocking=True)
        return self.gpu[:numel].view(array.shape)
