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
