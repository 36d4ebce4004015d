"""Sliding-window attention's decode cost against the context: one decode step's
attention at each context, with the window on and off, on Gemma 3 1B's layer shapes (4
query heads, 1 KV head, head_dim 256; window 512). CUDA: the Triton kernel; `--device
cpu`: the CPU op (attention/cpu.py), timed by the wall clock.

The windowed kernel skips the key tiles before the window (attention/triton/kernels.py),
so its time should stay flat as the context grows while the full kernel's grows with it.
Each figure is the median of `--iters` CUDA-event timings (L2 flushed before each call),
the window-on and window-off calls interleaved; `--samples` repeats the whole table.
The output is checked against the float64 reference for the smallest case first.

    python scripts/bench_sliding.py --contexts 8192 32768 --batches 1 16 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_kernels_lib import L2_FLUSH_BYTES, decode_case, time_us_interleaved  # noqa: E402

from llmfast.attention import ops  # noqa: E402
from llmfast.attention.triton import launch as attention  # noqa: E402


def _check(case, window: int, scale: float) -> float:
    """Max |error| of the windowed kernel against the float64 reference."""
    want = torch.zeros(case.q.shape, dtype=torch.float64, device=case.q.device)
    ops.paged_attention_reference(case.q.double(), case.k_cache.double(),
                                  case.v_cache.double(), case.block_table,
                                  case.query_start_loc, case.seq_lens, scale, want,
                                  compute_dtype=torch.float64, window=window)
    attention.unified_attention(case.q, case.k_cache, case.v_cache, case.block_table,
                                case.query_start_loc, case.seq_lens, scale, case.out,
                                window=window, uniform_decode=True)
    return (case.out.double() - want).abs().max().item()


def _cpu_figures(args) -> list[dict]:
    """The CPU op's medians (wall clock, `--iters` calls, window on and off in turn)."""
    from llmfast.attention.cpu import paged_attention_cpu
    from llmfast.attention.workspaces import AttentionWorkspaces

    gen = torch.Generator().manual_seed(0)
    scale = args.head_dim**-0.5
    rows = []
    for batch in args.batches:
        for ctx in args.contexts:
            blocks = -(-ctx // args.block_size)
            shape = (batch * blocks, args.block_size, args.kv_heads, args.head_dim)
            k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
            table = torch.randperm(batch * blocks, generator=gen).view(batch, blocks).int()
            q = torch.randn(batch, args.heads, args.head_dim, generator=gen)
            qsl = torch.arange(batch + 1, dtype=torch.int32)
            lens = torch.full((batch,), ctx, dtype=torch.int32)
            out = torch.empty_like(q)
            # The cache's owner, as the runner's: plans memoised, gather buffers reused.
            owner = AttentionWorkspaces([k_cache])  # noqa: F841 (held while timing)
            timings: dict = {args.window: [], None: []}
            for _ in range(args.iters):
                for window in timings:
                    start = time.perf_counter()
                    paged_attention_cpu(q, k_cache, v_cache, table, qsl, lens, scale, out,
                                        window)
                    timings[window].append(1e6 * (time.perf_counter() - start))
            rows.append(dict(batch=batch, context=ctx, window=args.window,
                             windowed_us=statistics.median(timings[args.window]),
                             full_us=statistics.median(timings[None])))
            print(f"batch {batch:3d}  context {ctx:6d}  window {args.window}: "
                  f"{rows[-1]['windowed_us']:9.1f} us   full: {rows[-1]['full_us']:9.1f} us")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--samples", type=int, default=3)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    if args.device == "cpu":
        result = dict(device="cpu", dtype="float32", torch=torch.__version__,
                      threads=torch.get_num_threads(), heads=args.heads,
                      kv_heads=args.kv_heads, head_dim=args.head_dim,
                      block_size=args.block_size, iters=args.iters, rows=_cpu_figures(args))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        return
    if not torch.cuda.is_available():
        sys.exit("bench_sliding.py needs a CUDA GPU")
    gen = torch.Generator("cuda").manual_seed(0)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    scale = args.head_dim**-0.5
    cases = {(b, c): decode_case(b, c, args.heads, args.kv_heads, args.head_dim,
                                 args.block_size, gen)
             for b in args.batches for c in args.contexts}
    small = cases[(min(args.batches), min(args.contexts))]
    error = _check(small, args.window, scale)
    rows = []
    for (batch, ctx), case in cases.items():
        def run(window, case=case):
            return lambda: attention.unified_attention(
                case.q, case.k_cache, case.v_cache, case.block_table, case.query_start_loc,
                case.seq_lens, scale, case.out, window=window, uniform_decode=True)

        samples = [time_us_interleaved([run(args.window), run(None)], args.iters, flush)
                   for _ in range(args.samples)]
        windowed = [s[0] for s in samples]
        full = [s[1] for s in samples]
        rows.append(dict(batch=batch, context=ctx, window=args.window,
                         windowed_us=statistics.median(windowed), full_us=statistics.median(full),
                         windowed_samples=windowed, full_samples=full))
        print(f"batch {batch:3d}  context {ctx:6d}  window {args.window}: "
              f"{rows[-1]['windowed_us']:8.1f} us   full: {rows[-1]['full_us']:8.1f} us")
    result = dict(device=torch.cuda.get_device_name(), dtype="bfloat16", heads=args.heads,
                  kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                  iters=args.iters, max_abs_error=error, rows=rows)
    print(f"max |error| vs float64 (batch {min(args.batches)}, context "
          f"{min(args.contexts)}): {error:.2e}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
