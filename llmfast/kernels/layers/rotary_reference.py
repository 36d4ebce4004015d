"""The rotary embedding in torch: the oracle of the Triton kernels (layers/rotary.py,
rope_cache.py) and the CPU path; and which inputs the RoPE + KV-write kernel takes.
Imports torch only, so that the attention op (attention/ops.py) and rope_cache.py can use
it without importing the layers' kernel choice."""

from __future__ import annotations

import torch


def rotary_reference(positions: torch.Tensor, x: torch.Tensor, cos_sin: torch.Tensor,
                     rotate_sign: torch.Tensor) -> torch.Tensor:
    """out = [x1 cos - x2 sin, x2 cos + x1 sin] for halves x1, x2, written without a cat:
    the halves as an axis of size 2, swapped by a flip (`rotate_sign`: [[-1], [1]]).
    Inductor makes fewer kernels of that than of the cat form, and eager runs no more
    ops."""
    return rotate(x, *rope_rows(positions, cos_sin, rotate_sign))


def rope_rows(positions: torch.Tensor, cos_sin: torch.Tensor,
              rotate_sign: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the table `rotate` multiplies by: cos [num_tokens, 1, 1, head_dim / 2]
    and the signed sin [num_tokens, 1, 2, head_dim / 2] (-sin for the first output half,
    +sin for the second). The same for every layer of a step (attention/cpu_step.py
    keeps them)."""
    cos, sin = cos_sin[positions].chunk(2, dim=-1)  # [num_tokens, head_dim / 2]
    return cos[:, None, None, :], sin[:, None, None, :] * rotate_sign


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, heads, head_dim] rotated by `rope_rows`' rows, in float32, rounded
    once to x's dtype. (Multiplying by the sign first is exact: the same values as
    signing the product.)"""
    halves = x.float().unflatten(-1, (2, -1))  # [num_tokens, heads, 2, head_dim / 2]
    rotated = (halves * cos + halves.flip(-2) * signed_sin).flatten(-2)
    return rotated if x.dtype == torch.float32 else rotated.to(x.dtype)


def rotate_sign(device: torch.device) -> torch.Tensor:
    """[[-1], [1]] on `device` (made by fills, not a host copy: safe while a CUDA graph
    is being captured)."""
    sign = torch.ones(2, 1, device=device)
    sign[0] = -1.0
    return sign


def rope_cache_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether attention/triton/rope_cache.py takes these: head dims contiguous and even, q and k
    of one dtype, a float32 cos/sin table as wide as a head, caches of one dtype. Static
    properties only (the decoder asks while Dynamo traces it)."""
    head_dim = q.shape[-1]
    return (head_dim % 2 == 0 and cos_sin.dtype == torch.float32
            and cos_sin.shape[-1] == head_dim and k.dtype == q.dtype
            and k_cache.dtype == v_cache.dtype
            and all(t.stride(-1) == 1 for t in (q, k, v, cos_sin, k_cache, v_cache)))
