#!/usr/bin/env python3
"""The fused MoE layer (llmfast/kernels/moe/triton_moe.py) on a GPU, against a per-expert
loop (the CPU form, kernels/moe/torch_moe.py, run on the GPU: one GEMM pair per picked
expert, the counts read on the host) and a dense bmm (every expert on every token, the
router's weights zero where it did not pick: all E experts' bytes and FLOPs), at the
token counts of a decode step and a prefill (default 1, 64, 512), for the layer shapes
of random:qwen3-30b-a3b and random:mixtral-8x7b.

Each figure is the median of CUDA-event timings with L2 flushed before each call; the
fused layer and the dense bmm are replayed from CUDA graphs (as the engine runs them),
the loop runs eagerly (its host reads forbid a graph). The active-weight bandwidth is
the bytes of the experts the routing picked (each read once) over the fused time.
Routing is uniform at random (random weights route about so). Correctness: every form
against the per-expert loop in float32 on the same inputs (max abs error printed).

`--tune FILE`: time the tile candidates of `CANDIDATES` for each shape and token count
and write a tile table (kernels/moe/tile_tables/README.md) to FILE.

    python3 scripts/bench_moe.py --json OUT.json
    python3 scripts/bench_moe.py --tokens 1 16 64 256 512 2048 --tune moe-tiles.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmfast.bench.kernels.cuda_timing import (  # noqa: E402
    L2_FLUSH_BYTES,
    graph_replay,
    time_us_interleaved,
)
from llmfast.kernels.moe.tile_table import (  # noqa: E402
    MoeTiles,
    shape_key,
    table_json,
    tiles_for,
)
from llmfast.kernels.moe.torch_moe import fused_moe_torch  # noqa: E402
from llmfast.kernels.moe.triton_moe import fused_moe_triton  # noqa: E402

# (name, experts, top_k, hidden, intermediate): one layer of each preset.
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
# 42 tile shapes (each compiled once per shape class, ~1 s): about a minute per shape and
# token count, so tune one shape per device call (`--shapes`).
CANDIDATES = tuple(
    MoeTiles(m, n, k, group_m=8, num_warps=w, num_stages=3)
    for m, n, k, w in itertools.product((16, 32, 64, 128), (32, 64, 128), (64, 128), (4, 8))
    if not (m == 128 and w == 4)
)


def inputs(tokens: int, experts: int, top_k: int, hidden: int, inter: int,
           dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=dtype,
                      generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=dtype,
                     generator=gen) * inter**-0.5
    scores = torch.rand(tokens, experts, device="cuda", generator=gen)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    return x, w13, w2, weights, ids.to(torch.int32)


def dense_bmm(x, w13, w2, topk_weights, topk_ids):
    """Every expert on every token, weighted by a dense [T, E] routing matrix."""
    experts, inter = w13.shape[0], w2.shape[2]
    dense = torch.zeros(x.shape[0], experts, dtype=x.dtype, device=x.device)
    dense.scatter_(1, topk_ids.long(), topk_weights)
    gate_up = torch.bmm(x.unsqueeze(0).expand(experts, -1, -1), w13.transpose(1, 2))
    act = torch.nn.functional.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    out = torch.bmm(act, w2.transpose(1, 2))  # [E, T, H]
    return torch.einsum("eth,te->th", out, dense)


def active_bytes(topk_ids, w13, w2) -> int:
    picked = torch.unique(topk_ids).numel()
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    return picked * per_expert


def bench_shape(name: str, tokens_list, dtype, iters: int, flush) -> list[dict]:
    experts, top_k, hidden, inter = SHAPES[name]
    rows = []
    for tokens in tokens_list:
        args = inputs(tokens, experts, top_k, hidden, inter, dtype)
        want = fused_moe_torch(*[a.float() if a.is_floating_point() else a for a in args])
        fused = graph_replay(lambda: fused_moe_triton(*args))
        dense_ok = experts * tokens * 2 * inter * 4 < 8 << 30  # its [E, T, 2I] buffer
        fns = [fused, lambda: fused_moe_torch(*args)]
        if dense_ok:
            fns.append(graph_replay(lambda: dense_bmm(*args)))
        times = time_us_interleaved(fns, iters, flush)
        err = {"fused": (fused_moe_triton(*args).float() - want).abs().max().item()}
        if dense_ok:
            err["dense_bmm"] = (dense_bmm(*args).float() - want).abs().max().item()
        nbytes = active_bytes(args[4], args[1], args[2])
        row = {"shape": name, "tokens": tokens, "experts": experts, "top_k": top_k,
               "hidden": hidden, "intermediate": inter, "dtype": str(dtype)[6:],
               "fused_us": times[0], "loop_us": times[1],
               "dense_bmm_us": times[2] if dense_ok else None,
               "loop_over_fused": times[1] / times[0],
               "dense_over_fused": times[2] / times[0] if dense_ok else None,
               "active_weight_bytes": nbytes,
               "fused_active_gb_s": nbytes / times[0] / 1e3, "max_abs_error": err,
               "tiles": tiles_for(torch.cuda.get_device_name(), shape_key(
                   experts, top_k, hidden, inter, str(dtype)[6:]), tokens, experts,
                   top_k).__dict__}
        rows.append(row)
        dense = f"{row['dense_bmm_us']:9.1f}" if dense_ok else "        -"
        print(f"{name:14} T={tokens:5}  fused {times[0]:9.1f} us  loop {times[1]:9.1f} us  "
              f"dense {dense} us  loop/fused {row['loop_over_fused']:5.1f}x  "
              f"{row['fused_active_gb_s']:7.0f} GB/s active  err {err}", flush=True)
    return rows


def tune(names, tokens_list, dtype, iters: int, flush, path: Path) -> None:
    device = torch.cuda.get_device_name()
    shapes = {}
    for name in names:
        experts, top_k, hidden, inter = SHAPES[name]
        key = shape_key(experts, top_k, hidden, inter, str(dtype)[6:])
        shapes[key] = {}
        for tokens in tokens_list:
            args = inputs(tokens, experts, top_k, hidden, inter, dtype)
            timings = {}
            for tiles in CANDIDATES:
                try:
                    replay = graph_replay(lambda t=tiles: fused_moe_triton(*args, tiles=t))
                    timings[tiles] = time_us_interleaved([replay], iters, flush)[0]
                except Exception as e:  # e.g. out of shared memory at 4 stages
                    print(f"  {tiles}: {type(e).__name__}", flush=True)
            best = min(timings, key=timings.get)
            shapes[key][tokens] = (best, {
                f"m{t.block_m}-n{t.block_n}-k{t.block_k}-g{t.group_m}-w{t.num_warps}"
                f"-s{t.num_stages}": us for t, us in timings.items()})
            print(f"{key} T={tokens}: {best} {timings[best]:.1f} us "
                  f"(median of candidates {statistics.median(timings.values()):.1f})",
                  flush=True)
    path.write_text(json.dumps(table_json(device, shapes), indent=2) + "\n")
    print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 64, 512])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tune", type=Path, metavar="FILE")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_moe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    if args.tune:
        tune(args.shapes, args.tokens, dtype, args.iters, flush, args.tune)
    rows = [r for name in args.shapes for r in bench_shape(name, args.tokens, dtype,
                                                          args.iters, flush)]
    if args.json:
        args.json.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
