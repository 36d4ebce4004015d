"""Attention inputs for the kernel benchmarks of scripts/ (CUDA): keys and values in a
paged cache whose blocks are shuffled over the pool, one decode step's case, and torch
SDPA pinned to FlashAttention to compare against."""

from __future__ import annotations

from typing import NamedTuple

import torch

from llmfast.attention.workspaces import AttentionWorkspaces


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


class DecodeCase(NamedTuple):
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
