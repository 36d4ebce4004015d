"""Rotary embedding fused into the KV write: one Triton kernel rotates a step's queries
(into a buffer the attention then reads) and keys (straight into the paged cache) and
copies the values, instead of a rotary kernel in the compiled piece before the
attention op and the KV write inside it (one kernel a layer fewer; at batch 1 the
rotation was ~1.3 us and a launch gap of its own).

Numerics are the unfused path's, bit for bit: the rotary kernel's float32 rotation
(kernels/layers/triton_kernels.py), rounded to the queries' dtype, and for the keys then
the KV write's conversion to the cache's dtype (an fp8 cache: clamped, rounded to
nearest even; kv_write.py). Queries are rotated for every token, padding included
(their attention rows are never read, but a dummy run's are), keys and values written
only where the slot is >= 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmfast.attention.triton.kv_write import (
    cache_clamp,
    check_launchable,
    next_pow2,
    store_at_slot,
)
from llmfast.kernels.launch.launch_cache import LaunchCache, PlanCache, specialization_key
from llmfast.kernels.layers.rotary_reference import rope_cache_takes
from llmfast.kernels.layers.triton_kernels import load_cos_sin, rotate_halves


@triton.jit
def _rope_and_cache_kernel(
    q_ptr, k_ptr, v_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch, stride_cs,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, Q_HEADS_P: tl.constexpr,
    KV_HEADS_P: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, CLAMP: tl.constexpr,
):
    # One program per token: all its query heads, then its key and value heads.
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_P)
    # The rotary kernel's own helpers (layers/triton_kernels.py): the same rounding.
    cos, sin = load_cos_sin(cos_sin_ptr, pos, stride_cs, HALF, HALF_P)
    q1, q2, q_mask = rotate_halves(q_ptr + t * stride_qt, stride_qh, NUM_HEADS, cos, sin,
                                   HALF, HALF_P, Q_HEADS_P)
    offs_qh = tl.arange(0, Q_HEADS_P)
    o = q_out_ptr + t * stride_ot + offs_qh[:, None] * stride_oh + offs_d[None, :]
    tl.store(o, q1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(o + HALF, q2.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    if slot < 0:  # a padding token: nothing to cache
        return

    k1, k2, kv_mask = rotate_halves(k_ptr + t * stride_kt, stride_kh, NUM_KV_HEADS, cos, sin,
                                    HALF, HALF_P, KV_HEADS_P)
    # Rounded to the queries' dtype first, as the rotary kernel stores keys before the
    # KV write reads them.
    k1 = k1.to(q_out_ptr.dtype.element_ty)
    k2 = k2.to(q_out_ptr.dtype.element_ty)
    offs_kh = tl.arange(0, KV_HEADS_P)
    v_src = v_ptr + t * stride_vt + offs_kh[:, None] * stride_vh + offs_d[None, :]
    v1 = tl.load(v_src, mask=kv_mask)
    v2 = tl.load(v_src + HALF, mask=kv_mask)
    # The KV write's store and conversion (kv_write.store_at_slot), half by half.
    k_at = offs_kh[:, None] * stride_kch + offs_d[None, :]
    v_at = offs_kh[:, None] * stride_vch + offs_d[None, :]
    store_at_slot(k_cache_ptr, slot, stride_kcb, stride_kcs, k_at, k1, kv_mask,
                   BLOCK_SIZE, CLAMP)
    store_at_slot(k_cache_ptr, slot, stride_kcb, stride_kcs, k_at + HALF, k2, kv_mask,
                   BLOCK_SIZE, CLAMP)
    store_at_slot(v_cache_ptr, slot, stride_vcb, stride_vcs, v_at, v1, kv_mask,
                   BLOCK_SIZE, CLAMP)
    store_at_slot(v_cache_ptr, slot, stride_vcb, stride_vcs, v_at + HALF, v2, kv_mask,
                   BLOCK_SIZE, CLAMP)


def rope_and_cache(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], not rotated
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], not rotated
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int
    cos_sin: torch.Tensor,  # [max_positions, head_dim] float32: cos of the half, then sin
    q_out: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the rotated queries
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
) -> None:
    """q_out = rope(q); the cache at slot_mapping[i] = rope(k[i]), v[i] (inputs
    `layers.rotary.rope_fuses_into_attention` takes; one program per slot_mapping
    entry, a shape: CUDA-graph safe)."""
    key = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, v.stride(),
           v.dtype, q_out.stride(), q_out.dtype, k_cache.shape, k_cache.stride(),
           k_cache.dtype, v_cache.stride(), v_cache.dtype, slot_mapping.shape,
           slot_mapping.dtype, positions.shape, positions.dtype, cos_sin.shape,
           cos_sin.stride(), cos_sin.dtype)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.add(key, _plan(q, k, v, q_out, k_cache, v_cache, slot_mapping,
                                     positions, cos_sin))
    if plan.grid is None:  # no tokens
        return
    if not plan.is_cuda:
        check_launchable(_rope_and_cache_kernel, q)
    _LAUNCHES.launch_planned(
        plan, plan.grid, (q, k, v, q_out, k_cache, v_cache, slot_mapping, positions, cos_sin),
        (), plan.const_key, plan.constexprs, plan.strides)


@dataclass(frozen=True, eq=False, slots=True)  # hashed by identity: a launch key
class _RopeCachePlan:
    is_cuda: bool
    grid: tuple[int, int, int] | None  # None: no tokens, nothing to launch
    strides: tuple[int, ...]
    const_key: tuple  # stands for `constexprs` and the strides in the launch cache's key
    constexprs: dict


_PLANS = PlanCache()


def _plan(q, k, v, q_out, k_cache, v_cache, slot_mapping, positions, cos_sin
          ) -> _RopeCachePlan:
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k.shape[1]
    num_tokens = slot_mapping.shape[0]
    if num_tokens > min(q.shape[0], k.shape[0], v.shape[0], q_out.shape[0],
                        positions.shape[0]):
        raise ValueError(f"slot_mapping has {num_tokens} slots for {q.shape[0]} queries, "
                         f"{k.shape[0]} keys, {v.shape[0]} values and "
                         f"{positions.shape[0]} positions")
    # What the kernel assumes (the decoder asks the same before passing positions:
    # layers/rotary.py, rope_fuses_into_attention), and an output like q.
    if not (rope_cache_takes(q, k, v, cos_sin, k_cache, v_cache)
            and q_out.dtype == q.dtype and q_out.stride(-1) == 1):
        raise ValueError("rope_and_cache takes contiguous, even head dims, q/k/q_out of one "
                         "dtype, a float32 cos/sin table as wide as a head and caches of one "
                         f"dtype; got q {q.dtype} {tuple(q.stride())}, k {k.dtype}, "
                         f"cos_sin {cos_sin.dtype} {tuple(cos_sin.shape)}, caches "
                         f"{k_cache.dtype}/{v_cache.dtype}")
    clamp = cache_clamp(k_cache.dtype)
    half = head_dim // 2
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               q_out.stride(0), q_out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
               cos_sin.stride(0))
    q_heads_p = next_pow2(num_heads)
    return _RopeCachePlan(
        is_cuda=q.device.type == "cuda",
        grid=(num_tokens, 1, 1) if num_tokens else None,
        strides=strides,
        const_key=(num_heads, num_kv_heads, head_dim, k_cache.shape[1], clamp,
                   specialization_key((), strides)),
        constexprs=dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, Q_HEADS_P=q_heads_p,
                        KV_HEADS_P=next_pow2(num_kv_heads), HALF=half, HALF_P=next_pow2(half),
                        BLOCK_SIZE=k_cache.shape[1], CLAMP=clamp,
                        num_warps=max(1, min(8, q_heads_p * next_pow2(half) // 512))),
    )


# Compiled kernels per specialization (kernels/launch/launch_cache.py).
_LAUNCHES = LaunchCache(_rope_and_cache_kernel)
