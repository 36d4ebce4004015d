"""Benchmark the Triton paged-attention kernel against torch SDPA (needs a CUDA GPU).

    python scripts/bench_kernels.py [--json PATH] [--markdown PATH] [--iters 50]
    python scripts/bench_kernels.py decode-configs --head-dim 64 --json decode_configs.json
    python scripts/bench_kernels.py ship-prefill-tiles --model random:llama-3.2-1b \
        --dtype bfloat16 --copy-to $OUT/prefill_tiles_llama-3.2-1b.json

Two more commands for the same kernel: `decode-configs` sweeps the decode launch
configuration (llmfast/bench/kernels/decode_configs.py) and prints, per shape, the configuration
`select_config` picks now and the best one measured; `ship-prefill-tiles` makes this
GPU's prefill tile table cover a model and installs it as the shipped one (below, at
ship_prefill_tiles). Without a command: the table of the kernel against SDPA.

Decode: batch 1/8/64/256 x context 512/2048/8192, one query token per request over a
paged cache with shuffled blocks; reports achieved bandwidth on the K/V bytes read.
Beside each: torch's scaled_dot_product_attention on the same values laid out
contiguously (GQA via enable_gqa), and the largest difference between the two outputs.
Prefill (2k/4k/8k causal, vs SDPA's FlashAttention backend, TFLOP/s), mixed batches (one
launch vs its two parts) and the prefill tile tuning that runs first (--tune): see
llmfast/bench/kernels/attention_prefill.py. A device-to-device copy gives the bandwidth ceiling
(bytes read + written / time). Times are medians of CUDA-event timings (--iters calls;
--eager-iters for the eager decode rows against SDPA), with L2 flushed before every timed
call. Default config: bf16, head_dim 128, 32 q heads, 8 KV heads,
block_size 16. Prints markdown tables (for profiles/kernels.md).

Decode rows also show: the same call replayed from a CUDA graph (what a full-graph
decode step pays) beside SDPA replayed from a CUDA graph too (like for like), the host
time of one eager launch (wall clock per call of a burst of launches, no sync between:
the cached launch path, the same handing the launcher the
tensors instead of their addresses, and Triton's JIT dispatch), and the *fixed* launch a
full CUDA graph uses: the split count chosen from a block table as wide as
--max-model-len instead of the live context (eager and graph-replayed), i.e. what fixing
the launch per captured size costs at short and long contexts.

`--kv-cache-dtype fp8`: the decode rows read a float8_e4m3fn cache (the engine's
--kv-cache-dtype fp8), holding K/V rounded to fp8; SDPA gets the same rounded values in
--dtype, so the difference stays a kernel's, and GB/s count one byte per cache element.
Decode only (no prefill, mixed, tuning or split sweep in that mode).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmfast.attention.triton import launch as attention
from llmfast.attention.tuning import prefill_tuning
from llmfast.attention.tuning.prefill_tuning import kv_dtype_name
from llmfast.attention.tuning.split_table import (
    DEFAULT_DECODE_STAGES,
    best_split,
    find_table,
    merge_sweep,
)
from llmfast.bench.kernels.attention_decode import run_case
from llmfast.bench.kernels.attention_prefill import (
    mixed_lines,
    prefill_lines,
    run_mixed,
    run_prefill,
    tune,
    tuned_table_note,
    tuning_lines,
)
from llmfast.bench.kernels.cuda_timing import L2_FLUSH_BYTES, copy_bandwidth
from llmfast.bench.kernels.decode_configs import sweep_shape
from llmfast.models.sources.model_source import resolve_model


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Other commands: `decode-configs --help`, `ship-prefill-tiles --help`.")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--prefill-tokens", type=int, nargs="*", default=[2048, 4096, 8192],
                        help="prefill rows (none: decode only)")
    parser.add_argument("--mixed", nargs="*", default=["2048,2048,64,2048", "512,3584,32,4096"],
                        help="mixed batches CHUNK,PREFIX,DECODES,DECODE_CONTEXT")
    parser.add_argument("--tune", choices=["auto", "force", "off"], default="auto",
                        help="prefill tile tuning of the bench's shape classes first: force "
                             "re-tunes, auto only tunes classes without tiles")
    parser.add_argument("--tuned-table", type=Path,
                        help="copy the tuned prefill tile table here (to ship it)")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--eager-iters", type=int, default=200,
                        help="calls of each in the eagerly launched decode rows' llmfast vs "
                             "SDPA timing (#17's B=1..8 bar): its host launch time varies "
                             "from call to call far more than a replay's device time, and "
                             "200 calls of each take 0.1-0.3 s per row")
    parser.add_argument("--max-model-len", type=int, default=8192,
                        help="width of the full graph's block table (fixed-launch rows)")
    parser.add_argument("--json", type=Path, help="write all results here")
    parser.add_argument("--sweep-splits", type=Path,
                        help="time every split count per decode shape; best per (batch, "
                             "context) added to this JSON, one table per head shape (the "
                             "file to ship as kernels/tuning/split_tables/<gpu>.json)")
    parser.add_argument("--markdown", type=Path, help="also write the tables here")
    parser.add_argument("--samples", type=int, default=1,
                        help="time every row this many times (the JSON's `samples`; the "
                             "tables show the first)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: decode rows over a float8_e4m3fn cache (decode only)")
    args = parser.parse_args(argv)
    if args.kv_cache_dtype == "fp8":
        if args.sweep_splits or args.prefill_tokens or args.mixed or args.tune != "off":
            sys.exit("--kv-cache-dtype fp8 times decode only: pass --prefill-tokens "
                     "--mixed (empty) and --tune off, without --sweep-splits")
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py needs a CUDA GPU (none found); nothing was measured.")

    tuning = None
    if args.tune != "off":
        tuning = tune(args, torch.device("cuda", 0))
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    copy_gbs = copy_bandwidth(flush, args.iters)
    elem = (1 if args.kv_cache_dtype == "fp8"  # bytes per cache element
            else torch.empty((), dtype=getattr(torch, args.dtype)).element_size())
    heads, kv_heads, hd = args.num_heads, args.num_kv_heads, args.head_dim

    samples = []
    for sample in range(args.samples):  # every row timed again: its median and spread
        prefill = []
        for tokens in args.prefill_tokens:
            prefill.append(run_prefill(tokens, args, flush, gen))
            torch.cuda.empty_cache()
        mixed = []
        for spec in args.mixed:
            chunk, prefix, decodes, ctx = (int(x) for x in spec.split(","))
            mixed.append(run_mixed(chunk, prefix, decodes, ctx, args, flush, gen))
            torch.cuda.empty_cache()
        # Printed now as well: a step cut short by its time limit still shows these.
        early = prefill_lines(prefill) + mixed_lines(mixed)
        if tuning is not None and sample == 0:
            early += tuning_lines(tuning)
        print("\n".join(early), flush=True)

        decode = []
        for batch in args.batches:
            for ctx in args.contexts:
                r = run_case(batch, ctx, 1, args, flush, gen)
                kv_bytes = 2 * batch * ctx * kv_heads * hd * elem
                r.update(ours_gbs=kv_bytes / r["ours_us"] / 1e3,
                         sdpa_gbs=kv_bytes / r["sdpa_us"] / 1e3)
                decode.append(r)
                torch.cuda.empty_cache()
        samples.append(dict(decode=decode, prefill=prefill, mixed=mixed))
    # The tables and the top-level rows: the first sample's (the JSON keeps them all).
    decode, prefill, mixed = (samples[0][k] for k in ("decode", "prefill", "mixed"))

    def sdpa_graph(r: dict) -> float:  # nan where SDPA could not be captured
        return r.get("sdpa_graph_us", float("nan"))

    device = torch.cuda.get_device_name(0)
    lines = [
        f"Device: {device}; torch {torch.__version__}; {args.dtype}, head_dim {hd}, "
        f"{heads} q heads, {kv_heads} KV heads, block_size {args.block_size}"
        + (", KV cache float8_e4m3fn." if args.kv_cache_dtype == "fp8" else "."),
        "",
        f"Device-to-device copy bandwidth (read + write): **{copy_gbs:.0f} GB/s**",
        "",
        "Decode (1 query token per request; GB/s = K/V bytes read / time; µs between CUDA "
        "events with the GPU idle at the start, so eager figures include the host launch; "
        f"SDPA: {', '.join(sorted({r['sdpa_variant'] for r in decode})) or '-'}):",
        "",
        "| batch | context | splits | llmfast µs | llmfast GB/s | % of copy BW | SDPA µs "
        "| SDPA GB/s | llmfast / SDPA speed | graph µs | SDPA graph µs "
        "| graph speed vs SDPA graph | % BW graph "
        "| host µs/launch | host µs, tensors to the launcher | host µs, Triton JIT launch "
        "| max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in decode:
        kv_bytes = r["ours_gbs"] * r["ours_us"] * 1e3
        lines.append(
            f"| {r['batch']} | {r['ctx']} | {r['splits']} | {r['ours_us']:.1f} "
            f"| {r['ours_gbs']:.0f} "
            f"| {100 * r['ours_gbs'] / copy_gbs:.0f}% | {r['sdpa_us']:.1f} | {r['sdpa_gbs']:.0f} "
            f"| {r['sdpa_us'] / r['ours_us']:.2f}x | {r['graph_us']:.1f} "
            f"| {sdpa_graph(r):.1f} | {sdpa_graph(r) / r['graph_us']:.2f}x "
            f"| {100 * kv_bytes / r['graph_us'] / 1e3 / copy_gbs:.0f}% "
            f"| {r['launch_host_us']:.1f} | {r['launch_host_tensors_us']:.1f} "
            f"| {r['launch_host_jit_us']:.1f} "
            f"| {r['max_abs_diff']:.2g} |"
        )
    lines += [
        "",
        f"Decode with the full graph's fixed launch (splits from a {args.max_model_len}-token "
        "block table, not the live context). The 2-kernel merge (the launch before issue "
        "17) rounds the live split count up to a power of two (6 splits run as 8):",
        "",
        "| batch | context | live splits | fixed splits | live µs | live 2-kernel merge µs "
        "| fixed µs | fixed / live | live graph µs | fixed graph µs "
        "| fixed graph speed vs SDPA graph | max abs diff |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in decode:
        lines.append(
            f"| {r['batch']} | {r['ctx']} | {r['splits']} | {r['fixed_splits']} "
            f"| {r['ours_us']:.1f} | {r['two_kernel_us']:.1f} | {r['fixed_us']:.1f} "
            f"| {r['fixed_us'] / r['ours_us']:.2f}x "
            f"| {r['graph_us']:.1f} | {r['fixed_graph_us']:.1f} "
            f"| {sdpa_graph(r) / r['fixed_graph_us']:.2f}x | {r['fixed_max_abs_diff']:.2g} |"
        )
    lines += prefill_lines(prefill) + mixed_lines(mixed)
    if tuning is not None:
        lines += tuning_lines(tuning) + tuned_table_note(args.tuned_table)
    if args.sweep_splits:
        best = [dict(batch=r["batch"], ctx=r["ctx"], chosen=r["splits"],
                     best=best_split(r["split_sweep_graph_us"], r["splits"]),
                     graph_us=r["split_sweep_graph_us"]) for r in decode]
        lines += ["", "KV-split sweep (graph-replayed µs per split count):", "",
                  "| batch | context | chosen now | best | " + " | ".join(
                      f"{s} splits" for s in best[0]["graph_us"]) + " |",
                  "|---:|---:|---:|---:|" + "---:|" * len(best[0]["graph_us"])]
        for b in best:
            lines.append(f"| {b['batch']} | {b['ctx']} | {b['chosen']} | {b['best']} | "
                         + " | ".join(f"{v:.1f}" for v in b["graph_us"].values()) + " |")
        # The stage count the sweep ran at (this GPU's table's, if it names one): kept in
        # the table it writes, whose split counts hold for it.
        shipped = find_table(attention._device_split_tables(torch.device("cuda", 0)), heads,
                             kv_heads, hd, kv_dtype_name(getattr(torch, args.dtype)),
                             args.block_size)
        decode_stages = DEFAULT_DECODE_STAGES if shipped is None else shipped.num_stages
        # Added to the file: a sweep of another head dim into it keeps this one.
        existing = (json.loads(args.sweep_splits.read_text())
                    if args.sweep_splits.is_file() else None)
        args.sweep_splits.write_text(json.dumps(merge_sweep(existing, dict(
            device=torch.cuda.get_device_name(0), torch=torch.__version__,
            num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
            dtype=args.dtype, heads=heads, kv_heads=kv_heads, head_dim=hd,
            block_size=args.block_size, num_stages=decode_stages, table=best)), indent=2))
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.json:
        args.json.write_text(json.dumps(dict(
            device=device, torch=torch.__version__,
            config={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            copy_gbs=copy_gbs, decode=decode, prefill=prefill, mixed=mixed, tuning=tuning,
            samples=samples if len(samples) > 1 else None,
        ), indent=2, default=str))


def decode_configs(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="bench_kernels.py decode-configs", description=(
        "Sweep the decode attention launch configuration on a GPU "
        "(llmfast/bench/kernels/decode_configs.py)."))
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
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_kernels.py decode-configs needs a CUDA GPU (none found); nothing was "
                 "measured.")
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    gen = torch.Generator("cuda").manual_seed(0)
    width = -(-args.max_model_len // args.block_size)
    print(f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}; head_dim "
          f"{args.head_dim}, {args.num_heads}/{args.num_kv_heads} heads, block table "
          f"{width * args.block_size} keys wide", flush=True)
    rows = []
    for batch, ctx in itertools.product(args.batches, args.contexts):
        row, failed = sweep_shape(batch, ctx, args, flush, gen)
        for name, error in failed.items():
            print(f"  {name}: {error}"[:200])
        rows.append(row)
        timings, best = row["timings"], row["best"]
        now_txt = f"{row['now_us']:.1f}" if row["now_us"] is not None else "n/a"
        print(f"B={batch:4d} ctx={ctx:5d} splits={row['splits']:2d}  now {row['now']} "
              f"{now_txt} us  best {best} {timings[best]['us']:.1f} us  | "
              + " ".join(f"{c}:{t['us']:.1f}" for c, t in timings.items()), flush=True)
    ratios = [r["best_one_loop_us"] / r["best_two_loops_us"] for r in rows
              if r["best_one_loop_us"] and r["best_two_loops_us"]]
    if ratios:
        print(f"one loop / two loops (each's best): median {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} shapes "
              "(< 1: set attention_config.DECODE_ONE_KV_LOOP = True)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(dict(device=torch.cuda.get_device_name(0),
                                             torch=torch.__version__, head_dim=args.head_dim,
                                             rows=rows), indent=1))


def ship_prefill_tiles(argv: list[str]) -> None:
    """A first start on a GPU model without a shipped table tunes the model's two prefill
    shape classes (attention/tuning/prefill_tuning.py; ~20-60 s on an H100). A start-up
    benchmark should time what a user gets once the table ships, so run this first: it
    tunes the model's classes that no table knows yet (whatever LLMFAST_ATTENTION_TUNING
    says), then merges the tuned classes into
    `llmfast/attention/tuning/prefill_tables/<gpu>.json` of this working copy, and copies
    that file to --copy-to so it can be committed. Without CUDA it says so and does
    nothing; with CUDA, a run that leaves nothing to ship exits 1."""
    p = argparse.ArgumentParser(prog="bench_kernels.py ship-prefill-tiles", description=(
        "Make this GPU's prefill tile table cover a model, and install it as the shipped "
        "one."))
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--copy-to", help="also write the shipped table here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to tune or ship")
        return
    cfg = resolve_model(args.model).config
    device = torch.device("cuda", 0)
    t0 = time.perf_counter()
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    if not attention.prefill_tunable(cfg.head_dim, getattr(torch, args.dtype)):
        print(f"{args.model} in {args.dtype}: prefill tiles are not tuned for this shape "
              "(the engine uses its heuristic): nothing to ship")
        return
    classes = attention.model_prefill_classes(cfg.head_dim, group, getattr(torch, args.dtype))
    for cls in classes:  # a class some table already knows is kept, not re-tuned
        if attention.tune_prefill_tiles(device, cls) is None:
            print(f"{cls.key}: no tile candidate ran; the heuristic stays")
    print(f"{args.model}: prefill classes {', '.join(c.key for c in classes)} ready in "
          f"{time.perf_counter() - t0:.1f} s")
    name = torch.cuda.get_device_name(device)
    _, tuned_json = prefill_tuning.read_table(prefill_tuning.tuned_table_path(name))
    shipped_path = prefill_tuning.shipped_table_path(name)
    _, shipped_json = prefill_tuning.read_table(shipped_path)
    merged = dict(tuned_json or shipped_json,
                  tiles={**shipped_json.get("tiles", {}), **tuned_json.get("tiles", {})})
    missing = [c.key for c in classes if c.key not in merged["tiles"]]
    if missing:
        print(f"no tiles for {', '.join(missing)} on {name}: nothing to ship")
        sys.exit(1)
    prefill_tuning.parse_tiles(merged)  # the engine must be able to read what ships
    text = json.dumps(merged, indent=2, sort_keys=True)
    shipped_path.write_text(text)
    print(f"shipped table {shipped_path}: {', '.join(sorted(merged['tiles']))}")
    if args.copy_to:
        with open(args.copy_to, "w") as f:
            f.write(text)


COMMANDS = {"decode-configs": decode_configs, "ship-prefill-tiles": ship_prefill_tiles}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        COMMANDS[sys.argv[1]](sys.argv[2:])
    else:
        main(sys.argv[1:])
