#!/usr/bin/env python3
"""Decode step latency per execution mode, side by side: eager, compiled (piecewise
torch.compile), graphs (compiled + piecewise CUDA graphs; CUDA only), full (one CUDA
graph of the whole forward and lm_head, attention included, padded to a capture size;
on CPU an emulated graph, for testing the script only), and `linears`:
only the model's projections and lm_head, each called once on B rows as the eager
model calls them (on CUDA replayed from one CUDA graph, so no launch cost is in the
floor). A decode step streams every weight once, so `linears` is a floor
for any mode that keeps these kernels: eager / linears bounds what compiling the rest
(norms, RoPE, residuals, attention glue) can gain.

One decode step = B requests with one new token each at context length L: the model
forward over B tokens plus the lm_head on the B rows, then a device sync. Inputs sit
in persistent buffers (tests/helpers/static_buffers.py), as in the runner. Medians over --iters.

    python scripts/bench_modes.py --model random:smollm2-135m --batch-sizes 1
    python scripts/bench_modes.py --model random:llama-3.2-1b --dtype bfloat16 --json out.json
    python scripts/bench_modes.py --model random:llama-3.2-1b --quantization fp8

`--quantization fp8` quantizes the projections as the engine's flag does (the lm_head
stays in --dtype); `linears` then times the fp8 projections, and its HBM limit counts
their fp8 bytes. Compare against a run without it, on the same machine. `--gemv` and
`--gemv-fuse` route the projections as the engine's flags do (worker/startup/gemv_routing.py:
auto times what no table knows at the --batch-sizes up to 16 first).

Targets for `full` on the H100 (issue 15): <= 1.25x `linears` at B=1, <= 1.3x at B=64,
>= 6x eager at B=1; the table prints those ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch

from llmfast.attention.metadata import AttentionMetadata, host_max_query_len
from llmfast.bench.kernels import layer_kinds
from llmfast.compile import CompiledModel, CompileStats
from llmfast.config import (
    GEMV_BACKENDS,
    CompileConfig,
    ConfigError,
    CudaGraphMode,
    SkinnyLinearConfig,
    parse_dtype,
)
from llmfast.cuda_graphs.model_graphs import ModelCudaGraphs
from llmfast.kernels.cpu.linear import prepack_linears
from llmfast.worker.startup.gemv_routing import route_gemv
from llmfast.models.loading.loader import build_model
from llmfast.models.quantization.fp8 import Fp8Linear
from llmfast.models.sources.model_source import resolve_model
from tests.helpers.static_buffers import StaticBatch  # (the layout keeps it with the tests)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="random:smollm2-135m")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--batch-sizes", default=None, help="default: 1,8,64,256,512 (CUDA), 1,8 (CPU)")
    p.add_argument("--modes", default=None,
                   help="default: eager,compiled,graphs,full,linears (CUDA), eager,compiled "
                        "(CPU); any of eager, compiled, graphs, full, linears")
    p.add_argument("--context-len", type=int, default=128, help="context per request")
    p.add_argument("--iters", type=int, default=None, help="timed steps (default 50 CUDA, 10 CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192,
                   help="width of the block table in tokens, as the engine's for its "
                        "max_model_len (default 8192, the engine's): a full graph's "
                        "attention split count is fixed from it, not from the context")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (on a shared CPU, 1 avoids OpenMP oversubscription)")
    p.add_argument("--quantization", choices=["fp8"], default=None,
                   help="quantize the projections at load, as the engine's flag")
    p.add_argument("--gemv", choices=GEMV_BACKENDS, default="auto",
                   help="the decode-sized projections' kernels, as the engine's flag")
    p.add_argument("--gemv-fuse", action="store_true",
                   help="the fused decoder layers, as the engine's flag")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--trace-dir", type=Path, default=None,
                   help="CUDA only: after timing, profile 5 steps of each of --trace-modes "
                        "per batch size and write each kernel's device µs per step there "
                        "(<mode>_B<b>_kernels.md)")
    p.add_argument("--trace-modes", default="full")
    p.add_argument("--kinds-json", type=Path, default=None,
                   help="per batch size, where the step's time goes per layer kind (qkv, "
                        "o, gate_up, down, lm_head, attention, other): bytes, µs, %% of "
                        "HBM (llmfast/bench/kernels/layer_kinds.py); the step is `full`'s (else "
                        "the first mode's); a markdown table beside it (.md)")
    p.add_argument("--kv-cache-dtype", default=None,
                   help="the KV cache's element type for --kinds-json's attention bytes "
                        "(default: the model dtype, as the harness's cache)")
    return p.parse_args()


def decode_batch(static: StaticBatch, batch: int, context_len: int) -> None:
    """Fill the persistent buffers for `batch` decodes, each the last token of a
    `context_len` context (the cache contents don't matter for timing)."""
    bs = static.block_size
    pos = context_len - 1
    rows = static.block_table[:batch]
    static.input_ids[:batch] = 1
    static.positions[:batch] = pos
    static.slot_mapping[:batch] = rows[:, pos // bs].long() * bs + pos % bs
    static.table[:batch].copy_(rows)
    static.query_start_loc[: batch + 1] = torch.arange(batch + 1, dtype=torch.int32)
    static.seq_lens[:batch] = context_len


def make_step(static: StaticBatch, forward, batch: int, num_padded: int):
    def step() -> torch.Tensor:
        hidden = static.run(forward, num_padded, batch, max_query_len=1)  # decodes
        with torch.inference_mode():
            return static.model.compute_logits(hidden[:batch])

    return step


def full_forward_of(static: StaticBatch, cm: CompiledModel):
    """`CompiledModel.FullForward` over the harness's persistent buffers."""

    def full_forward(size: int, dummy: bool):
        ids, positions = static.input_ids[:size], static.positions[:size]
        md = AttentionMetadata(static.slot_mapping[:size], static.table[:size],
                               static.query_start_loc[: size + 1], static.seq_lens[:size],
                               host_max_query_len(1))  # uniform decode
        if dummy:
            ids.zero_()
            positions.zero_()
            md.slot_mapping.fill_(-1)
            md.query_start_loc.copy_(torch.arange(size + 1, dtype=torch.int32))
            md.seq_lens.fill_(1)

        def fn() -> torch.Tensor:
            return static.model.compute_logits(cm(ids, positions, md))

        # (What the graph reads on the device: not the host's max_query_len.)
        return fn, [ids, positions, md.slot_mapping, md.block_table, md.query_start_loc,
                    md.seq_lens]

    return full_forward


def make_full_step(static: StaticBatch, cm: CompiledModel, batch: int):
    """Pad the decode batch to the full graph's size as the runner does (rows with no
    query token, seq_len 0, slot -1) and replay the one graph."""
    size = cm.graphs.padded_num_tokens(batch, uniform_decode=True)
    if size not in cm.graphs.dispatcher.full_sizes:
        raise SystemExit(f"no full graph for batch {batch}")
    static.input_ids[batch:size] = 0
    static.positions[batch:size] = 0
    static.slot_mapping[batch:size] = -1
    static.query_start_loc[batch + 1 : size + 1] = batch
    static.seq_lens[batch:size] = 0
    inputs = full_forward_of(static, cm)(size, False)[1]

    def step() -> torch.Tensor:
        with torch.inference_mode():  # (the CPU emulation re-runs the forward)
            return cm.graphs.replay_full(size, inputs)[:batch]

    return step


def agreement(steps: dict, reference: str) -> dict[str, dict[str, float]]:
    """Each mode's logits for the same decode batch against `reference`'s: the largest
    absolute difference, that over the reference's largest |logit|, and the share of rows
    whose argmax agrees. A sanity check riding on the timing run (the tests compare
    with HF): a graph that reads a stale input or the wrong KV blocks moves the logits by
    far more than bf16 rounding does, since the cache holds random values."""
    with torch.inference_mode():
        logits = {mode: step().float().clone() for mode, step in steps.items()
                  if mode != "linears"}
    ref = logits[reference]
    scale = ref.abs().max().item() or 1.0
    out = {}
    for mode, got in logits.items():
        if mode == reference:
            continue
        diff = (got - ref).abs().max().item()
        out[mode] = {"max_abs_diff": diff, "rel_diff": diff / scale,
                     "argmax_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}
    return out


def linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The projections (float or fp8) and the lm_head, in module order."""
    return [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Fp8Linear))]


def make_linears_step(model: torch.nn.Module, batch: int, device: torch.device, dtype,
                      layers: list[torch.nn.Module] | None = None):
    """Every nn.Linear of the model in module order (projections, then lm_head), or
    `layers`, each on its own [batch, in_features] input: the weight-streaming part of a
    decode step.

    On CUDA the sequence is replayed from one CUDA graph: called eagerly, ~65 launches of
    ~20 µs host time each would make the floor a host-speed figure (~1.3 ms at B=1 for
    the 1B shape, above its ~0.82 ms weight-streaming limit) and #15's bar lenient."""
    layers = linear_layers(model) if layers is None else layers
    inputs = [torch.randn(batch, m.in_features, device=device, dtype=dtype) for m in layers]

    def run_all() -> None:
        with torch.inference_mode():
            for layer, x in zip(layers, inputs):
                layer(x)

    if device.type != "cuda":
        return run_all
    run_all()  # cuBLAS picks and allocates its workspace outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all()
    return graph.replay


def profile_kernels(step, steps: int = 5) -> list:
    """The profiler's per-kernel averages over `steps` steps (CUDA kernels, those inside
    CUDA-graph replays included)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return [e for e in prof.key_averages() if e.self_device_time_total > 0]


def write_kernel_trace(step, path: Path, title: str, steps: int = 5) -> None:
    """Each kernel's device time per step over `steps` profiled steps (torch.profiler),
    largest first: which kernels a mode launches, how many of each, what they cost."""
    kernels = profile_kernels(step, steps)
    kernels.sort(key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in kernels) / steps
    lines = [f"# {title}: {total:.1f} µs of kernels per step ({steps} steps)", "",
             "| µs/step | calls/step | µs/call | kernel |", "|---:|---:|---:|---|"]
    for e in kernels:
        lines.append(f"| {e.self_device_time_total / steps:.1f} | {e.count / steps:g} | "
                     f"{e.self_device_time_total / e.count:.2f} | `{e.key[:120]}` |")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    print(f"kernel trace: {path}", flush=True)


def measure_kinds(model, step, batch: int, step_ms: float, args, device, dtype) -> dict:
    """The per-kind table of one decode step (llmfast/bench/kernels/layer_kinds.py): each
    projection kind's layers replayed alone (one CUDA graph per kind, timed interleaved),
    attention and the rest from the profiler's kernel times in `step` (CUDA only)."""
    shape = layer_kinds.step_shape(model, batch, args.context_len,
                                   kv_dtype=getattr(torch, args.kv_cache_dtype)
                                   if args.kv_cache_dtype else None)
    kind_steps = {kind: make_linears_step(model, batch, device, dtype, layers)
                  for kind, layers in layer_kinds.kind_modules(model).items() if layers}
    times = time_interleaved(kind_steps, args.iters or 10, args.warmup, device)
    us = {kind: ms * 1e3 for kind, ms in times.items()}
    kernels, by_kind = {}, {}
    if device.type == "cuda":
        steps = 5
        kernels = {e.key: e.self_device_time_total / steps for e in profile_kernels(step, steps)}
        by_kind = layer_kinds.profile_kinds(kernels)
        us.update(attention=by_kind["attention"], other=by_kind["other"])
    peak = None
    if device.type == "cuda":
        from llmfast.bench.bandwidth import peak_bandwidth

        peak = peak_bandwidth(torch.cuda.get_device_name(device))
    rows = layer_kinds.table(layer_kinds.kind_bytes(model, shape), us, step_ms * 1e3, peak)
    return {"rows": rows, "profile_us": by_kind, "kernel_us": kernels,
            "linears_standalone_us": sum(us.get(k, 0.0) for k in layer_kinds.LINEAR_KINDS)}


def time_interleaved(steps: dict, iters: int, warmup: int, device: torch.device) -> dict:
    """Median ms per mode. Modes take turns within each iteration, so background load
    (a shared CPU) hits them alike and the ratios stay meaningful."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in steps.values():
        for _ in range(warmup):
            step()
    sync()
    times: dict[str, list[float]] = {mode: [] for mode in steps}
    for _ in range(iters):
        for mode, step in steps.items():
            t0 = time.perf_counter()
            step()
            sync()
            times[mode].append(time.perf_counter() - t0)
    return {mode: statistics.median(ts) * 1e3 for mode, ts in times.items()}


def gemv_label(args) -> str:
    return f"--gemv {args.gemv}" + (" --gemv-fuse" if args.gemv_fuse else "")


def write_kinds(args, kinds: dict[int, dict], device, dtype) -> None:
    on_cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    title = (f"{args.model} {str(dtype).removeprefix('torch.')}"
             f"{' fp8' if args.quantization else ''}, context {args.context_len}, {name}, "
             f"{gemv_label(args)}")
    args.kinds_json.parent.mkdir(parents=True, exist_ok=True)
    args.kinds_json.write_text(json.dumps({
        "model": args.model, "dtype": str(dtype), "quantization": args.quantization,
        "gemv": gemv_label(args), "device_name": name,
        "torch": torch.__version__, "context_len": args.context_len,
        "batches": {str(b): k for b, k in kinds.items()}}, indent=1))
    args.kinds_json.with_suffix(".md").write_text("\n".join(
        layer_kinds.markdown(k["rows"], f"{title}, B={b} ({k['mode']})")
        for b, k in kinds.items()))


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    on_cuda = device.type == "cuda"
    dtype = parse_dtype(args.dtype or ("bfloat16" if on_cuda else "float32"))
    batches = [int(b) for b in (args.batch_sizes or ("1,8,64,256,512" if on_cuda else "1,8")).split(",")]
    modes = (args.modes or ("eager,compiled,graphs,full,linears" if on_cuda
                            else "eager,compiled")).split(",")
    unknown = set(modes) - {"eager", "compiled", "graphs", "full", "linears"}
    if unknown:
        sys.exit(f"unknown mode(s) {', '.join(sorted(unknown))}")
    if "graphs" in modes and not on_cuda:
        sys.exit("mode 'graphs' needs CUDA")
    iters = args.iters or (50 if on_cuda else 10)
    max_batch = max(batches)

    source = resolve_model(args.model)
    model = build_model(source, dtype, device, max_positions=args.context_len + 16,
                        quantization=args.quantization)
    if device.type == "cpu":
        # As the runner does for eager CPU runs; compiled graphs do not use the packs.
        prepack_linears(model, None)
    try:
        gemv = SkinnyLinearConfig(args.gemv, args.gemv_fuse)
    except ConfigError as e:
        sys.exit(str(e))
    routing = route_gemv(model, gemv, batches)  # (before anything is compiled)
    print(f"[gemv] {gemv_label(args)}: {routing.routed} projections take the op"
          + (", fused layers" if routing.fused else "")
          + (f", {len(routing.measured)} shapes timed or read in {routing.seconds:.1f} s"
             if routing.measured else ""), flush=True)
    static = StaticBatch(model, max_batch, args.context_len, max_num_tokens=max_batch,
                         block_size=args.block_size, table_len=args.max_model_len)
    # Random cache contents, so a graph reading the wrong blocks shows in `agreement`
    # (zeroed blocks all look alike). Steps rewrite only each row's last slot, with the
    # same values in every mode.
    torch.manual_seed(0)
    for k_cache, v_cache in static.caches:
        k_cache.normal_()
        v_cache.normal_()
    forwards = {}
    full_cm = None
    info: dict[str, object] = {}
    graph_mode = {"compiled": CudaGraphMode.NONE, "graphs": CudaGraphMode.PIECEWISE,
                  "full": CudaGraphMode.FULL_DECODE}
    for mode in modes:
        if mode == "linears":
            continue
        if mode == "eager":
            forwards[mode] = (model, lambda n: n)
            continue
        config = CompileConfig(cuda_graph_mode=graph_mode[mode],
                               cuda_graph_sizes=tuple(sorted(set(batches))))
        # As the runner builds them: one set of CUDA graphs whose piece wrapper the
        # compiled model applies, one stats object.
        stats = CompileStats()
        graphs = ModelCudaGraphs(config, device, max_batch, max_num_reqs=max_batch,
                                 graph_impl="emulated" if mode == "full" and not on_cuda
                                 else "auto", stats=stats)
        cm = CompiledModel(model, config, device, graphs=graphs, stats=stats)
        if mode == "full":
            graph_bytes = graphs.capture(static.dummy_runner(cm), full_forward_of(static, cm))
            full_cm = cm
        else:
            graph_bytes = graphs.capture(static.dummy_runner(cm))
            forwards[mode] = (cm, graphs.padded_num_tokens)
        info[mode] = {"stats": cm.stats.summary(), "graph_bytes": graph_bytes}
        print(f"[{mode}] {cm.stats.summary()}", flush=True)
    results: dict[str, dict[int, float]] = {mode: {} for mode in modes}
    reference = next((m for m in modes if m != "linears"), None)
    agree: dict[int, dict[str, dict[str, float]]] = {}
    kinds: dict[int, dict] = {}
    for b in batches:
        decode_batch(static, b, args.context_len)
        steps = {mode: make_step(static, fwd, b, pad(b)) for mode, (fwd, pad) in forwards.items()}
        if full_cm is not None:
            steps["full"] = make_full_step(static, full_cm, b)
        if "linears" in modes:
            steps["linears"] = make_linears_step(model, b, device, dtype)
        steps = {mode: steps[mode] for mode in modes}
        for mode, ms in time_interleaved(steps, iters, args.warmup, device).items():
            results[mode][b] = ms
        print(f"B={b}: " + ", ".join(f"{m} {results[m][b]:.2f} ms" for m in modes), flush=True)
        if reference is not None:
            agree[b] = agreement(steps, reference)
        if args.kinds_json is not None:
            kind_mode = "full" if "full" in steps else next(m for m in modes if m != "linears")
            kinds[b] = measure_kinds(model, steps[kind_mode], b, results[kind_mode][b], args,
                                     device, dtype)
            kinds[b]["mode"] = kind_mode
            print(layer_kinds.markdown(kinds[b]["rows"], f"B={b}, {kind_mode}"), flush=True)
        if args.trace_dir is not None and on_cuda:
            for mode in args.trace_modes.split(","):
                if mode in steps:
                    write_kernel_trace(steps[mode], args.trace_dir / f"{mode}_B{b}_kernels.md",
                                       f"{args.model} {mode} B={b} context {args.context_len}")

    header = f"{'batch':>6} " + " ".join(f"{m + ' ms':>12}" for m in modes)
    if "eager" in modes:
        # eager / linears: the most any mode keeping these projections could gain.
        header += " " + " ".join(f"{('bound' if m == 'linears' else m) + ' x':>12}"
                                 for m in modes if m != "eager")
    floor = "full" in modes and "linears" in modes
    if floor:  # the issue-15 bar: full / linears <= 1.25 (B=1), 1.3 (B=64)
        header += f" {'full/linears':>13}"
    print(f"\ndecode step latency, {args.model} {str(dtype).removeprefix('torch.')} on "
          f"{torch.cuda.get_device_name(device) if on_cuda else 'cpu'}, context {args.context_len}, "
          f"median of {iters}, {torch.get_num_threads()} CPU threads")
    print(header)
    for b in batches:
        row = f"{b:>6} " + " ".join(f"{results[m][b]:>12.3f}" for m in modes)
        if "eager" in modes:
            row += " " + " ".join(f"{results['eager'][b] / results[m][b]:>12.2f}"
                                  for m in modes if m != "eager")
        if floor:
            row += f" {results['full'][b] / results['linears'][b]:>13.2f}"
        print(row)
    if any(agree.values()):
        print(f"\nlogits vs {reference} on the same batch (random KV cache): max |diff| / "
              f"max |{reference} logit|, argmax agreement")
        for b, by_mode in agree.items():
            print(f"{b:>6} " + "  ".join(f"{m}: {a['rel_diff']:.2e} {a['argmax_agree']:.0%}"
                                         for m, a in by_mode.items()))
    hbm_limit_ms = None
    if on_cuda and "linears" in modes:
        from llmfast.bench.bandwidth import peak_bandwidth

        peak = peak_bandwidth(torch.cuda.get_device_name(device))
        # Parameters, not `.weight`: an fp8 layer streams its fp8 weight and scales.
        nbytes = sum(p.numel() * p.element_size() for m in linear_layers(model)
                     for p in m.parameters())
        if peak:
            hbm_limit_ms = nbytes / peak * 1e3
            print(f"linears (CUDA-graph replay) stream {nbytes / 1e9:.2f} GB of weights: the "
                  f"HBM limit at peak bandwidth is {hbm_limit_ms:.3f} ms; linears at B=1 "
                  f"reach {hbm_limit_ms / results['linears'][batches[0]]:.0%} of it")
    if args.kinds_json is not None:
        write_kinds(args, kinds, device, dtype)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "model": args.model, "dtype": str(dtype), "quantization": args.quantization,
            "gemv": gemv_label(args), "gemv_routing": dataclasses.asdict(routing),
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if on_cuda else "cpu",
            "torch": torch.__version__, "context_len": args.context_len, "iters": iters,
            "latency_ms": {m: {str(b): v for b, v in r.items()} for m, r in results.items()},
            "linears": "CUDA-graph replay" if on_cuda else "eager",
            "linears_hbm_limit_ms": hbm_limit_ms,
            "compile": info,
            "agreement": {"reference": reference,
                          "by_batch": {str(b): a for b, a in agree.items()}},
        }, indent=2))


if __name__ == "__main__":
    main()
