"""Whether a tensor's kernels are Triton's: on CUDA, or on the CPU under Triton's
interpreter (`TRITON_INTERPRET=1`, the tests' way of running the kernels without a GPU).
The attention op and the layer kernels ask the same question."""

from __future__ import annotations

import os

import torch


def triton_interpret_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(x: torch.Tensor) -> bool:
    """Whether the kernels on `x`'s device are Triton's: on CUDA, or on CPU under the
    interpreter. (`x.is_cuda`: cheaper than comparing `x.device.type`, twice a layer
    per eager step.)"""
    return x.is_cuda or triton_interpret_enabled()
