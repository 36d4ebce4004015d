"""What one attention launch derives from its shapes, once per shape: the split counts,
the decode region, the bounds the kernel compiles its split code against, its
constexprs and grid (`LaunchPlan`). launch.py caches a plan per shape and launches it;
the kernels are in kernels.py, whose docstring describes the design.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llmfast.attention.triton.kv_write import cache_clamp, next_pow2
from llmfast.attention.triton.launch_config import (
    MAX_SPLITS,
    AttentionConfig,
    DecodeRegion,
    decode_like,
    split_bound,
)
from llmfast.attention.tuning.split_table import SplitTable
from llmfast.kernels.launch.launch_cache import specialization_key
from llmfast.kernels.layers.rotary_reference import rope_cache_takes

# What rope_and_cache takes besides q (rope_cache.py): the step's new keys and values,
# their cache slots, positions, and the cos/sin table.
NewTokens = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]

# Launch-plan fields of the decode region that the fused decode + RoPE kernel lacks.
_REGION_CONSTEXPRS = ("DECODE_REGION", "DEC_BLOCK_Q", "DEC_BLOCK_N", "DEC_SPLIT_BOUND",
                      "DEC_ONE_KV_LOOP")


@dataclass(frozen=True, eq=False, slots=True)  # hashed by identity: a launch key
class LaunchPlan:
    device: torch.device
    is_cuda: bool
    rope: bool  # the fused decode + RoPE kernel's launch, not the unified kernel's
    grid: tuple[int, int, int]
    # The kernel's runtime split counts: the query tiles' and the decode region's (the
    # fused decode + RoPE kernel: the first only).
    split_counts: tuple[int, ...]
    # The kernel is compiled with split code (a bound > 1): its partials and counters
    # must have their own types even where this launch does not split.
    split_code: bool
    # KV splits whose partials the launch writes: the query tiles', or with a decode
    # region its; 1: no scratch.
    scratch_splits: int
    merge_kernel: bool  # split partials merged by a second kernel (fused_merge=False)
    fused: bool  # the launch merges its own splits (arrival counters)
    # (splits, rows: num_tokens, or num_reqs * DEC_BLOCK_Q with a decode region,
    # num_heads, head_dim_p)
    partials_shape: tuple[int, int, int, int]
    num_arrivals: int  # fused-merge counters: one per (query tile, kv head)
    strides: tuple[int, ...]  # q, k_cache, v_cache, out, block_table rows
    const_key: tuple  # stands for `constexprs` and the strides in the launch cache's key
    constexprs: dict
    merge_constexprs: dict


def query_tiling(cfg: AttentionConfig, is_cuda: bool, group: int, num_splits: int | None,
                 block_q: int | None, fused_merge: bool) -> tuple[int, int]:
    """(KV splits, query tile rows) of the query tiles: the config's unless overridden."""
    splits = num_splits if num_splits is not None else cfg.num_splits
    if not fused_merge:  # the merge kernel spans its splits with one arange
        splits = next_pow2(splits)
    splits = max(1, min(splits, MAX_SPLITS))
    bq = block_q if block_q is not None else cfg.block_q
    if is_cuda:  # tl.dot needs >= 16 rows; only the interpreter takes smaller tiles
        bq = max(bq, 16 // next_pow2(group))
    return splits, bq


def decode_region(cfg: AttentionConfig, is_cuda: bool, group: int, splits: int, bq: int,
                  fused_merge: bool) -> DecodeRegion | None:
    """The config's decode region as this launch may take it: only beside unsplit query
    tiles (one partials layout per launch), and with split decodes only where the launch
    merges them itself."""
    region = cfg.decode_region
    if region is not None and is_cuda and region.block_q < 16 // next_pow2(group):
        region = dataclasses.replace(region, block_q=16 // next_pow2(group))  # tl.dot
    if region is not None and region.num_splits > MAX_SPLITS:
        region = dataclasses.replace(region, num_splits=MAX_SPLITS)
    if region is not None and (splits > 1 or region.block_q >= bq
                               or (region.num_splits > 1 and not fused_merge)):
        region = None
    return region


def split_code_bounds(splits: int, region: DecodeRegion | None, shape_bound: int,
                      fused_merge: bool, one_variant: bool) -> tuple[int, bool, int]:
    """(the query tiles' split bound, whether they compile the fused merge, the decode
    region's bound).

    The split counts are runtime arguments; the kernel compiles against a bound (module
    doc of kernels.py): 1 (no split code), or the most splits any decode launch of this
    shape takes on this device (`shape_bound`), so that the batch sizes of one model
    share one or two variants. The decode region always takes that bound: its mixed
    launches then share one variant whatever their request count (the start-up's memory
    profile compiles it). A second merge kernel reads every split, so without the fused
    merge the bound is the count itself. `one_variant`: a decode-like launch or the
    fused decode + RoPE kernel, which compile the split code whatever their count, so
    that all of them are one variant: the start-up captures compile it (those of uniform
    decode may take the fused kernel, and a decode-like step that is not uniform must
    find its variant compiled too)."""
    fused = splits > 1 and fused_merge
    bound = next_pow2(max(splits, region.num_splits if region else 1, shape_bound))
    main_bound, fused_code = (bound if fused else splits), fused
    if fused_merge and one_variant:
        main_bound, fused_code = bound, bound > 1
    return main_bound, fused_code, bound if region is not None else 1


def fuse_rope(plan_args: dict, rope: NewTokens, q: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, num_reqs: int, num_kv_heads: int, splits: int) -> None:
    """Turn the unified kernel's plan arguments into the fused decode + RoPE kernel's:
    one program per request; always compiled with the split code (one variant whatever
    the batch: the captures compile it). A request reads its token's key, value, slot
    and position (none for a row of no token: async scheduling gives one to a request
    whose last token is in flight), so each has a row per token: there may be fewer
    tokens than requests."""
    k, v, slot_mapping, positions, cos_sin = rope
    if not rope_cache_takes(q, k, v, cos_sin, k_cache, v_cache) or min(
            k.shape[0], v.shape[0], slot_mapping.shape[0], positions.shape[0]
    ) < q.shape[0]:
        raise ValueError("the fused decode + RoPE attention takes contiguous, even head "
                         "dims, q and k of one dtype, a float32 cos/sin table as wide as "
                         "a head, and a key, value, slot and position per token")
    plan_args["grid"], plan_args["split_counts"] = (num_reqs, num_kv_heads, splits), (splits,)
    constexprs = plan_args["constexprs"]
    for name in _REGION_CONSTEXPRS:
        del constexprs[name]
    constexprs.update(CLAMP=cache_clamp(k_cache.dtype))
    plan_args["strides"] += (k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                             cos_sin.stride(0))


def plan_launch(q, k_cache, v_cache, block_table, out, num_reqs: int, cfg: AttentionConfig,
                num_splits: int | None, block_q: int | None, fused_merge: bool,
                num_sms: int, split_tables: tuple[SplitTable, ...], upcast: bool,
                rope: NewTokens | None = None, uniform_decode: bool = False,
                sliding: bool = False) -> LaunchPlan:
    """The plan of one launch of the unified kernel (or, with `rope`, the fused decode +
    RoPE kernel) with configuration `cfg`; `sliding`: a windowed layer's (the window is
    a runtime argument, the mask and tile skip a variant of their own). `upcast`: the interpreter's tl.dot reads bf16
    as raw uint16 bits, so it computes in fp32 there."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache {v_cache.dtype}")
    splits, bq = query_tiling(cfg, q.is_cuda, group, num_splits, block_q, fused_merge)
    head_dim_p = max(16, next_pow2(head_dim))
    num_tiles = num_tokens // bq + num_reqs
    fused = splits > 1 and fused_merge
    region = decode_region(cfg, q.is_cuda, group, splits, bq, fused_merge)
    if region is not None:
        # Scratch rows per request, not per token (kernels.py).
        scratch_splits, scratch_rows = region.num_splits, num_reqs * region.block_q
        region_programs = num_reqs * region.num_splits
    else:
        scratch_splits, scratch_rows, region_programs = splits, num_tokens, 0
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # A cache in another dtype than q (fp8) is converted to q's on load: its own variant.
    convert_kv = k_cache.dtype != q.dtype
    shape_bound = split_bound(num_heads, num_kv_heads, head_dim, block_size, q.dtype,
                              num_sms, split_tables, kv_dtype=k_cache.dtype)
    decode = decode_like(num_tokens, num_reqs, uniform_decode)
    main_bound, fused_code, region_bound = split_code_bounds(
        splits, region, shape_bound, fused_merge, decode or rope is not None)
    args = dict(
        grid=(num_tiles + region_programs, num_kv_heads, splits),
        split_counts=(splits, region.num_splits if region else 1),
        strides=(*q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
                 block_table.stride(0)),
        constexprs=dict(
            NUM_HEADS=num_heads, GROUP=group, GROUP_P=next_pow2(group), HEAD_DIM=head_dim,
            HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size, BLOCK_Q=bq, BLOCK_N=cfg.block_n,
            SPLIT_BOUND=main_bound, FUSED_MERGE=fused_code, UPCAST=upcast,
            DOT_PRECISION=dot_precision,
            CONVERT_KV=convert_kv, MIN_SPLIT_TILES=cfg.min_split_tiles,
            DECODE_REGION=region is not None, DEC_BLOCK_Q=region.block_q if region else 1,
            DEC_BLOCK_N=region.block_n if region else 16, DEC_SPLIT_BOUND=region_bound,
            ONE_KV_LOOP=cfg.one_kv_loop,
            DEC_ONE_KV_LOOP=region.one_kv_loop if region else False,
            SLIDING=sliding, num_warps=cfg.num_warps, num_stages=cfg.num_stages),
    )
    if rope is not None:
        fuse_rope(args, rope, q, k_cache, v_cache, num_reqs, num_kv_heads, splits)
    constexprs, strides = args["constexprs"], args["strides"]
    return LaunchPlan(
        device=q.device,
        is_cuda=q.device.type == "cuda",
        rope=rope is not None,
        grid=args["grid"],
        split_counts=args["split_counts"],
        split_code=main_bound > 1 or (rope is None and region_bound > 1),
        scratch_splits=scratch_splits,
        merge_kernel=splits > 1 and not fused,
        fused=fused or (region is not None and region.num_splits > 1),
        partials_shape=(scratch_splits, scratch_rows, num_heads, head_dim_p),
        # Fused-merge counters, one per kv head and split query tile, or with a decode
        # region per request (then only its programs split): a count that depends on
        # the launch's request count alone, not on its tokens (the runner keeps one
        # buffer per count for its life, and eager mixed steps vary their tokens).
        num_arrivals=(num_reqs if region is not None else num_tiles) * num_kv_heads,
        strides=strides,
        const_key=(cfg, num_heads, group, head_dim, block_size, bq, splits, fused, region,
                   main_bound, fused_code, region_bound, upcast, dot_precision, convert_kv,
                   rope is not None, constexprs.get("CLAMP"), sliding,
                   specialization_key((), strides)),
        constexprs=constexprs,
        merge_constexprs=dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
                              NUM_SPLITS=splits,
                              num_warps=4 if splits * head_dim_p > 2048 else 2),
    )
