"""Unified paged attention, the launch side: configuration (split table, tuned prefill
tiles), workspaces, and the cached launch of the Triton kernels in triton/kernels.py
(whose docstring describes the design).
"""

from __future__ import annotations

import functools

import torch
import triton

from llmfast.attention.triton.kernels import (
    _decode_rope_attention_kernel,
    _merge_splits_kernel,
    _unified_attention_kernel,
)
from llmfast.attention.triton.kv_write import check_launchable, reshape_and_cache
from llmfast.attention.triton.launch_config import (
    AttentionConfig,
    DecodeRegion,
    decode_like,
    decode_rope_enabled,
    select_config,
)
from llmfast.attention.triton.launch_plan import LaunchPlan, NewTokens, plan_launch
from llmfast.attention.triton.rope_cache import rope_and_cache
from llmfast.attention.tuning.prefill_measure import median_device_us, synthetic_batch
from llmfast.attention.tuning.prefill_tuning import (
    TUNE_MIN_TOKENS,
    PrefillTiles,
    PrefillTileTable,
    ShapeClass,
    shape_class,
    tuning_mode,
)
from llmfast.attention.tuning.split_table import SplitTable, split_tables_for
from llmfast.attention.workspaces import AttentionWorkspaces, new_partials
from llmfast.kernels.launch import precompile
from llmfast.kernels.launch.launch_cache import LaunchCache, PlanCache
from llmfast.utils.progress import Progress

__all__ = ["AttentionConfig", "DecodeRegion", "reshape_and_cache", "rope_and_cache",
           "select_config", "tune_model_prefill_tiles", "tune_prefill_tiles",
           "unified_attention"]

_LOG2E = 1.4426950408889634


# Compiled attention kernels per specialization, launched without Triton's JIT dispatch
# (kernels/launch/launch_cache.py).
_ATTENTION_LAUNCHES = LaunchCache(_unified_attention_kernel)
_DECODE_ROPE_LAUNCHES = LaunchCache(_decode_rope_attention_kernel)


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


def _split_scratch(plan: LaunchPlan, k_cache: torch.Tensor
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
    window: int | None = None,
) -> None:
    """Causal paged attention for every query row up to query_start_loc[-1] into `out`;
    with a `window`, a query at position p sees the keys (p - window, p] only, and the
    key tiles before every row's window are not read.

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
           None if rope is None else tuple((t.shape, t.stride(), t.dtype) for t in rope),
           window is None)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.add(key, _plan(q, k_cache, v_cache, block_table, out, num_reqs,
                                     num_splits, block_q, fused_merge, prefill_tiles, config,
                                     rope, uniform_decode, window is not None))
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
    # (A window of 0 with SLIDING off: the kernel never reads it.)
    scalars = (num_reqs, num_tokens, scale * _LOG2E, *plan.split_counts, window or 0)
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


_PLANS = PlanCache()


def _plan(q, k_cache, v_cache, block_table, out, num_reqs, num_splits, block_q, fused_merge,
          prefill_tiles, config=None, rope: NewTokens | None = None,
          uniform_decode: bool = False, sliding: bool = False) -> LaunchPlan:
    """The launch's plan (launch_plan.py), from this device's SM count and split tables
    (read here: tests replace `_num_sms` and `_device_split_tables`)."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    cfg = config or select_config(
        num_tokens, num_reqs, num_heads, num_kv_heads, head_dim, block_size,
        block_table.shape[1], q.dtype, _num_sms(q.device), _device_split_tables(q.device),
        prefill_tiles, kv_dtype=k_cache.dtype, uniform_decode=uniform_decode,
    )
    # The interpreter's tl.dot reads bf16 as raw uint16 bits: compute in fp32 there.
    upcast = not isinstance(_unified_attention_kernel, triton.runtime.JITFunction)
    return plan_launch(q, k_cache, v_cache, block_table, out, num_reqs, cfg, num_splits,
                       block_q, fused_merge, _num_sms(q.device), _device_split_tables(q.device),
                       upcast, rope, uniform_decode, sliding)
