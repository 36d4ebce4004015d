#!/usr/bin/env python3
"""The Triton skinny GEMM (llmfast/kernels/gemv/) against cuBLAS at a model's projection
shapes, per M bucket, side by side: µs per call, GB/s and % of the HBM peak. `--tune`
times every candidate configuration (launch_config.tuning_candidates) and writes the
winner per shape and bucket, cuBLAS included, as a launch table.

    python scripts/bench_gemv.py --models random:llama-3.2-1b,random:llama-3.1-8b \\
        --rows 1,4,16 --json $OUT/gemv.json
    python scripts/bench_gemv.py --models random:llama-3.2-1b,random:llama-3.1-8b --fp8 \\
        --tune --install --copy-to $OUT/gemv_table.json

Each timed call runs the kernel over `copies` distinct weights of the shape (together
past 256 MiB, as a model's layers follow each other) from one CUDA graph, L2 flushed
before each replay: µs per call is the replay over the copies. A candidate whose result
differs from cuBLAS's by more than a few bf16 ulps of the output's scale is dropped.
`--install` merges the winners into this tree's shipped table (tables/<gpu>.json);
`--copy-to` writes that table where it can be committed from.

`--startup` instead runs the engine's own start-up measurement (`--gemv auto`:
worker/startup/gemv_routing.py, worker/startup/gemv_tuning.py) on each --models preset as loaded
for serving (random weights, --dtype, and fp8 with `--quantizations none,fp8`), every
shape timed whatever is shipped, at --rows' buckets; its timings go to the cache dir as a
start's would (later `--gemv auto` starts read them), the winners with every candidate's
µs to --copy-to / --install as a launch table, and per preset the seconds it took to
--json:

    python scripts/bench_gemv.py --startup --models random:llama-3.2-1b,random:llama-3.1-8b \
        --quantizations none,fp8 --copy-to $OUT/gemv_startup_table.json --json $OUT/s.json

`--compile-cost` needs no GPU: what a cold `--gemv auto` start with no shipped table
compiles for each --models preset (Triton targeting sm_90 offline, an empty Triton
cache, the start-up's own compile_candidates; llmfast/bench/kernels/gemv_compile_cost.py):
variants and seconds, or with `--count-only` the variants its launches bind:

    python scripts/bench_gemv.py --compile-cost --models random:llama-3.2-1b \
        --quantizations none [--fuse] [--count-only] --json /tmp/cost.json

On the CPU (`--device cpu`, under TRITON_INTERPRET=1) the same steps run at the given
`--shape`s with wall-clock timing: a check of the plumbing, not a figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmfast.kernels.fp8_linear import fp8_linear, quantize_weight, scaled_mm_out_dtype  # noqa: E402
from llmfast.kernels.gemv import launch_config  # noqa: E402
from llmfast.kernels.gemv.launch_config import GemvConfig, m_bucket, shape_key  # noqa: E402
from llmfast.kernels.gemv.ops import gemv_triton  # noqa: E402
from llmfast.worker.startup.gemv_tuning import candidate_name  # noqa: E402

COPIES_BYTES = 256 << 20


def model_shapes(model: str) -> list[tuple[str, int, int]]:
    """(projection, N, K) of a preset's layer and its lm_head (this GPU: one rank)."""
    from llmfast.models.sources.model_source import resolve_model

    cfg = resolve_model(model).config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [("qkv", q + 2 * kv, h), ("o", h, q), ("gate_up", 2 * i, h), ("down", h, i),
            ("lm_head", cfg.vocab_size, h)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="random:llama-3.2-1b",
                   help="comma-separated presets whose projection shapes are timed")
    p.add_argument("--shape", action="append", default=[],
                   help="N,K of a weight to time besides (or, with --models '', instead)")
    p.add_argument("--rows", default="1,2,4,8,16", help="M values (each its bucket's)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--fp8", action="store_true",
                   help="float8_e4m3fn weights with per-row scales (the lm_head stays in "
                        "--dtype, as --quantization fp8 leaves it); cuBLAS is _scaled_mm")
    p.add_argument("--tune", action="store_true", help="time every candidate, keep the best")
    p.add_argument("--startup", action="store_true",
                   help="the engine's start-up measurement of each --models preset instead")
    p.add_argument("--quantizations", default="none",
                   help="--startup: the presets' weights, comma-separated of none, fp8")
    p.add_argument("--ship", type=Path, default=None,
                   help="merge this table file into the shipped table of its GPU, and stop")
    p.add_argument("--install", action="store_true",
                   help="merge the winners into llmfast/kernels/gemv/tables/<gpu>.json")
    p.add_argument("--copy-to", type=Path, default=None, help="also write the table here")
    p.add_argument("--compile-cost", action="store_true",
                   help="count and time a cold start's GEMV compiles for sm_90 (no GPU)")
    p.add_argument("--fuse", action="store_true", help="--compile-cost: the --gemv-fuse launches")
    p.add_argument("--count-only", action="store_true",
                   help="--compile-cost: count the variants the launches bind, compile nothing")
    p.add_argument("--workers", type=int, default=None, help="--compile-cost: compile threads")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def _time_us(fns: list, iters: int, device: torch.device) -> list[float]:
    """Median µs of each fn, calls interleaved: CUDA events around graph replays with
    L2 flushed before each (llmfast/bench/kernels/cuda_timing.py), or wall clock on the CPU."""
    if device.type == "cuda":
        from llmfast.bench.kernels.cuda_timing import L2_FLUSH_BYTES, graph_replay, time_us_interleaved

        flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
        return time_us_interleaved([graph_replay(f) for f in fns], iters, flush)
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            samples[i].append((time.perf_counter() - t0) * 1e6)
    return [statistics.median(s) for s in samples]


def bench_shape(name: str, n: int, k: int, rows: int, args, device, dtype, fp8: bool,
                num_sms: int, peak: float | None) -> dict:
    """One (shape, rows): cuBLAS, the heuristic's config, and with --tune every
    candidate; µs per call, GB/s, % of HBM, and the winner."""
    gen = torch.Generator(device="cpu").manual_seed(n * 31 + k)
    elem = 1 if fp8 else dtype.itemsize
    copies = 1 if device.type != "cuda" else max(2, min(64, -(-COPIES_BYTES // (n * k * elem))))
    weights, scales = [], []
    for _ in range(copies):
        w = (torch.randn(n, k, generator=gen) / k**0.5).to(device=device, dtype=dtype)
        if fp8:
            w, s = quantize_weight(w)
            scales.append(s)
        weights.append(w)
    x = torch.randn(rows, k, generator=gen).to(device=device, dtype=dtype)
    mm_out = scaled_mm_out_dtype(device.type, dtype) if fp8 else None

    def cublas():
        for i, w in enumerate(weights):
            (fp8_linear(x, w, scales[i], None, mm_out) if fp8 else F.linear(x, w))

    def triton_fn(config: GemvConfig):
        def run():
            for i, w in enumerate(weights):
                gemv_triton(x, w, config, weight_scale=scales[i] if fp8 else None)
        return run

    heuristic = launch_config.heuristic_config(rows, n, k, num_sms, fp8)
    configs = (launch_config.tuning_candidates(rows, n, k, num_sms, fp8) if args.tune
               else [heuristic])
    # Correctness against cuBLAS on the first copy (fp8: against the dequantized weight
    # in float32, since _scaled_mm also quantizes the rows).
    w0 = weights[0].float() * (scales[0].reshape(-1, 1) if fp8 else 1)
    want = (x.float() @ w0.t())
    scale = want.abs().max().item() or 1.0
    kept = []
    for config in configs:
        got = gemv_triton(x, weights[0], config, weight_scale=scales[0] if fp8 else None)
        err = (got.float() - want).abs().max().item() / scale
        if err <= 2e-2:
            kept.append(config)
        else:
            print(f"  {name} rows={rows} {config}: off by {err:.2e} of the scale: dropped")
    times = _time_us([cublas] + [triton_fn(c) for c in kept], args.iters, device)
    per_call = [t / copies for t in times]
    nbytes = n * k * elem + (4 * n if fp8 else 0) + rows * (n + k) * dtype.itemsize

    def figures(us: float) -> dict:
        return {"us": us, "gb_per_s": nbytes / us / 1e3,
                "hbm_fraction": (nbytes / peak * 1e6 / us) if peak else None}

    timings = {"cublas": round(per_call[0], 3)}
    for config, us in zip(kept, per_call[1:]):
        timings[candidate_name(config)] = round(us, 3)
    best_i = min(range(len(kept)), key=lambda i: per_call[i + 1]) if kept else None
    best = kept[best_i] if best_i is not None else None
    best_us = per_call[best_i + 1] if best_i is not None else None
    winner = best if best_us is not None and best_us < per_call[0] else None
    heuristic_us = timings.get(candidate_name(heuristic))
    return {"shape": name, "n": n, "k": k, "rows": rows, "bytes": nbytes, "copies": copies,
            "cublas": figures(per_call[0]),
            "heuristic": figures(heuristic_us) if heuristic_us else None,
            "best": {**figures(best_us), "config": candidate_name(best)} if best else None,
            "winner": candidate_name(winner),
            "winner_config": winner, "timings_us": timings}


def install(device_name: str, tuned: dict, copy_to: Path | None, write_shipped: bool) -> Path:
    """Merge `tuned` ({key: {bucket: (config | None, timings)}}) into the shipped table
    (a shape's buckets replaced one by one)."""
    slug = launch_config.device_slug(device_name)
    path = launch_config.TABLE_DIR / f"{slug}.json"
    shapes: dict = {}
    if path.is_file():
        for key, rows in launch_config.parse_table(json.loads(path.read_text())).items():
            shapes[key] = {m: (c, {}) for m, c in rows.items()}
    for key, rows in tuned.items():
        shapes.setdefault(key, {}).update(rows)
    data = launch_config.table_json(device_name, shapes)
    text = json.dumps(data, indent=1) + "\n"
    if write_shipped:
        path.write_text(text)
        launch_config.shipped_table.cache_clear()
    if copy_to is not None:
        copy_to.parent.mkdir(parents=True, exist_ok=True)
        copy_to.write_text(text)
    return path


def ship(path: Path) -> Path:
    """--ship: `path`'s table (checked) merged into tables/<its GPU>.json."""
    data = json.loads(path.read_text())
    table = launch_config.parse_table(data)
    tuned = {key: {b: (config, data["shapes"][key][str(b)].get("timings_us", {}))
                   for b, config in rows.items()} for key, rows in table.items()}
    return install(data["device"], tuned, None, True)


def startup(args, device: torch.device, name: str) -> None:
    """--startup (see the module's docstring)."""
    import tempfile

    from llmfast.config import SkinnyLinearConfig
    from llmfast.worker.startup import gemv_tuning
    from llmfast.worker.startup.gemv_routing import route_gemv
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model

    rows = [int(r) for r in args.rows.split(",")]
    shipped_dir, scratch = launch_config.TABLE_DIR, Path(tempfile.mkdtemp())
    runs, tuned = [], {}

    def save() -> None:
        """The table and report so far: a later preset cut off by the step's time limit
        (gpu_check kills the process) loses only itself."""
        launch_config.TABLE_DIR = shipped_dir
        try:
            write_results(args, name, tuned, {"rows": rows, "runs": runs})
        finally:
            launch_config.TABLE_DIR = scratch
            launch_config.shipped_table.cache_clear()

    launch_config.TABLE_DIR = scratch  # every shape timed
    launch_config.shipped_table.cache_clear()
    try:
        for spec in filter(None, args.models.split(",")):
            for quant in args.quantizations.split(","):
                model = build_model(resolve_model(spec), getattr(torch, args.dtype), device,
                                    max_positions=256,
                                    quantization=None if quant == "none" else quant)
                routing = route_gemv(model, SkinnyLinearConfig("auto"), rows)
                del model
                torch.cuda.empty_cache()
                path = gemv_tuning.cache_path(gemv_tuning.cache_fields(name))
                shapes = json.loads(path.read_text())["shapes"] if path.is_file() else {}
                table = launch_config.parse_table({"format": launch_config.FORMAT_VERSION,
                                                   "shapes": shapes})
                for key in routing.measured:
                    tuned[key] = {b: (config, shapes[key][str(b)].get("timings_us", {}))
                                  for b, config in table[key].items()}
                runs.append({"model": spec, "quantization": quant,
                             "seconds": routing.seconds, "routed": routing.routed,
                             "shapes": {k: shapes.get(k) for k in routing.measured}})
                print(f"{spec} {quant}: {len(routing.measured)} shapes in "
                      f"{routing.seconds:.1f} s, {routing.routed} projections take the GEMV",
                      flush=True)
                for key in routing.measured:
                    print(f"  {key}: " + ", ".join(
                        f"M{b} {candidate_name(c)}" for b, c in sorted(table[key].items())))
                save()
    finally:
        launch_config.TABLE_DIR = shipped_dir
        launch_config.shipped_table.cache_clear()


def write_results(args, name: str, tuned: dict, figures: dict) -> None:
    """The table (--install, --copy-to) and the --json report."""
    table_path = None
    if tuned and (args.install or args.copy_to):
        table_path = install(name, tuned, args.copy_to, args.install)
        print(f"table: {table_path if args.install else args.copy_to}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "device_name": name, "torch": torch.__version__, "dtype": args.dtype,
            **figures, "table": str(table_path) if table_path else None}, indent=1))


def compile_cost(args) -> None:
    from llmfast.bench.kernels.gemv_compile_cost import compile_cost as measure
    from llmfast.kernels.launch import precompile

    if args.workers:
        precompile.default_workers = lambda: args.workers
    result = measure(args.models.split(","), args.quantizations.split(","), args.fuse,
                     [int(r) for r in args.rows.split(",")], args.count_only)
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    args = parse_args()
    if args.ship is not None:
        print(f"shipped: {ship(args.ship)}")
        return
    if args.compile_cost:
        return compile_cost(args)
    device = torch.device(args.device)
    if device.type != "cuda":
        from llmfast.kernels.triton_mode import triton_interpret_enabled

        if not triton_interpret_enabled():
            print("no CUDA device (and TRITON_INTERPRET is not 1): nothing to time")
            return
    dtype = getattr(torch, args.dtype)
    on_cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if on_cuda else "cpu (interpreter)"
    if args.startup:
        if not on_cuda:
            print("--startup measures on a GPU only (the engine never measures on the CPU)")
            return
        return startup(args, device, name)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if on_cuda else 8
    peak = None
    if on_cuda:
        from llmfast.bench.bandwidth import peak_bandwidth

        peak = peak_bandwidth(name)
    shapes = [(f"{m}:{proj}", n, k) for m in filter(None, args.models.split(","))
              for proj, n, k in model_shapes(m)]
    shapes += [(f"shape:{s}", *map(int, s.split(","))) for s in args.shape]
    rows_list = [int(r) for r in args.rows.split(",")]
    results, tuned = [], {}
    weight_dtype = "float8_e4m3fn" if args.fp8 else args.dtype
    print(f"{name}: {'fp8' if args.fp8 else args.dtype} weights, µs per call "
          f"(% of HBM), cuBLAS vs the Triton GEMV")
    for label, n, k in dict.fromkeys(shapes):
        fp8 = args.fp8 and not label.endswith(":lm_head")
        for rows in rows_list:
            r = bench_shape(label, n, k, rows, args, device, dtype, fp8, num_sms, peak)
            results.append({**r, "winner_config": None})
            key = shape_key(n, k, weight_dtype if fp8 else args.dtype)
            tuned.setdefault(key, {})[m_bucket(rows)] = (r["winner_config"], r["timings_us"])

            def show(f):
                if f is None:
                    return "-"
                pct = f" ({100 * f['hbm_fraction']:.0f} %)" if f["hbm_fraction"] else ""
                return f"{f['us']:.2f}{pct}"

            print(f"{label:>34} N={n:>6} K={k:>6} M={rows:>2}: cublas {show(r['cublas'])}, "
                  f"heuristic {show(r['heuristic'])}, best {show(r['best'])} "
                  f"[{r['best']['config'] if r['best'] else '-'}] -> {r['winner']}", flush=True)
    write_results(args, name, tuned if args.tune else {},
                  {"fp8": args.fp8, "tuned": args.tune, "iters": args.iters,
                   "peak_bytes_per_s": peak, "rows": results})


if __name__ == "__main__":
    main()
