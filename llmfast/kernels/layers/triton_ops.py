"""The decoder's triton ops (`torch.library.triton_op`): `llmfast::rms_norm`,
`llmfast::add_rms_norm`, `llmfast::rotary_embedding`. Registered by the compiler's entry
point (compile/compiled_model.py) before Dynamo traces a model, never at import:
registering a triton op imports torch._inductor and with it Dynamo and Triton (~1 s),
which an eager engine never needs. Eager models call the ops' bodies directly.
"""

from __future__ import annotations

import functools

import torch

from llmfast.kernels.layers.switch import layer_kernels, layer_kernels_enabled
from llmfast.kernels.layers.rms_norm import add_rms_norm_impl, rms_norm_impl
from llmfast.kernels.layers.rotary import rotary_impl


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_impl(x, weight, eps)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm_impl(x, residual, weight, eps)


def _rotary_embedding(positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor,
                      rotate_sign: torch.Tensor) -> torch.Tensor:
    return rotary_impl(positions, x, cos_sin, rotate_sign)


@functools.cache
def register_triton_ops() -> None:
    """Once per process. (Typed wrappers: the op schemas are inferred from them.) The
    kernels' module is imported here, before Dynamo traces the ops' bodies, which then
    find it loaded."""
    if layer_kernels_enabled():
        layer_kernels()
    for name, fn in (("rms_norm", _rms_norm), ("add_rms_norm", _add_rms_norm),
                     ("rotary_embedding", _rotary_embedding)):
        torch.library.triton_op(f"llmfast::{name}", fn, mutates_args=())
