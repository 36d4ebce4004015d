"""Timing helpers shared by scripts/bench_kernels.py and bench_kernels_prefill.py (CUDA)."""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from llmfast.attention.tuning.prefill_measure import median_device_us_interleaved
from llmfast.attention.workspaces import AttentionWorkspaces

L2_FLUSH_BYTES = 256 << 20


def time_us(fn, iters: int, flush: torch.Tensor, idle: bool = False) -> float:
    """Median microseconds of fn() between CUDA events, L2 flushed before each call.

    `idle`: wait for the flush before the start event, so the GPU is idle when fn() is
    launched and its host launch time lies between the events (the "eager launch"
    figures: what a call costs when launched on its own). Otherwise the ~90 µs flush
    still runs when fn() is launched and hides any launch time under it (CUDA-graph
    replays and bandwidth, where the kernel's own time is the figure)."""
    return time_us_interleaved([fn], iters, flush, idle)[0]


def time_us_interleaved(fns, iters: int, flush: torch.Tensor, idle: bool = False
                        ) -> list[float]:
    """time_us of each of `fns`, their calls interleaved (f0, f1, f0, f1, ...) rather than
    one function's run after the other's: for a ratio between them. An eager figure
    holds host time, which drifts (clocks, the other processes), so two runs taken one
    after the other can differ by ~10 % for the same kernel (2026-11-26's H100 table:
    13 µs between two launches of one variant at batch 8, 8k)."""
    if not idle:
        return median_device_us_interleaved(fns, iters, warmup=3, before=flush.zero_)

    def flush_and_wait() -> None:
        flush.zero_()
        torch.cuda.synchronize()

    return median_device_us_interleaved(fns, iters, warmup=3, before=flush_and_wait)


ULP_FLOOR = 2.0**-4  # values below this are measured in the ulps of this


def max_diff_ulps(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest difference in units of `dtype`'s last place at the reference value
    (at least at ULP_FLOOR: near zero, ulps shrink without end while the absolute
    rounding of a sum of bf16 products does not). A fixed absolute bar (#17's 4e-3) is
    about half a bf16 ulp for outputs of magnitude >= 1 (early causal rows average few
    values), so one rounding step there reads as a failure; this says how many steps."""
    magnitude = want.abs().clamp_min(ULP_FLOOR)
    scale = torch.exp2(torch.floor(torch.log2(magnitude)))
    return ((got - want).abs() / (scale * torch.finfo(dtype).eps)).max().item()


def graph_replay(fn):
    """fn captured into a CUDA graph (after a warm-up call); returns the replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def host_launch_us(fn, calls: int = 200) -> float:
    """Host wall-clock microseconds per call of `calls` back-to-back launches."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return host / calls * 1e6


def copy_bandwidth(flush: torch.Tensor, iters: int) -> float:
    """GB/s of a 1 GiB device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), iters, flush)
    return 2 * src.numel() / us / 1e3


def paged_copy(k: torch.Tensor, v: torch.Tensor, block_size: int, gen: torch.Generator):
    """k, v [B, L, kv_heads, hd] -> k_cache, v_cache [num_blocks, block_size, kv_heads, hd]
    and block_table [B, blocks per request], each request's blocks scattered over a
    shuffled pool."""
    batch, length = k.shape[:2]
    blocks_per_req = -(-length // block_size)
    perm = torch.randperm(batch * blocks_per_req, generator=gen, device="cuda")
    block_table = perm.view(batch, blocks_per_req).to(torch.int32)
    pos = torch.arange(length, device="cuda")
    slots = block_table[:, pos // block_size].long() * block_size + pos % block_size  # [B, L]
    caches = []
    for x in (k, v):
        cache = torch.empty(perm.numel(), block_size, *x.shape[2:], dtype=x.dtype, device="cuda")
        cache.view(-1, *x.shape[2:])[slots.view(-1)] = x.reshape(-1, *x.shape[2:])
        caches.append(cache)
    return caches[0], caches[1], block_table


class DecodeCase(NamedTuple):  # (not a dataclass: scripts load this file by path too)
    """One decode step of `batch` requests, one query token each at the end of `ctx`
    keys: q [B, heads, hd], the keys and values [B, ctx, kv_heads, hd], their paged copy
    (blocks shuffled over the pool, `paged_copy`) with its block table, the step's
    query_start_loc and seq_lens, an output buffer, and the workspaces that own the
    cache's split scratch (held for the case's life, as the runner holds its own)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    out: torch.Tensor
    workspaces: AttentionWorkspaces


def decode_case(batch: int, ctx: int, heads: int, kv_heads: int, head_dim: int,
                block_size: int, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16
                ) -> DecodeCase:
    """Random decode inputs on cuda:0 (q and k from `gen`, v from the default generator)."""
    dev = torch.device("cuda", 0)
    q = torch.randn(batch, heads, head_dim, dtype=dtype, device=dev, generator=gen)
    k = torch.randn(batch, ctx, kv_heads, head_dim, dtype=dtype, device=dev, generator=gen)
    v = torch.randn_like(k)
    k_cache, v_cache, table = paged_copy(k, v, block_size, gen)
    return DecodeCase(q, k, v, k_cache, v_cache, table,
                      torch.arange(batch + 1, dtype=torch.int32, device=dev),
                      torch.full((batch,), ctx, dtype=torch.int32, device=dev),
                      torch.empty_like(q), AttentionWorkspaces([k_cache]))


def flash_backend():
    """SDPA pinned to FlashAttention, as a context to time the bare SDPA call in: entering
    `sdpa_kernel` costs ~12 us of host time (torch 2.11), as much as a whole small decode
    call, so it must not be inside the timed function."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def sdpa_flash(q_s, k_s, v_s, causal: bool, scale: float):
    """(fn, variant): torch SDPA on [B, heads, L, D] tensors, to run (and time) inside
    `flash_backend()`. Flash with enable_gqa when this torch accepts it; else K/V expanded
    to every query head beforehand (outside the timing; flash then reads group x more
    K/V, which a compute-bound prefill barely notices)."""
    import torch.nn.functional as F

    def run(k, v, gqa):
        return F.scaled_dot_product_attention(q_s, k, v, is_causal=causal, scale=scale,
                                              enable_gqa=gqa)

    try:
        with flash_backend():
            run(k_s, v_s, True)
        return (lambda: run(k_s, v_s, True)), "flash, enable_gqa"
    except RuntimeError:
        group = q_s.shape[1] // k_s.shape[1]
        k_x = k_s.repeat_interleave(group, dim=1)
        v_x = v_s.repeat_interleave(group, dim=1)
        with flash_backend():
            run(k_x, v_x, False)
        return (lambda: run(k_x, v_x, False)), "flash, K/V expanded to all heads"
