"""Rotary embedding of queries and keys as one Triton kernel per call, called by
compiled code as the triton op `llmfast::rotary_embedding` (kernels/layers/triton_ops.py:
Inductor launches the kernel from its compiled piece). Left to Inductor, the rotation
was three to five kernels on CUDA: the cos and sin gathers, a float32 copy of the input
and the rotation apart.

Numerics: the input rotated in float32 with the float32 cos/sin table, rounded once to
the input's dtype (the torch reference, models/rope.py, and HF do the same). On CPU
(and for inputs the kernel does not take) the torch reference.
"""

from __future__ import annotations

import torch

from llmfast.kernels.layers.kernel_choice import launchable, takes_layer_kernels
from llmfast.kernels.layers.rotary_reference import rope_cache_takes, rotary_reference

__all__ = ["rope_fuses_into_attention", "rotary_impl", "rotary_reference"]


def _kernel_takes(x: torch.Tensor, cos_sin: torch.Tensor) -> bool:
    # Static properties only (traced by Dynamo under torch.compile: see rms_norm.py).
    return (takes_layer_kernels(x) and x.dim() == 3 and x.stride(-1) == 1 and cos_sin.stride(-1) == 1
            and cos_sin.dtype == torch.float32 and x.shape[-1] % 2 == 0)


def rope_fuses_into_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cos_sin: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor) -> bool:
    """Whether the attention op can rotate q and k itself, in its KV write
    (attention/triton/rope_cache.py), instead of this module's kernel before it: the layer
    kernels are on for q's device and the kernel takes the inputs (`rope_cache_takes`,
    which rope_cache.py checks again when it plans a launch). Static properties only
    (traced)."""
    return takes_layer_kernels(q) and rope_cache_takes(q, k, v, cos_sin, k_cache, v_cache)


def rotary_impl(positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor,
                rotate_sign: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim] rotated by each token's position -> a new
    contiguous tensor. Eager callers may call this directly; compiled code the op."""
    if not _kernel_takes(x, cos_sin):
        return rotary_reference(positions, x, cos_sin, rotate_sign)
    num_tokens, heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if type(num_tokens) is int and num_tokens == 0:  # eager only (traced: a SymInt, never 0)
        return out
    half = head_dim // 2
    heads_p, half_p = 1 << (heads - 1).bit_length(), 1 << (half - 1).bit_length()
    launchable("rotary_kernel")[(num_tokens,)](
        x, positions, cos_sin, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        cos_sin.stride(0), heads, HALF=half, HALF_P=half_p, HEADS_P=heads_p,
        num_warps=max(1, min(8, heads_p * half_p // 512)),
    )
    return out
