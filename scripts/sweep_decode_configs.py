"""Sweep the decode attention launch configuration on a GPU: keys per tile (BLOCK_N),
pipeline stages, warps, KV splits, the fused merge's minimum tiles per split, and one
masked loop over the key tiles vs an unmasked bulk loop and a masked tail
(`one_kv_loop`: keys L1 / L2), at the fixed launch a full CUDA graph uses (a block table
--max-model-len wide; the kernel sizes the splits for the live context). Graph-replayed,
L2 flushed, median device µs; beside each shape the configuration `select_config` picks
now and the best one measured (needs a CUDA GPU).

    python scripts/sweep_decode_configs.py --head-dim 64 --json decode_configs.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmfast.attention.triton import launch as attention
from llmfast.bench.attention_inputs import decode_case
from llmfast.bench.cuda_timing import L2_FLUSH_BYTES, graph_replay, time_us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[140, 512, 2048, 8192])
    p.add_argument("--block-n", type=int, nargs="+", default=[64, 128])
    p.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    p.add_argument("--min-split-tiles", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--warps", type=int, nargs="+", default=[4])
    p.add_argument("--splits", type=int, nargs="+", default=None,
                   help="KV split counts to try (default: the one select_config picks)")
    p.add_argument("--loops", type=int, nargs="+", default=[2, 1], choices=[1, 2],
                   help="key-tile loops: 2 (unmasked bulk + masked tail) and/or 1")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sweep_decode_configs.py needs a CUDA GPU (none found); nothing was measured.")
    dtype, dev = torch.bfloat16, torch.device("cuda", 0)
    heads, kv_heads, hd, bs = args.num_heads, args.num_kv_heads, args.head_dim, args.block_size
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev)
    gen = torch.Generator("cuda").manual_seed(0)
    width = -(-args.max_model_len // bs)
    rows = []
    print(f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}; head_dim {hd}, "
          f"{heads}/{kv_heads} heads, block table {width * bs} keys wide", flush=True)
    for batch, ctx in itertools.product(args.batches, args.contexts):
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
        timings = {}
        for block_n, stages, min_tiles, loops, warps, splits in itertools.product(
                args.block_n, args.stages, args.min_split_tiles, args.loops, args.warps,
                args.splits or [chosen.num_splits]):
            cfg = replace(chosen, block_n=block_n, num_stages=stages, min_split_tiles=min_tiles,
                          one_kv_loop=loops == 1, num_warps=warps, num_splits=splits)
            name = _key(cfg)

            def run(cfg=cfg):
                attention.unified_attention(q, k_cache, v_cache, wide, qsl, seq_lens,
                                            hd**-0.5, out, config=cfg)

            try:
                run()
                err = (out.float() - ref.float()).abs().max().item()
                us = time_us(graph_replay(run), args.iters, flush)
            except Exception as e:  # noqa: BLE001 - a config that does not compile/fit
                print(f"  {name}: {type(e).__name__}: {e}"[:200])
                continue
            timings[name] = dict(us=us, max_diff=err)
        key_now = _key(chosen)
        best = min(timings, key=lambda c: timings[c]["us"])
        # The loop choice alone: each loop count's best over the other settings.
        by_loops = {n: min((t["us"] for c, t in timings.items() if f"/L{n}/" in c),
                           default=None) for n in (1, 2)}
        row = dict(batch=batch, ctx=ctx, splits=chosen.num_splits, chosen=asdict(chosen),
                   now=key_now, now_us=timings.get(key_now, {}).get("us"), best=best,
                   best_us=timings[best]["us"], best_one_loop_us=by_loops[1],
                   best_two_loops_us=by_loops[2], timings=timings)
        rows.append(row)
        now_us = row["now_us"]
        now_txt = f"{now_us:.1f}" if now_us is not None else "n/a"
        print(f"B={batch:4d} ctx={ctx:5d} splits={chosen.num_splits:2d}  now {key_now} "
              f"{now_txt} us  best {best} {timings[best]['us']:.1f} us  | "
              + " ".join(f"{c}:{t['us']:.1f}" for c, t in timings.items()), flush=True)
        del case  # (its unpaged keys and values)
    ratios = [r["best_one_loop_us"] / r["best_two_loops_us"] for r in rows
              if r["best_one_loop_us"] and r["best_two_loops_us"]]
    if ratios:
        print(f"one loop / two loops (each's best): median {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} shapes "
              "(< 1: set attention_config.DECODE_ONE_KV_LOOP = True)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(0),
                                             torch=torch.__version__, head_dim=hd,
                                             rows=rows), indent=1))


def _key(cfg: attention.AttentionConfig) -> str:
    """BLOCK_N/stages/min split tiles/L<loops>/w<warps>/s<splits>, e.g. 128/3/2/L1/w4/s4."""
    loops = 1 if cfg.one_kv_loop else 2
    return (f"{cfg.block_n}/{cfg.num_stages}/{cfg.min_split_tiles}/L{loops}/w{cfg.num_warps}"
            f"/s{cfg.num_splits}")


if __name__ == "__main__":
    main()
