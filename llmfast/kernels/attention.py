"""Unified paged attention, the launch side: configuration (split table, tuned prefill
tiles), workspaces, and the cached launch of the Triton kernels in attention_kernels.py
(whose docstring describes the design).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton

from llmfast.kernels.attention_config import (
    MAX_SPLITS,
    AttentionConfig,
    DecodeRegion,
    decode_like,
    decode_rope_enabled,
    select_config,
    split_bound,
)
from llmfast.kernels.attention_kernels import (
    _decode_rope_attention_kernel,
    _merge_splits_kernel,
    _unified_attention_kernel,
)
from llmfast.kernels.kv_write import cache_clamp, check_launchable, next_pow2, reshape_and_cache
from llmfast.kernels.layers.rotary_reference import rope_cache_takes
from llmfast.kernels.launch import precompile
from llmfast.kernels.launch.launch_cache import LaunchCache, PlanCache, specialization_key
from llmfast.kernels.rope_cache import rope_and_cache
from llmfast.kernels.tuning.prefill_measure import median_device_us, synthetic_batch
from llmfast.kernels.tuning.prefill_tuning import (
    TUNE_MIN_TOKENS,
    PrefillTiles,
    PrefillTileTable,
    ShapeClass,
    shape_class,
    tuning_mode,
)
from llmfast.kernels.tuning.split_table import SplitTable, split_tables_for
from llmfast.kernels.workspaces import AttentionWorkspaces, new_partials
from llmfast.utils.progress import Progress

__all__ = ["AttentionConfig", "DecodeRegion", "reshape_and_cache", "rope_and_cache",
           "select_config", "tune_model_prefill_tiles", "tune_prefill_tiles",
           "unified_attention"]

_LOG2E = 1.4426950408889634


# Compiled attention kernels per specialization, launched without Triton's JIT dispatch
# (kernels/launch_cache.py).
_ATTENTION_LAUNCHES = LaunchCache(_unified_attention_kernel)
_DECODE_ROPE_LAUNCHES = LaunchCache(_decode_rope_attention_kernel)

# What rope_and_cache takes besides q (kernels/rope_cache.py): the step's new keys and
# values, their cache slots, positions, and the cos/sin table.
NewTokens = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: only forced splits are worth their cost there


@functools.lru_cache(maxsize=8)
def _device_split_tables(device: torch.device) -> tuple[SplitTable, ...]:
    if device.type != "cuda":
        return ()
    return split_tables_for(torch.cuda.get_device_name(device))


@functools.lru_cache(maxsize=8)
def _device_tile_table(device: torch.device) -> PrefillTileTable:
    return PrefillTileTable(torch.cuda.get_device_name(device))


def _tile_timer(device: torch.device, cls: ShapeClass):
    """measure(tiles): device µs of one launch with `tiles` on a synthetic batch of class
    `cls`, made at the first measurement and shared by the candidates."""
    batch: dict = {}

    def measure(tiles: PrefillTiles) -> float:
        if not batch:
            batch.update(synthetic_batch(cls, device))
        return median_device_us(lambda: unified_attention(**batch, prefill_tiles=tiles))

    return measure


def prefill_tunable(head_dim: int, dtype: torch.dtype) -> bool:
    """Shape classes tuning may run for (fp32 and head_dim > 128 keep the heuristic)."""
    return dtype != torch.float32 and head_dim <= 128


def _prefill_tiles(q: torch.Tensor, kv_dtype: torch.dtype, num_reqs: int, group: int
                   ) -> PrefillTiles | None:
    """Tuned tiles for a prefill-like launch on CUDA (kernels/prefill_tuning.py), or
    None (the heuristic). Tuning may run here, once per shape class, before a large
    prefill and never while a CUDA graph is being captured."""
    cls = shape_class(num_reqs, q.shape[2], group, q.dtype, kv_dtype)
    may_tune = (q.shape[0] >= TUNE_MIN_TOKENS and prefill_tunable(q.shape[2], q.dtype)
                and not torch.cuda.is_current_stream_capturing()
                and precompile.ACTIVE is None)  # (a dry launch times nothing)
    return _device_tile_table(q.device).tiles_for(
        cls, may_tune, _tile_timer(q.device, cls))


def model_prefill_classes(head_dim: int, group: int, dtype: torch.dtype,
                          kv_dtype: torch.dtype | None = None
                          ) -> tuple[ShapeClass, ShapeClass]:
    """The two prefill shape classes a model launches: one request (causal) and several
    (mixed)."""
    return tuple(shape_class(n, head_dim, group, dtype, kv_dtype) for n in (1, 2))


def tune_model_prefill_tiles(device: torch.device, head_dim: int, group: int,
                             dtype: torch.dtype, progress: Progress | None = None,
                             kv_dtype: torch.dtype | None = None) -> int:
    """At start-up: tune the two prefill shape classes a model launches (one request:
    causal; several: mixed) when no table knows them and tuning is allowed, so that no
    request waits ~20-30 s for it and the start-up memory profile's forward (a large
    mixed batch) does not tune inside itself. Returns how many classes were tuned."""
    if device.type != "cuda" or tuning_mode() == "off" or not prefill_tunable(head_dim, dtype):
        return 0
    if device.index is None:  # the table launches look up is keyed by q.device: cuda:N
        device = torch.device("cuda", torch.cuda.current_device())
    table = _device_tile_table(device)
    before = table.tunings
    for cls in model_prefill_classes(head_dim, group, dtype, kv_dtype):
        if progress and table.lookup(cls) is None:
            progress(f"tuning prefill attention tiles for {cls.key} (once per GPU model)",
                     None)
        table.tiles_for(cls, True, _tile_timer(device, cls))
    return table.tunings - before


def tune_prefill_tiles(device: torch.device, cls: ShapeClass, force: bool = False
                       ) -> PrefillTiles | None:
    """Tune `cls` on this GPU now (unless its tiles are known and not `force`d) and keep
    the result in the on-disk table; None when no candidate ran (the heuristic stays)."""
    table = _device_tile_table(device)
    if not force and (found := table.lookup(cls)) is not None:
        return found
    return table.tune(cls, _tile_timer(device, cls))


def _split_scratch(plan: _LaunchPlan, k_cache: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Split partials and (fused merge) arrival counters, or None for the counters.

    Eager launches reuse the partials and counters of the runner that owns the cache
    (its workspaces), by shape. While a CUDA graph is being captured the partials are
    fresh, so they come from (and stay in) the graph's private pool rather than aliasing
    memory eager calls keep using. The counters are the owner's there too when it has
    enough (the runner reserves its largest launch's with the KV cache): zero between
    launches (the last arrival resets its counter), kept for the owner's life (a graph
    may hold them), and used by one launch at a time (one stream), so a graph needs no
    zeroing of its own. Otherwise fresh counters, zeroed by a memset the graph records:
    one small kernel per attention call of every replay."""
    device, shape, n = plan.device, plan.partials_shape, plan.num_arrivals if plan.fused else 0
    owner = AttentionWorkspaces.of(k_cache)  # the runner's, freed with it
    if not (plan.is_cuda and torch.cuda.is_current_stream_capturing()):
        if owner is not None:
            (part_acc, part_max, part_sum), arrivals = owner.split_scratch(device, shape, n)
            return part_acc, part_max, part_sum, arrivals
    part_acc, part_max, part_sum = new_partials(device, *shape)
    arrivals = None
    if n:
        arrivals = owner.existing_arrivals(n) if owner is not None else None
        if arrivals is None:
            arrivals = torch.zeros(n, dtype=torch.int32, device=device)
    return part_acc, part_max, part_sum, arrivals


def unified_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    *,
    num_splits: int | None = None,
    block_q: int | None = None,
    fused_merge: bool = True,
    prefill_tiles: PrefillTiles | None = None,
    config: AttentionConfig | None = None,
    new_tokens: NewTokens | None = None,
    uniform_decode: bool = False,
) -> None:
    """Causal paged attention for every query row up to query_start_loc[-1] into `out`.

    `new_tokens` = (k, v, slot_mapping, positions, cos_sin): q and k are not rotated
    yet, and the new keys and values not cached: `rope_and_cache` first, into `out`,
    then attention over q = out; or, when the caller knows the step is `uniform_decode`
    (no request row has more than one token: the runner's max query length), both in
    one kernel (`_decode_rope_attention_kernel`, unless LLMFAST_ATTENTION_DECODE_ROPE=0).
    Shapes cannot tell: a step of rows scheduled [0, 1, 2] (a request whose last token
    is still in flight gets none) has as many tokens as requests.

    `num_splits` / `block_q` override the heuristic (tests, sweeps); any split count
    works with the fused merge (the second merge kernel of `fused_merge=False` rounds it
    up to a power of two). Rows past query_start_loc[num_reqs] are left unwritten. With KV
    splits, `fused_merge` merges them in the same launch (the last split of each tile);
    False: a second kernel does (the previous design, kept for comparison).
    `prefill_tiles` overrides the tuned (or heuristic) tiles of a prefill-like batch;
    `config` the whole launch configuration (benchmarks' sweeps; `num_splits` and
    `block_q` still apply over it).
    """
    q_shape = q.shape
    num_tokens = q_shape[0]
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return
    rope = None
    if new_tokens is not None:
        if uniform_decode and fused_merge and decode_rope_enabled():
            rope = new_tokens
        else:
            k, v, slot_mapping, positions, cos_sin = new_tokens
            rope_and_cache(q, k, v, positions, cos_sin, out, k_cache, v_cache, slot_mapping)
            q = out
    decode = decode_like(num_tokens, num_reqs, uniform_decode)
    if prefill_tiles is None and not decode and q.is_cuda:
        prefill_tiles = _prefill_tiles(q, k_cache.dtype, num_reqs,
                                       q_shape[1] // k_cache.shape[2])
    # Everything the launch derives from shapes, computed once per shape (a step's
    # layers, and every step of a padded size, share it): with every tensor's dtype in
    # the key the plan also fixes the kernel's specialization but for the tensors'
    # addresses (LaunchCache.launch_planned). `_num_sms` itself stands for its value (a
    # function of the device, which is in the key; tests replace it).
    key = (q_shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(),
           k_cache.dtype, v_cache.stride(), v_cache.dtype, out.stride(), out.dtype,
           block_table.shape, block_table.stride(), block_table.dtype,
           query_start_loc.dtype, seq_lens.dtype, num_splits, block_q, fused_merge,
           prefill_tiles, config, _num_sms, decode,
           None if rope is None else tuple((t.shape, t.stride(), t.dtype) for t in rope))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.add(key, _plan(q, k_cache, v_cache, block_table, out, num_reqs,
                                     num_splits, block_q, fused_merge, prefill_tiles, config,
                                     rope, uniform_decode))
    # (The module's launch caches read at each call: tests replace them.)
    launches = _DECODE_ROPE_LAUNCHES if plan.rope else _ATTENTION_LAUNCHES
    if not plan.is_cuda:
        check_launchable(launches.kernel, q)
    if plan.scratch_splits > 1:
        part_acc, part_max, part_sum, arrivals = _split_scratch(plan, k_cache)
        if arrivals is None:
            arrivals = out
    elif plan.split_code:
        # Compiled with split code that this launch's counts never run: pointers of
        # the types that code has (fp32 partials, int32 counters), so that it compiles
        # (an atomic needs an integer counter) and is the same variant as the launches
        # that do split.
        part_acc, arrivals = _unused_split_scratch(q.device)
        part_max = part_sum = part_acc
    else:
        part_acc = part_max = part_sum = arrivals = out  # unused; any pointer of the device
    tensors = (q, k_cache, v_cache, out, part_acc, part_max, part_sum, arrivals,
               block_table, query_start_loc, seq_lens, *(rope or ()))
    scalars = (num_reqs, num_tokens, scale * _LOG2E, *plan.split_counts)
    if type(scalars[2]) is float:  # the plan's specialization holds (a float scale)
        launches.launch_planned(plan, plan.grid, tensors, scalars, plan.const_key,
                                plan.constexprs, plan.strides)
    else:
        launches.launch(plan.grid, tensors, scalars, plan.const_key, plan.constexprs,
                        plan.strides)
    if plan.merge_kernel:
        merge_args = (out, part_acc, part_max, part_sum, query_start_loc, num_reqs,
                      num_tokens, *out.stride())
        if precompile.ACTIVE is not None:  # a dry launch (launch/precompile.py)
            precompile.ACTIVE.submit(_merge_splits_kernel, (num_tokens, q_shape[1]),
                                     merge_args, plan.merge_constexprs)
        else:
            _merge_splits_kernel[(num_tokens, q_shape[1])](*merge_args,
                                                           **plan.merge_constexprs)


@functools.lru_cache(maxsize=8)
def _unused_split_scratch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-ins for the partials (fp32) and counters (int32) of a launch compiled with
    split code its split counts do not run: never read or written."""
    return (torch.empty(4, dtype=torch.float32, device=device),
            torch.empty(4, dtype=torch.int32, device=device))


@dataclass(frozen=True, eq=False, slots=True)  # hashed by identity: a launch key
class _LaunchPlan:
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


_PLANS = PlanCache()


def _plan(q, k_cache, v_cache, block_table, out, num_reqs, num_splits, block_q, fused_merge,
          prefill_tiles, config=None, rope: NewTokens | None = None,
          uniform_decode: bool = False) -> _LaunchPlan:
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    decode = decode_like(num_tokens, num_reqs, uniform_decode)
    cfg = config or select_config(
        num_tokens, num_reqs, num_heads, num_kv_heads, head_dim, block_size,
        block_table.shape[1], q.dtype, _num_sms(q.device), _device_split_tables(q.device),
        prefill_tiles, kv_dtype=k_cache.dtype, uniform_decode=uniform_decode,
    )
    splits = num_splits if num_splits is not None else cfg.num_splits
    if not fused_merge:  # the merge kernel spans its splits with one arange
        splits = next_pow2(splits)
    splits = max(1, min(splits, MAX_SPLITS))
    bq = block_q if block_q is not None else cfg.block_q
    if q.is_cuda:  # tl.dot needs >= 16 rows; only the interpreter takes smaller tiles
        bq = max(bq, 16 // next_pow2(group))
    head_dim_p = max(16, next_pow2(head_dim))
    num_tiles = num_tokens // bq + num_reqs
    fused = splits > 1 and fused_merge
    # The decode region: only beside unsplit query tiles (one partials layout per
    # launch), and with split decodes only where the launch merges them itself.
    region = cfg.decode_region
    if region is not None and q.is_cuda and region.block_q < 16 // next_pow2(group):
        region = dataclasses.replace(region, block_q=16 // next_pow2(group))  # tl.dot
    if region is not None and region.num_splits > MAX_SPLITS:
        region = dataclasses.replace(region, num_splits=MAX_SPLITS)
    if region is not None and (splits > 1 or region.block_q >= bq
                               or (region.num_splits > 1 and not fused_merge)):
        region = None
    if region is not None:
        # Scratch rows per request, not per token (attention_kernels.py).
        scratch_splits, scratch_rows = region.num_splits, num_reqs * region.block_q
        region_programs = num_reqs * region.num_splits
    else:
        scratch_splits, scratch_rows, region_programs = splits, num_tokens, 0
    # The interpreter's tl.dot reads bf16 as raw uint16 bits: compute in fp32 there.
    upcast = not isinstance(_unified_attention_kernel, triton.runtime.JITFunction)
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"
    if v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache is {k_cache.dtype} but v_cache {v_cache.dtype}")
    # A cache in another dtype than q (fp8) is converted to q's on load: its own variant.
    convert_kv = k_cache.dtype != q.dtype
    strides = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
               block_table.stride(0))
    # The split counts are runtime arguments; the kernel compiles against a bound (module
    # doc of attention_kernels.py): 1 (no split code), or the most splits any decode
    # launch of this shape takes on this device, so that the batch sizes of one model
    # share one or two variants. The decode region always takes that bound: its mixed
    # launches then share one variant whatever their request count (the start-up's
    # memory profile compiles it). A second merge kernel reads every split, so without
    # the fused merge the bound is the count itself.
    bound = next_pow2(max(splits, region.num_splits if region else 1,
                          split_bound(num_heads, num_kv_heads, head_dim, block_size, q.dtype,
                                      _num_sms(q.device), _device_split_tables(q.device),
                                      kv_dtype=k_cache.dtype)))
    main_bound, fused_code = (bound if fused else splits), fused
    if fused_merge and (decode or rope is not None):
        # Decode-like launches (and the fused decode + RoPE kernel) compile the split
        # code whatever their count, so that all of them are one variant: the start-up
        # captures compile it (those of uniform decode may take the fused kernel, and a
        # decode-like step that is not uniform must find its variant compiled too).
        main_bound, fused_code = bound, bound > 1
    region_bound = bound if region is not None else 1
    constexprs = dict(
        NUM_HEADS=num_heads, GROUP=group, GROUP_P=next_pow2(group), HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size, BLOCK_Q=bq, BLOCK_N=cfg.block_n,
        SPLIT_BOUND=main_bound, FUSED_MERGE=fused_code, UPCAST=upcast,
        DOT_PRECISION=dot_precision,
        CONVERT_KV=convert_kv, MIN_SPLIT_TILES=cfg.min_split_tiles,
        DECODE_REGION=region is not None, DEC_BLOCK_Q=region.block_q if region else 1,
        DEC_BLOCK_N=region.block_n if region else 16, DEC_SPLIT_BOUND=region_bound,
        ONE_KV_LOOP=cfg.one_kv_loop, DEC_ONE_KV_LOOP=region.one_kv_loop if region else False,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    grid = (num_tiles + region_programs, num_kv_heads, splits)
    split_counts: tuple[int, ...] = (splits, region.num_splits if region else 1)
    if rope is not None:
        # The fused decode + RoPE kernel: one program per request; always compiled with
        # the split code (one variant whatever the batch: the captures compile it). A
        # request reads its token's key, value, slot and position (none for a row of no
        # token: async scheduling gives one to a request whose last token is in flight),
        # so each has a row per token: there may be fewer tokens than requests.
        k, v, slot_mapping, positions, cos_sin = rope
        if not rope_cache_takes(q, k, v, cos_sin, k_cache, v_cache) or min(
                k.shape[0], v.shape[0], slot_mapping.shape[0], positions.shape[0]
        ) < num_tokens:
            raise ValueError("the fused decode + RoPE attention takes contiguous, even head "
                             "dims, q and k of one dtype, a float32 cos/sin table as wide as "
                             "a head, and a key, value, slot and position per token")
        grid, split_counts = (num_reqs, num_kv_heads, splits), (splits,)
        for name in ("DECODE_REGION", "DEC_BLOCK_Q", "DEC_BLOCK_N", "DEC_SPLIT_BOUND",
                     "DEC_ONE_KV_LOOP"):
            del constexprs[name]
        constexprs.update(CLAMP=cache_clamp(k_cache.dtype))
        strides += (k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin.stride(0))
    return _LaunchPlan(
        device=q.device,
        is_cuda=q.device.type == "cuda",
        rope=rope is not None,
        grid=grid,
        split_counts=split_counts,
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
                   rope is not None, constexprs.get("CLAMP"),
                   specialization_key((), strides)),
        constexprs=constexprs,
        merge_constexprs=dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
                              NUM_SPLITS=splits,
                              num_warps=4 if splits * head_dim_p > 2048 else 2),
    )
