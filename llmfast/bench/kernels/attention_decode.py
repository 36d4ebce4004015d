"""Decode rows of scripts/bench_kernels.py (CUDA): one step of `batch` requests over a
paged cache with shuffled blocks, the Triton kernel against torch SDPA (eager, interleaved
call by call, and both replayed from CUDA graphs), the host time of one launch by three
launch paths, the full graph's fixed launch (splits from a block table --max-model-len
wide), and with --sweep-splits every split count of SWEEP_SPLITS graph-replayed.
`args` is bench_kernels' namespace."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from llmfast.attention.triton import launch as attention
from llmfast.attention.tuning.split_table import SWEEP_SPLITS
from llmfast.attention.workspaces import AttentionWorkspaces
from llmfast.bench.kernels.attention_inputs import flash_backend, paged_copy
from llmfast.bench.kernels.cuda_timing import graph_replay, host_launch_us, time_us, time_us_interleaved


def _sdpa_decode(q_s, k_s, v_s, causal: bool, scale: float):
    """(fn, variant, backend): SDPA with enable_gqa, to run and time inside `backend()`:
    FlashAttention (its fastest decode path, reading each K/V head once) where it takes
    these inputs, else SDPA's own choice; the variant is recorded. Not flash with K/V
    expanded to every query head: memory-bound decode would read group x more and
    flatter our ratio."""

    def sdpa():
        return F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=causal, scale=scale,
                                              enable_gqa=True)

    try:
        with flash_backend():
            sdpa()
        return sdpa, "flash, enable_gqa", flash_backend
    except RuntimeError:
        return sdpa, "default backend", contextlib.nullcontext


def run_case(batch: int, ctx: int, num_new: int, args, flush, gen) -> dict:
    """`batch` requests, each with `num_new` query tokens at the end of `ctx` positions."""
    dtype = getattr(torch, args.dtype)
    heads, kv_heads, hd = args.num_heads, args.num_kv_heads, args.head_dim
    q = torch.randn(batch, num_new, heads, hd, dtype=dtype, device="cuda", generator=gen)
    k = torch.randn(batch, ctx, kv_heads, hd, dtype=dtype, device="cuda", generator=gen)
    v = torch.randn(batch, ctx, kv_heads, hd, dtype=dtype, device="cuda", generator=gen)
    fp8 = args.kv_cache_dtype == "fp8"
    if fp8:  # the values an fp8 cache holds, in --dtype (SDPA reads these)
        k, v = (t.to(torch.float8_e4m3fn).to(dtype) for t in (k, v))  # |randn| << 448
    k_cache, v_cache, block_table = paged_copy(k, v, args.block_size, gen)
    if fp8:  # exact: every value is an fp8 value
        k_cache, v_cache = (c.to(torch.float8_e4m3fn) for c in (k_cache, v_cache))

    q_flat = q.view(batch * num_new, heads, hd)
    out = torch.empty_like(q_flat)
    qsl = torch.arange(0, batch * num_new + 1, num_new, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    scale = hd**-0.5
    # Split partials reused across calls, as the engine's runner keeps them for its cache.
    workspaces = AttentionWorkspaces([k_cache])  # noqa: F841 - held while `ours` runs

    def ours():
        attention.unified_attention(
            q_flat, k_cache, v_cache, block_table, qsl, seq_lens, scale, out
        )

    # SDPA on contiguous [B, heads, L, hd]; causal only matters when there are many queries
    # (with num_new == ctx, SDPA's top-left causal mask equals ours).
    q_s, k_s, v_s = (t.transpose(1, 2).contiguous() for t in (q, k, v))

    sdpa, sdpa_variant, sdpa_backend = _sdpa_decode(q_s, k_s, v_s, num_new > 1, scale)
    with sdpa_backend():  # (around both: its host cost in neither's figure)
        ours_us, sdpa_us = time_us_interleaved([ours, sdpa], args.eager_iters, flush,
                                               idle=True)
        want = sdpa().float()

    def max_diff(fn) -> float:
        out.fill_(float("nan"))
        fn()
        return (out.view(batch, num_new, heads, hd).transpose(1, 2).float() - want).abs().max().item()

    num_sms = torch.cuda.get_device_properties(0).multi_processor_count

    def splits_for(width: int) -> int:
        # What unified_attention picks: the measured table for this GPU if any, else
        # the heuristic.
        return attention.select_config(
            batch * num_new, batch, heads, kv_heads, hd, args.block_size, width, dtype,
            num_sms, attention._device_split_tables(torch.device("cuda", 0)),
            kv_dtype=k_cache.dtype).num_splits

    result = dict(batch=batch, ctx=ctx, num_new=num_new, splits=splits_for(block_table.shape[1]),
                  ours_us=ours_us, sdpa_us=sdpa_us, sdpa_variant=sdpa_variant,
                  max_abs_diff=max_diff(ours))
    if num_new == 1:
        result["graph_us"] = time_us(graph_replay(ours), args.iters, flush)
        # Like for like with graph_us: SDPA replayed from a CUDA graph too (its eager
        # sdpa_us includes a host launch that a full-graph step does not pay).
        try:
            with sdpa_backend():
                result["sdpa_graph_us"] = time_us(graph_replay(sdpa), args.iters, flush)
        except RuntimeError as e:  # a backend that cannot be captured: said, not fatal
            result["sdpa_graph_error"] = f"{type(e).__name__}: {e}"[:200]

        def two_kernel():  # splits merged by a second kernel, as before issue 17
            attention.unified_attention(q_flat, k_cache, v_cache, block_table, qsl, seq_lens,
                                        scale, out, fused_merge=False)

        result["two_kernel_us"] = time_us(two_kernel, args.iters, flush, idle=True)
        result["launch_host_us"] = host_launch_us(ours)
        # The cached path handing the launcher the tensors (it then reads each address
        # and has the driver check it) instead of their addresses.
        attention._ATTENTION_LAUNCHES.raw_pointers = False
        result["launch_host_tensors_us"] = host_launch_us(ours)
        attention._ATTENTION_LAUNCHES.raw_pointers = True
        attention._ATTENTION_LAUNCHES.enabled = False  # Triton's JIT dispatch, for comparison
        result["launch_host_jit_us"] = host_launch_us(ours)
        attention._ATTENTION_LAUNCHES.enabled = True
        # The full graph's launch: splits from a table max_model_len wide (zeros past
        # the live blocks: never read).
        width = -(-args.max_model_len // args.block_size)
        wide = torch.zeros(batch, max(width, block_table.shape[1]), dtype=torch.int32,
                           device="cuda")
        wide[:, : block_table.shape[1]] = block_table

        def fixed():
            attention.unified_attention(q_flat, k_cache, v_cache, wide, qsl, seq_lens, scale, out)

        result.update(
            fixed_splits=splits_for(wide.shape[1]),
            fixed_us=time_us(fixed, args.iters, flush, idle=True),
            fixed_graph_us=time_us(graph_replay(fixed), args.iters, flush),
        )
        result["fixed_max_abs_diff"] = max_diff(fixed)
        if args.sweep_splits:
            # Issue 17's split table: each count of SWEEP_SPLITS, graph-replayed.
            sweep = {}
            for splits in SWEEP_SPLITS:
                def forced(splits=splits):
                    attention.unified_attention(q_flat, k_cache, v_cache, block_table, qsl,
                                                seq_lens, scale, out, num_splits=splits)
                sweep[splits] = time_us(graph_replay(forced), args.iters, flush)
            result["split_sweep_graph_us"] = sweep
    return result
