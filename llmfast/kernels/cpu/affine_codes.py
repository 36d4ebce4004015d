"""A weight as unsigned integer codes with one affine map per group of columns
(`w = scale * code + offset`): what the packed CPU linears take. GGUF's block formats
decode to it (llmfast/models/formats/gguf_blocks.py); it lives here, below the models,
because the kernels consume it."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AffineCodes:
    """A weight [rows, cols] as codes and per-group affine maps."""

    codes: np.ndarray  # [rows, cols] uint8, each < 2**bits
    scale: np.ndarray  # [rows, cols // group] float32
    offset: np.ndarray  # [rows, cols // group] float32
    bits: int
    group: int

    def dequantize(self) -> np.ndarray:
        """float64 [rows, cols]: the reference the packed forms are tested against."""
        rows, cols = self.codes.shape
        codes = self.codes.astype(np.float64).reshape(rows, cols // self.group, self.group)
        w = codes * self.scale[..., None].astype(np.float64) + self.offset[..., None]
        return w.reshape(rows, cols)
