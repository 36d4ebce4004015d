"""The decode attention launch configurations swept for one shape (CUDA): keys per tile
(BLOCK_N), pipeline stages, warps, KV splits, the fused merge's minimum tiles per split,
and one masked loop over the key tiles vs an unmasked bulk loop and a masked tail
(`one_kv_loop`: keys L1 / L2), at the fixed launch a full CUDA graph uses (a block table
--max-model-len wide; the kernel sizes the splits for the live context). Graph-replayed,
L2 flushed, median device µs, beside the configuration `select_config` picks now.
`scripts/bench_kernels.py decode-configs` runs it and prints the rows."""

from __future__ import annotations

import itertools
from dataclasses import asdict, replace

import torch

from llmfast.attention.triton import launch as attention
from llmfast.bench.kernels.attention_inputs import decode_case
from llmfast.bench.kernels.cuda_timing import graph_replay, time_us


def config_key(cfg: attention.AttentionConfig) -> str:
    """BLOCK_N/stages/min split tiles/L<loops>/w<warps>/s<splits>, e.g. 128/3/2/L1/w4/s4."""
    loops = 1 if cfg.one_kv_loop else 2
    return (f"{cfg.block_n}/{cfg.num_stages}/{cfg.min_split_tiles}/L{loops}/w{cfg.num_warps}"
            f"/s{cfg.num_splits}")


def sweep_shape(batch: int, ctx: int, args, flush: torch.Tensor, gen: torch.Generator
                ) -> tuple[dict, dict[str, str]]:
    """(the row of one (batch, context): every configuration's µs and max difference
    from the chosen one's output, the chosen and the best; the configurations that did
    not compile or fit, with their error). `args`: bench_kernels decode-configs' flags."""
    dtype, dev = torch.bfloat16, torch.device("cuda", 0)
    heads, kv_heads, hd, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    width = -(-args.max_model_len // bs)
    case = decode_case(batch, ctx, heads, kv_heads, hd, bs, gen, dtype)
    q, k_cache, v_cache, table = case.q, case.k_cache, case.v_cache, case.block_table
    qsl, seq_lens, out = case.query_start_loc, case.seq_lens, case.out
    wide = torch.zeros(batch, max(width, table.shape[1]), dtype=torch.int32, device=dev)
    wide[:, : table.shape[1]] = table
    chosen = attention.select_config(
        batch, batch, heads, kv_heads, hd, bs, wide.shape[1], dtype,
        attention._num_sms(dev), attention._device_split_tables(dev))
    ref = torch.empty_like(out)
    attention.unified_attention(q, k_cache, v_cache, wide, qsl, seq_lens, hd**-0.5, ref)
    timings, failed = {}, {}
    for block_n, stages, min_tiles, loops, warps, splits in itertools.product(
            args.block_n, args.stages, args.min_split_tiles, args.loops, args.warps,
            args.splits or [chosen.num_splits]):
        cfg = replace(chosen, block_n=block_n, num_stages=stages, min_split_tiles=min_tiles,
                      one_kv_loop=loops == 1, num_warps=warps, num_splits=splits)
        name = config_key(cfg)

        def run(cfg=cfg):
            attention.unified_attention(q, k_cache, v_cache, wide, qsl, seq_lens,
                                        hd**-0.5, out, config=cfg)

        try:
            run()
            err = (out.float() - ref.float()).abs().max().item()
            us = time_us(graph_replay(run), args.iters, flush)
        except Exception as e:  # noqa: BLE001 - a config that does not compile/fit
            failed[name] = f"{type(e).__name__}: {e}"
            continue
        timings[name] = dict(us=us, max_diff=err)
    key_now = config_key(chosen)
    best = min(timings, key=lambda c: timings[c]["us"])
    # The loop choice alone: each loop count's best over the other settings.
    by_loops = {n: min((t["us"] for c, t in timings.items() if f"/L{n}/" in c),
                       default=None) for n in (1, 2)}
    row = dict(batch=batch, ctx=ctx, splits=chosen.num_splits, chosen=asdict(chosen),
               now=key_now, now_us=timings.get(key_now, {}).get("us"), best=best,
               best_us=timings[best]["us"], best_one_loop_us=by_loops[1],
               best_two_loops_us=by_loops[2], timings=timings)
    return row, failed
