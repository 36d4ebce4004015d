"""Triton kernel that writes the new tokens' K and V into the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from llmfast.config import FP8_E4M3_MAX
from llmfast.kernels.launch.launch_cache import LaunchCache, PlanCache, specialization_key


def check_launchable(kernel, tensor: torch.Tensor) -> None:
    """Fail clearly when CPU tensors meet compiled (not interpreted) kernels.

    Triton picks the interpreter when `@triton.jit` runs, i.e. at import, and its own
    standard library (tl.sum, ...) is decorated when triton itself is imported: so
    TRITON_INTERPRET=1 must be set before triton is imported, not just before a call.
    """
    if tensor.device.type != "cuda" and isinstance(kernel, triton.runtime.JITFunction):
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is imported"
        )


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@triton.jit
def _round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest float8_e4m3fn value (ties to even),
    still in fp32, so that the store's conversion is exact whatever its rounding: the
    Triton interpreter's fp32 -> fp8 conversion truncates past a binade edge (127.3 ->
    64), and the tests check the cache bit for bit. On a GPU it costs a few integer ops
    in a memory-bound kernel, and the hardware conversion then has nothing to round."""
    # Normal range: keep 3 of fp32's 23 mantissa bits, ties to even; a carry moves
    # into the exponent as it should (the bf16 rounding trick, 20 bits instead of 16).
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # -0x100000 = ~0xFFFFF
    normal = rounded.to(tl.float32, bitcast=True)
    # Subnormal range (|x| < 2^-6): multiples of 2^-9. Adding 1.5 * 2^14 puts |x| where
    # fp32's ulp is 2^-9, so the addition itself rounds (to nearest even) once; the sign
    # goes back on after, so that tiny negatives become -0 as the conversion makes them.
    sub = (tl.abs(x) + 24576.0) - 24576.0
    sub = tl.where(bits < 0, -sub, sub)
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def _cache_value(x, CLAMP: tl.constexpr):
    """x as the cache stores it before the store's conversion: an fp8 cache (CLAMP > 0)
    gets it clamped to +-CLAMP (e4m3fn has no inf: values past it would become NaN)
    and rounded to nearest even in float32; other caches get x as it is. A NaN stays
    NaN, as torch's clamp keeps it: put back after the clamp and the rounding, which
    lose it (a GPU's max returns the other operand, -CLAMP; the interpreter's numpy
    keeps the NaN, but the rounding's bit arithmetic turns some NaN payloads into 0)."""
    if CLAMP > 0:
        xf = x.to(tl.float32)
        rounded = _round_to_e4m3(tl.minimum(tl.maximum(xf, -CLAMP), CLAMP))
        x = tl.where(xf != xf, xf, rounded)
    return x


@triton.jit
def store_at_slot(cache_ptr, slot, stride_b, stride_s, offsets, x, mask,
                  BLOCK_SIZE: tl.constexpr, CLAMP: tl.constexpr):
    """A token's rows `x` into the paged cache at `slot` (block slot // BLOCK_SIZE, row
    slot % BLOCK_SIZE; `offsets` within that row, over heads and dims), converted as the
    cache stores them (`_cache_value`). The KV writes of kv_write.py, rope_cache.py and
    the fused decode kernel (triton/kernels.py) all store through it."""
    row = cache_ptr + (slot // BLOCK_SIZE) * stride_b + (slot % BLOCK_SIZE) * stride_s
    tl.store(row + offsets, _cache_value(x, CLAMP).to(cache_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    NUM_KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, CLAMP: tl.constexpr,
):
    # One program per token moves all of its [num_kv_heads, head_dim] K and V rows.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_DIM_P)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=mask)
    store_at_slot(k_cache_ptr, slot, stride_kcb, stride_kcs,
                   heads * stride_kch + dims * stride_kcd, k, mask, BLOCK_SIZE, CLAMP)
    store_at_slot(v_cache_ptr, slot, stride_vcb, stride_vcs,
                   heads * stride_vch + dims * stride_vcd, v, mask, BLOCK_SIZE, CLAMP)


def reshape_and_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = padding
) -> None:
    """Write k[i], v[i] into the caches at slot slot_mapping[i] (block = slot // block_size).

    With block_size 16 and slot_mapping [3, 80, -1], token 0 goes to block 0 offset 3,
    token 1 to block 5 offset 0 and token 2 is skipped. Grid = len(slot_mapping) (a
    shape), so the launch reads nothing from the device and can be captured in a CUDA
    graph; k and v may have more rows (as the reference allows): those are not written.
    """
    # Everything the launch derives from shapes, once per shape (every layer of a step,
    # and every step of a padded size, share it); with the dtypes in the key the plan
    # fixes the specialization but for the addresses (LaunchCache.launch_planned).
    key = (k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(), v.dtype,
           k_cache.shape, k_cache.stride(), k_cache.dtype, v_cache.stride(), v_cache.dtype,
           slot_mapping.shape, slot_mapping.dtype)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.add(key, _plan(k, v, k_cache, v_cache, slot_mapping))
    if plan.grid is None:  # no tokens
        return
    if not plan.is_cuda:
        check_launchable(_reshape_and_cache_kernel, k)
    _KV_WRITE_LAUNCHES.launch_planned(plan, plan.grid, (k, v, k_cache, v_cache, slot_mapping),
                                      (), plan.const_key, plan.constexprs, plan.strides)


@dataclass(frozen=True, eq=False, slots=True)  # hashed by identity: a launch key
class _KVWritePlan:
    is_cuda: bool
    grid: tuple[int, int, int] | None  # None: no tokens, nothing to launch
    strides: tuple[int, ...]  # k, v, k_cache, v_cache
    const_key: tuple  # stands for `constexprs` and the strides in the launch cache's key
    constexprs: dict


_PLANS = PlanCache()


def _plan(k, v, k_cache, v_cache, slot_mapping) -> _KVWritePlan:
    num_kv_heads, head_dim = k.shape[1:]
    num_tokens = slot_mapping.shape[0]
    if num_tokens > k.shape[0] or num_tokens > v.shape[0]:
        raise ValueError(f"slot_mapping has {num_tokens} slots for {k.shape[0]} keys and "
                         f"{v.shape[0]} values")
    block_size = k_cache.shape[1]
    num_warps = 4 if num_kv_heads * head_dim >= 1024 else 2
    clamp = cache_clamp(k_cache.dtype)
    strides = (*k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride())
    return _KVWritePlan(
        is_cuda=k.device.type == "cuda",
        grid=(num_tokens, 1, 1) if num_tokens else None,
        strides=strides,
        const_key=(num_kv_heads, head_dim, block_size, num_warps, clamp,
                   specialization_key((), strides)),
        constexprs=dict(NUM_KV_HEADS=num_kv_heads, HEADS_P=next_pow2(num_kv_heads),
                        HEAD_DIM=head_dim, HEAD_DIM_P=next_pow2(head_dim),
                        BLOCK_SIZE=block_size, CLAMP=clamp, num_warps=num_warps),
    )


def cache_clamp(cache_dtype: torch.dtype) -> float:
    """The bound K/V are clamped to before conversion into a cache of `cache_dtype`:
    float8_e4m3fn's largest finite value (it has no inf: larger values convert to NaN,
    or saturate, depending on the torch version); 0.0 = no clamp (other dtypes)."""
    return FP8_E4M3_MAX if cache_dtype == torch.float8_e4m3fn else 0.0


# Compiled KV-write kernels per specialization (kernels/launch/launch_cache.py).
_KV_WRITE_LAUNCHES = LaunchCache(_reshape_and_cache_kernel)
