"""Where decode attention's time goes against SDPA's flash decode, on a CUDA machine (#17).

For each (batch, context), graph-replayed (device time only) and eager (GPU idle at the
start: host time included), median µs of: llmfast over a paged cache whose blocks are
shuffled over the pool (what bench_kernels.py times), llmfast over the same keys laid out
in order (request r's blocks consecutive: how much the scattered pages cost), and SDPA
(flash, enable_gqa) over contiguous K/V. Each under two L2 flushes before every call:
`write` (zero a 256 MB buffer: bench_kernels.py's flush, which leaves up to the L2's size
of dirty lines that the timed kernel's misses then write back) and `read` (sum it: the
L2 holds clean lines). `GB/s` counts the K/V bytes read once.

    python scripts/bench_decode_gap.py [--shapes 8x8192 64x2048 ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernels_lib import L2_FLUSH_BYTES, decode_case, flash_backend, graph_replay

from llmfast.kernels import attention
from llmfast.kernels.tuning.prefill_measure import median_device_us_interleaved
from llmfast.kernels.workspaces import AttentionWorkspaces


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["1x8192", "8x2048", "8x8192", "64x2048",
                                                   "64x8192"])
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_gap.py needs a CUDA GPU (none found); nothing was measured.")
    dev, dtype, hd, heads, kv_heads, bs = torch.device("cuda", 0), torch.bfloat16, \
        args.head_dim, 32, 8, 16
    flush = torch.zeros(L2_FLUSH_BYTES // 4, dtype=torch.float32, device=dev)
    sink = torch.zeros((), dtype=torch.float32, device=dev)

    def write_flush():
        flush.zero_()

    def read_flush():
        torch.sum(flush, 0, out=sink)

    def idle(before):
        def run():
            before()
            torch.cuda.synchronize()
        return run

    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}; head dim {hd}, "
          f"{heads}/{kv_heads} heads, bf16, block size {bs}", flush=True)
    for shape in args.shapes:
        batch, ctx = (int(x) for x in shape.split("x"))
        case = decode_case(batch, ctx, heads, kv_heads, hd, bs, gen, dtype)
        q, k, v, k_cache, v_cache = case.q, case.k, case.v, case.k_cache, case.v_cache
        table, qsl, seq_lens, out = (case.block_table, case.query_start_loc, case.seq_lens,
                                     case.out)
        # In order: request r's blocks are r * n .. r * n + n - 1 of a pool of k itself.
        n = ctx // bs
        k_seq = k.view(batch * n, bs, kv_heads, hd)
        v_seq = v.view(batch * n, bs, kv_heads, hd)
        table_seq = torch.arange(batch * n, dtype=torch.int32, device=dev).view(batch, n)
        out_seq = torch.empty_like(q)
        owner_seq = AttentionWorkspaces([k_seq])  # noqa: F841 - as case.workspaces
        scale = hd**-0.5

        def ours():
            attention.unified_attention(q, k_cache, v_cache, table, qsl, seq_lens, scale, out)

        def ours_in_order():
            attention.unified_attention(q, k_seq, v_seq, table_seq, qsl, seq_lens, scale,
                                        out_seq)

        q_s = q.view(batch, heads, 1, hd)
        k_s, v_s = (t.transpose(1, 2).contiguous() for t in (k, v))

        def sdpa():
            F.scaled_dot_product_attention(q_s, k_s, v_s, scale=scale, enable_gqa=True)

        with flash_backend():
            fns = {"llmfast": ours, "llmfast in order": ours_in_order, "sdpa": sdpa}
            graphs = {name: graph_replay(fn) for name, fn in fns.items()}
            row = dict(batch=batch, ctx=ctx, gbytes=batch * ctx * kv_heads * hd * 2 * 2 / 1e9)
            for flush_name, before in (("write", write_flush), ("read", read_flush)):
                graph_us = median_device_us_interleaved(list(graphs.values()), args.iters,
                                                         warmup=3, before=before)
                eager_us = median_device_us_interleaved(list(fns.values()), args.iters,
                                                        warmup=3, before=idle(before))
                for name, g, e in zip(fns, graph_us, eager_us):
                    row[f"{name} graph {flush_name}"] = g
                    row[f"{name} eager {flush_name}"] = e
            want = F.scaled_dot_product_attention(q_s, k_s, v_s, scale=scale,
                                                  enable_gqa=True).view_as(q).float()
        ours()
        ours_in_order()
        row["max_diff"] = (out.float() - want).abs().max().item()
        row["max_diff_in_order"] = (out_seq.float() - want).abs().max().item()
        rows.append(row)
        gb = row["gbytes"]
        print(f"\nB={batch} ctx={ctx} ({gb * 1e3:.0f} MB of K/V; max diff "
              f"{row['max_diff']:.4f} / {row['max_diff_in_order']:.4f})")
        print("| | graph write | graph read | GB/s (read) | eager write | eager read |")
        print("|---|---:|---:|---:|---:|---:|")
        for name in fns:
            g_r = row[f"{name} graph read"]
            print(f"| {name} | {row[f'{name} graph write']:.1f} | {g_r:.1f} | "
                  f"{gb / g_r * 1e6:.0f} | {row[f'{name} eager write']:.1f} | "
                  f"{row[f'{name} eager read']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(0),
                                             torch=torch.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
