"""Launch configuration of the unified attention kernel: tile sizes, warps, stages and
the number of KV splits, from host-known shapes only (the same for a padded batch, so
a CUDA graph captured at one padded size keeps its launch whatever the live lengths).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from llmfast.attention.triton.kv_write import next_pow2
from llmfast.attention.tuning.prefill_tuning import PrefillTiles, heuristic_tiles, kv_dtype_name
from llmfast.attention.tuning.split_table import (
    DEFAULT_DECODE_STAGES,
    MAX_SPLITS,
    SplitTable,
    find_table,
)


@dataclass(frozen=True)
class DecodeRegion:
    """How a prefill-like launch serves its decode requests (at most `block_q` query
    tokens each): programs of their own with decode tiles, `num_splits` per request
    (triton/kernels.py), instead of prefill-sized tiles that are mostly padding."""

    block_q: int
    block_n: int
    num_splits: int
    one_kv_loop: bool = False  # as AttentionConfig's


@dataclass(frozen=True)
class AttentionConfig:
    block_q: int  # query tokens per tile; rows per tile = block_q * next_pow2(group)
    block_n: int  # keys per inner-loop step
    num_splits: int  # kv splits (flash-decoding) when > 1
    num_warps: int
    num_stages: int
    # With the fused merge, splits hold at least this many key tiles of the *live*
    # context (triton/kernels.py): fewer splits than num_splits at short contexts.
    min_split_tiles: int = 2
    # Prefill-like launches of several requests: the decode requests' programs.
    decode_region: DecodeRegion | None = None
    # Walk the key tiles in one masked loop instead of an unmasked bulk loop and a
    # masked tail loop (triton/kernels.py): the tail's loads pipelined with the rest.
    one_kv_loop: bool = False


# Decode tiles walk their keys in one loop (AttentionConfig.one_kv_loop): on an H100
# (2026-11-26, `bench_kernels.py decode-configs`, profiles/kernels.md) each form's
# best config over 16 decode shapes (head dim 64 and 128, B=1..64, 140-8192 keys): one
# loop / two = 0.976 (median; 0.93-1.03), B=64 never slower.
DECODE_ONE_KV_LOOP = True

_DECODE_REGION: bool | None = None
_DECODE_ROPE: bool | None = None


def decode_rope_enabled() -> bool:
    """Whether uniform decode steps rotate and cache their new tokens inside the attention
    kernel (`_decode_rope_attention_kernel`; the default) rather than in a kernel of
    their own first; `LLMFAST_ATTENTION_DECODE_ROPE=0`: the two kernels (for comparing,
    and a way around the fusion should it fail on a GPU). Read once per process."""
    global _DECODE_ROPE
    if _DECODE_ROPE is None:
        _DECODE_ROPE = os.environ.get("LLMFAST_ATTENTION_DECODE_ROPE", "1") != "0"
    return _DECODE_ROPE


def decode_region_enabled() -> bool:
    """Whether mixed launches serve their decodes in a decode region (the default);
    `LLMFAST_ATTENTION_DECODE_REGION=0`: in query tiles, as before it (for comparing the
    two, and a way around the region should it fail on a GPU). Read once per process."""
    global _DECODE_REGION
    if _DECODE_REGION is None:
        _DECODE_REGION = os.environ.get("LLMFAST_ATTENTION_DECODE_REGION", "1") != "0"
    return _DECODE_REGION


def _heuristic_splits(programs: int, num_sms: int, max_kv_tiles: float) -> int:
    """Double the splits while the grid stays within ~2 programs per SM and every split
    still gets >= 4 key tiles of the longest possible context (the partials and the
    merge are not free). Batch 1, 8 KV heads, a block table 8192 keys wide, 132 SMs:
    32 splits of 256 keys each."""
    splits = 1
    while (
        splits < MAX_SPLITS
        and 2 * splits * programs <= 2 * num_sms
        and 4 * 2 * splits <= max_kv_tiles
    ):
        splits *= 2
    return splits


def split_bound(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, num_sms: int, split_tables: tuple[SplitTable, ...] = (),
                kv_dtype: torch.dtype | None = None) -> int:
    """The most KV splits `select_config` gives any decode launch of this attention shape
    on this device, whatever its request count and block table, rounded up to a power of
    two: the bound the kernel compiles its split code against (triton/kernels.py: its
    merge spans the bound), so that every launch that splits shares one variant. From
    what is fixed for the process only (the shape, the device's SMs and split table): the
    start-up's memory profile, with a one-block table, must compile the variant later
    steps use."""
    table = find_table(split_tables, num_heads, num_kv_heads, head_dim,
                       kv_dtype_name(dtype, kv_dtype), block_size)
    if table is not None:
        return next_pow2(max(table.best.values()))
    return _heuristic_splits(num_kv_heads, num_sms, math.inf)


def decode_like(num_tokens: int, num_reqs: int, uniform_decode: bool = False) -> bool:
    """Whether a launch is configured as decode (memory bound, KV splits) rather than
    prefill (compute bound, tuned tiles): about one token per request, or at most one
    known (`uniform_decode`: a uniform decode step padded to a sparse graph size may
    hold more tokens than twice its requests)."""
    return uniform_decode or num_tokens <= 2 * num_reqs


def select_config(
    num_tokens: int,
    num_reqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_blocks_per_req: int,
    dtype: torch.dtype,
    num_sms: int,
    split_tables: tuple[SplitTable, ...] = (),
    prefill_tiles: PrefillTiles | None = None,
    kv_dtype: torch.dtype | None = None,
    uniform_decode: bool = False,
) -> AttentionConfig:
    """Tile sizes and split count from host-known shapes only (same for a padded batch).
    Decode or prefill: `decode_like`.

    The split count of a decode comes from `split_tables` (measured on this GPU model,
    attention/tuning/split_table.py) when one holds this shape, else from the SM count. A
    prefill-like batch takes `prefill_tiles` (tuned for this GPU model and shape class,
    kernels/prefill_tuning.py) when given, else the fixed heuristic."""
    group_p = next_pow2(num_heads // num_kv_heads)
    wide = dtype == torch.float32 or head_dim > 128  # smaller tiles, more warps: no spills
    if decode_like(num_tokens, num_reqs, uniform_decode):
        # Decode-like: ~1 token per request, memory bound. 16 rows is tl.dot's minimum;
        # padding the group up to it costs no extra K/V traffic.
        block_q = max(1, 16 // group_p)
        # 128 keys a step: a paged tile's loads are latency-bound at decode, so fewer,
        # larger steps win (H200, hd 64 and 128, B=1..64: 4-25 % faster than 64 keys,
        # profiles/h200-2026-11-26b; 74 KB of shared memory at hd 128, 3 stages).
        block_n = 32 if wide else 128
        num_warps = 8 if wide else 4
        # Split tables are measured per (q, cache) dtype: an fp8 cache reads half the
        # bytes, so a bf16 cache's table does not hold for it (kv_dtype_name).
        dtype_name = kv_dtype_name(dtype, kv_dtype)
        split_table = find_table(split_tables, num_heads, num_kv_heads, head_dim,
                                 dtype_name, block_size)
        if split_table is not None:
            # The table's stage count too: measured on this GPU model with its splits.
            splits = split_table.lookup(num_reqs, max_blocks_per_req * block_size)
            return AttentionConfig(block_q, block_n, splits, num_warps,
                                   num_stages=split_table.num_stages,
                                   one_kv_loop=DECODE_ONE_KV_LOOP)
        # Counted in 64-key tiles whatever block_n (the rule was set with 64).
        max_kv_tiles = -(-max_blocks_per_req * block_size // 64)  # (triton.cdiv: ~10 us)
        splits = _heuristic_splits(num_reqs * num_kv_heads, num_sms, max_kv_tiles)
        return AttentionConfig(block_q, block_n, splits, num_warps,
                               num_stages=DEFAULT_DECODE_STAGES,
                               one_kv_loop=DECODE_ONE_KV_LOOP)
    # Prefill-like: compute bound. One launch whatever the mix (chunks and decodes), no
    # splits: the grid has a program per query tile already. Decodes among the chunks
    # get the decode region, configured as a decode launch of every request would be
    # (the launch's two parts run apart take those tiles; the region's split count is
    # what lets it match them at long decode contexts).
    tiles = prefill_tiles or heuristic_tiles(head_dim, dtype)
    block_q = max(1, tiles.block_m // group_p)
    region = None
    if num_reqs > 1 and decode_region_enabled():
        decode = select_config(num_reqs, num_reqs, num_heads, num_kv_heads, head_dim,
                               block_size, max_blocks_per_req, dtype, num_sms, split_tables,
                               kv_dtype=kv_dtype)
        if decode.block_q < block_q:
            region = DecodeRegion(decode.block_q, decode.block_n, decode.num_splits,
                                  decode.one_kv_loop)
    return AttentionConfig(block_q, tiles.block_n, 1, num_warps=tiles.num_warps,
                           num_stages=tiles.num_stages, decode_region=region)
