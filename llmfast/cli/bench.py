"""`llmfast bench`: runs the runners of `llmfast.bench` and formats their results
(Rich tables, `--json`, `--plot`). No measuring happens here."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import gc
import json
import math
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from llmfast.bench import BenchError
from llmfast.cli.common import (
    EngineOptions,
    count_progress,
    load_llm,
    stderr_console,
    sweep_overrides,
)
from llmfast.utils.flag_values import SIZES_HELP, parse_sizes

BENCH_EXAMPLES = """\
**Examples**

* `llmfast bench --sizes 1..512 --max-num-seqs 512`  (decode sweep: batch 1, 2, 4, ... 512)

* `llmfast bench --sizes 8..64:8 --context 512 --modes eager,compiled,graphs --plot sweep.png`

* `llmfast bench --mode throughput --num-prompts 200 --input-len 256 --output-len 128 --baseline hf`

* `llmfast bench --mode latency --request-rate 4 --num-prompts 100 --json latency.json`

* `llmfast bench --model random:llama-3.2-1b --startup`  (cold and warm start-up, two fresh processes)

Sizes: `1..512` doubles from 1 to 512 (1, 2, 4, ..., 512), `8..64:8` steps by 8, `1,8,64` lists.
"""


class BenchMode(str, enum.Enum):
    sweep = "sweep"
    throughput = "throughput"
    latency = "latency"


class Baseline(str, enum.Enum):
    none = "none"
    hf = "hf"


# Each execution mode is its own LLM instance with these engine arguments.
EXEC_MODES: dict[str, dict[str, Any]] = {
    "eager": {"enforce_eager": True},
    "compiled": {"enforce_eager": False, "compile": True, "cuda_graphs": False},
    "graphs": {"enforce_eager": False, "compile": True, "cuda_graphs": True},
}


def bench(
    *,
    opts: EngineOptions,
    mode: Annotated[BenchMode | None, typer.Option(
        "--mode", help="sweep: decode latency per batch size; throughput: an offline batch; "
                       "latency: requests arriving over time.  [default: sweep, none with "
                       "--startup]", show_default=False)] = None,
    sizes: Annotated[str, typer.Option("--sizes", help=f"Sweep batch sizes: {SIZES_HELP}."
                                       )] = "1..64",
    context: Annotated[int, typer.Option("--context", help="Sweep: prompt tokens per "
                                         "request.")] = 128,
    steps: Annotated[int, typer.Option("--steps", help="Sweep: timed decode steps per "
                                       "size.")] = 32,
    modes: Annotated[str | None, typer.Option("--modes", help="Sweep: compare execution modes, "
                                              "e.g. eager,compiled,graphs (graphs: CUDA "
                                              "only).")] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="Throughput/latency: "
                                             "requests.")] = 64,
    input_len: Annotated[int, typer.Option("--input-len", help="Prompt tokens (mean).")] = 128,
    output_len: Annotated[int, typer.Option("--output-len", help="Output tokens (mean).")] = 128,
    random_range_ratio: Annotated[float, typer.Option(
        "--random-range-ratio", help="Lengths uniform in mean*(1±r); 0 = fixed.")] = 0.0,
    baseline: Annotated[Baseline, typer.Option("--baseline", help="Throughput: also run HF "
                                               "transformers generate.")] = Baseline.none,
    hf_batch_size: Annotated[int | None, typer.Option(
        "--hf-batch-size", help="HF baseline batch size.  [default: on CUDA the fastest of "
        "8, 16, ... up to the request count, probed first; on CPU all requests]",
        show_default=False)] = None,
    request_rate: Annotated[float, typer.Option(
        "--request-rate", help="Latency: Poisson arrivals per second; inf = all at once. "
        "The arrivals may span at most an hour.")]
    = math.inf,
    startup: Annotated[bool, typer.Option(
        "--startup", help="Start the engine twice in fresh processes, on empty caches then "
                          "on the caches the first left, and print both start-ups side by "
                          "side (alone, or before --mode's benchmark).")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write all figures as JSON "
                                                   "(.json).")]
    = None,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="Write a plot (.png, .svg or .pdf).")] = None,
) -> None:
    """Benchmark decode latency, throughput, request latency or start-up."""
    check_output_paths(json_path, plot_path)
    if min(context, steps, num_prompts, input_len, output_len) < 1:
        raise BenchError("--context, --steps, --num-prompts, --input-len and --output-len "
                         "must be >= 1")
    if mode is BenchMode.latency:
        from llmfast.bench import check_request_rate

        check_request_rate(request_rate, num_prompts)
    if hf_batch_size is not None and hf_batch_size < 1:
        raise BenchError("--hf-batch-size must be >= 1")
    if mode is None and not startup:
        mode = BenchMode.sweep
    seed = opts.engine_kwargs.get("seed", 0)
    config: dict[str, Any] = {"mode": mode.value if mode else "startup",
                              "model": opts.model or "default",
                              "engine_args": opts.engine_kwargs, "seed": seed}
    err = stderr_console()
    con = table_console()
    startup_report = None
    if startup:
        from llmfast.bench.startup import run_startup

        with count_progress("start-up: cold, then warm (two fresh processes)", err):
            startup_report = dataclasses.asdict(run_startup(opts.model, opts.engine_kwargs))
        con.print(startup_table(startup_report))
    runs: dict[str, dict] = {}
    if mode is BenchMode.sweep:
        size_list = parse_sizes(sizes)
        exec_modes = parse_exec_modes(modes, opts)
        overrides = sweep_overrides(size_list, opts)
        config |= {"sizes": size_list, "context": context, "steps": steps,
                   "exec_modes": exec_modes}
        for name in exec_modes:
            runs[name] = _sweep_run(opts, name, overrides, size_list, context, steps, seed, err)
        con.print(sweep_table(runs))
    elif mode is not None:
        from llmfast.bench import random_requests

        config |= {"num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
                   "random_range_ratio": random_range_ratio}
        run, llm = _start(opts, "default", {}, err)
        requests = random_requests(num_prompts, input_len, output_len,
                                   llm.engine.config.model.vocab_size, random_range_ratio, seed)
        if mode is BenchMode.throughput:
            config |= {"baseline": baseline.value, "hf_batch_size": hf_batch_size}
            _throughput_run(run, llm, requests, baseline, hf_batch_size, err)
            con.print(throughput_table(run))
        else:
            from llmfast.bench import run_latency

            config["request_rate"] = request_rate
            with count_progress("latency", err) as progress:
                result = run_latency(llm.engine, requests, request_rate, seed, progress)
            run["latency"] = dataclasses.asdict(result)
            con.print(latency_table(run["latency"]))
        runs = {"default": run}
    report = bench_report(config, runs, startup_report)
    if json_path is not None:
        json_path.write_text(json.dumps(_finite(report), indent=2, allow_nan=False,
                                        default=str) + "\n")
        err.print(f"wrote {json_path}", style="dim")
    if plot_path is not None:
        from llmfast.cli.plot import plot_report

        plot_report(report, plot_path)
        err.print(f"wrote {plot_path}", style="dim")


# ---------------------------------------------------------------------- checks


# What --plot can write (matplotlib picks the format from the extension) and --json.
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
JSON_SUFFIXES = (".json",)


def check_output_paths(json_path: Path | None, plot_path: Path | None) -> None:
    """Fail before a long benchmark, not after it: each output file writable, with an
    extension naming its format (a plot without one would be written under another name)."""
    for path, flag, suffixes in ((json_path, "--json", JSON_SUFFIXES),
                                 (plot_path, "--plot", PLOT_SUFFIXES)):
        if path is None:
            continue
        if path.suffix.lower() not in suffixes:
            got = f"has extension {path.suffix!r}" if path.suffix else "has no extension"
            raise BenchError(f"{flag} {path} {got}; use {' or '.join(suffixes)}")
        check_writable(path)


def check_writable(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise BenchError(f"{path} is a directory; give a file name")
    if not parent.is_dir():
        raise BenchError(f"cannot write {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise BenchError(f"cannot write {path}: directory {parent} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise BenchError(f"cannot write {path}: the file is not writable")


def parse_exec_modes(spec: str | None, opts: EngineOptions) -> list[str]:
    if spec is None:
        return ["default"]
    names = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in names if m not in EXEC_MODES]
    if unknown or not names:
        raise BenchError(f"unknown mode(s) {', '.join(unknown) or repr(spec)} in --modes; "
                         f"choose from {', '.join(EXEC_MODES)}")
    if "graphs" in names:
        from llmfast.engine_args import resolve_device

        if resolve_device(opts.engine_kwargs.get("device", "auto")).type != "cuda":
            raise BenchError("mode graphs needs a CUDA device (CUDA graphs do not exist on CPU)")
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------- runs


def _start(opts: EngineOptions, name: str, overrides: dict[str, Any], err: Console):
    llm = load_llm(opts, err, **overrides)
    engine = llm.engine
    run = {"exec_mode": name, "model": engine.source.name,
           "engine_config": dataclasses.asdict(engine.config),
           "startup": dict(engine.startup_times)}
    stats = engine.runner_info.compile_stats  # rank 0's, wherever it runs; None: eager
    if stats is not None:
        # CUDA graphs of each kind, their capture time and memory (compile/stats.py).
        run["compile_stats"] = dataclasses.asdict(stats)
        run["compile_summary"] = stats.summary()
    return run, llm


def _sweep_run(opts, name, overrides, sizes, context, steps, seed, err) -> dict:
    from llmfast.bench import run_sweep

    run, llm = _start(opts, name, {**overrides, **EXEC_MODES.get(name, {})}, err)
    with count_progress(f"sweep ({name})", err) as progress:
        result = run_sweep(llm.engine, sizes, context, steps, seed, progress)
    run["sweep"] = [dataclasses.asdict(p) for p in result.points]
    run["sweep_skipped"] = [dataclasses.asdict(s) for s in result.skipped]
    run["bandwidth"] = None if result.bandwidth is None else {
        **dataclasses.asdict(result.bandwidth), "source": result.bandwidth.source}
    run["weight_bytes_per_rank"] = result.weight_bytes_per_rank
    run["weight_bytes_note"] = _weight_bytes_note(len(result.weight_bytes_per_rank))
    _release(llm)
    return run


def _weight_bytes_note(world_size: int) -> str:
    """What a row's weight_bytes (and its GB/s and % HBM) count."""
    if world_size == 1:
        return "weight_bytes: read by one decode step (every weight once)"
    return (f"weight_bytes: read by one decode step on one of {world_size} tensor-parallel "
            "ranks (its shards, the largest rank's; each GPU streams its own)")


def _throughput_run(run: dict, llm, requests, baseline: Baseline, hf_batch_size, err) -> None:
    from llmfast.bench import run_throughput

    with count_progress("throughput (llmfast)", err) as progress:
        run["throughput"] = dataclasses.asdict(run_throughput(llm.engine, requests, progress))
    if baseline is Baseline.hf:
        from llmfast.bench.hf import (
            hf_batch_candidates,
            load_hf_model,
            run_hf_baseline,
            tune_hf_batch_size,
        )

        with count_progress("loading HF model", err):
            model = load_hf_model(llm.engine)
        if hf_batch_size is None and llm.engine.config.device.startswith("cuda"):
            with count_progress("HF generate: probing batch sizes", err) as progress:
                hf_batch_size, probes = tune_hf_batch_size(
                    model, requests, hf_batch_candidates(len(requests)), progress=progress)
            run["hf_batch_probes"] = {str(k): v for k, v in probes.items()}
        run["hf_batch_size"] = hf_batch_size or len(requests)
        with count_progress("throughput (HF generate)", err) as progress:
            hf = run_hf_baseline(model, requests, hf_batch_size, progress=progress)
        run["baseline_hf"] = dataclasses.asdict(hf)
        run["speedup_vs_hf"] = run["throughput"]["output_tokens_per_s"] / hf.output_tokens_per_s
        run["total_speedup_vs_hf"] = (run["throughput"]["total_tokens_per_s"]
                                      / hf.total_tokens_per_s)


def _release(llm) -> None:
    import torch

    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_report(config: dict, runs: dict, startup: dict | None = None) -> dict:
    """The JSON document: config, environment, one entry per run and, with --startup,
    `startup` = {model, engine_args, cache_root, cold: {...}, warm: {...}}."""
    from llmfast.bench import environment_info

    if runs:
        device = next(iter(runs.values()))["engine_config"]["device"]
    else:
        assert startup is not None
        device = startup["cold"]["device"]
    report = {
        "llmfast_bench_version": 1,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": config,
        "environment": environment_info(device),
        "runs": runs,
    }
    if startup is not None:
        report["startup"] = startup
    return report


def _finite(value: Any) -> Any:
    """Strict JSON has no Infinity/NaN: write them as strings ("inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# ---------------------------------------------------------------------- tables


def table_console() -> Console:
    """stdout; wide when it is a file or pipe, so no table cell is cut to fit 80 columns."""
    con = Console(highlight=False)
    return con if con.is_terminal else Console(highlight=False, width=200)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.2f}"


def sweep_table(runs: dict) -> Table:
    """One row per batch size; per execution mode: step latency p50/p90/p99 (ms), decode
    tokens/s, prefill tokens/s and, on CUDA, the weight-streaming rate and its share of
    the HBM bandwidth. Only pure-decode rows exist; a skipped size shows its reason below."""
    first = next(iter(runs.values()))
    config = first["engine_config"]["scheduler"]
    table = Table(title=f"decode sweep: {first['model']}, context {_sweep_context(runs)}, "
                        f"budget {config['max_num_batched_tokens']} tokens / "
                        f"{config['max_num_seqs']} seqs")
    table.add_column("batch", justify="right")
    with_hbm = any(r.get("bandwidth") for r in runs.values())
    headers = ["step ms p50", "p90", "p99", "decode tok/s", "prefill tok/s"]
    ranks = max(len(r.get("weight_bytes_per_rank") or [0]) for r in runs.values())
    if with_hbm:
        headers += ["weights GB/s" + (" per GPU" if ranks > 1 else ""), "% HBM"]
    for name in runs:
        label = "" if name == "default" else f"{name}\n"
        for header in headers:
            table.add_column(label + header, justify="right", overflow="fold")
    sizes = sorted({p["batch_size"] for r in runs.values() for p in r["sweep"]})
    for size in sizes:
        row = [str(size)]
        for run in runs.values():
            p = next((p for p in run["sweep"] if p["batch_size"] == size), None)
            if p is None:
                row += ["skipped"] + ["-"] * (len(headers) - 1)
                continue
            lat = p["step_latency"]
            row += [_ms(lat["median"]), _ms(lat["p90"]), _ms(lat["p99"]),
                    f"{p['decode_tokens_per_s']:.1f}", f"{p['prefill_tokens_per_s']:.0f}"]
            if with_hbm:
                fraction = p.get("hbm_fraction")
                row += [f"{p['weight_stream_bytes_per_s'] / 1e9:.0f}",
                        "-" if fraction is None else f"{100 * fraction:.0f}%"]
        table.add_row(*row)
    notes = []
    for name, run in runs.items():
        bw = run.get("bandwidth")
        if bw:
            limit = bw["peak_bytes_per_s"] or bw["measured_copy_bytes_per_s"]
            if limit:
                whose = "weight bytes per step" if ranks == 1 else \
                    f"one rank's weight bytes per step (its shards of {ranks})"
                notes.append(f"% HBM: {whose} / median step time vs {bw['name']} "
                             f"{limit / 1e12:.2f} TB/s ({bw['source']})")
        for skip in run.get("sweep_skipped", []):
            where = "" if name == "default" else f"{name}: "
            notes.append(f"{where}batch {skip['batch_size']} skipped: {skip['reason']}")
    if notes:
        table.caption = "\n".join(dict.fromkeys(notes))
    return table


def _sweep_context(runs: dict) -> str:
    for run in runs.values():
        if run["sweep"]:
            return f"{run['sweep'][0]['context_len']}, {run['sweep'][0]['steps']} steps"
    return "-"


def throughput_table(run: dict) -> Table:
    """llmfast and (with --baseline hf) HF generate side by side: output and total
    (input + output) tokens/s, and their ratios."""
    table = Table(title=f"throughput: {run['model']}")
    for col in ("engine", "requests", "in tokens", "out tokens", "time s", "req/s",
                "out tok/s", "total tok/s"):
        table.add_column(col, justify="right" if col != "engine" else "left")
    rows = [("llmfast", run["throughput"])]
    if "baseline_hf" in run:
        rows.append((f"HF generate (batch {run.get('hf_batch_size', '?')})", run["baseline_hf"]))
    for name, r in rows:
        table.add_row(name, str(r["num_requests"]), str(r["input_tokens"]),
                      str(r["output_tokens"]), f"{r['elapsed_s']:.2f}",
                      f"{r['requests_per_s']:.2f}", f"{r['output_tokens_per_s']:.1f}",
                      f"{r['total_tokens_per_s']:.1f}")
    if "speedup_vs_hf" in run:
        ratios = (f"llmfast / HF: output tokens/s {run['speedup_vs_hf']:.2f}x, total "
                  f"tokens/s {run.get('total_speedup_vs_hf', float('nan')):.2f}x")
        lines = [ratios]
        probes = run.get("hf_batch_probes")
        if probes:
            tried = ", ".join(f"{k}: {'OOM' if v is None else f'{v:.0f}'}"
                              for k, v in probes.items())
            lines.append(f"HF batch {run['hf_batch_size']} is the fastest probed "
                         f"(output tok/s by batch: {tried})")
        table.caption = "\n".join(lines)
    return table


def latency_table(result: dict) -> Table:
    rate = result["request_rate"]
    table = Table(title=f"latency: {result['num_requests']} requests at "
                        f"{'all at once' if math.isinf(rate) else f'{rate:g} req/s'}")
    for col in ("metric (ms)", "mean", "median", "p90", "p99"):
        table.add_column(col, justify="right" if col != "metric (ms)" else "left")
    for key, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        s = result[key]
        if s is None:
            table.add_row(label, "-", "-", "-", "-")
        else:
            table.add_row(label, _ms(s["mean"]), _ms(s["median"]), _ms(s["p90"]), _ms(s["p99"]))
    table.caption = (f"{result['requests_per_s']:.2f} req/s, "
                     f"{result['output_tokens_per_s']:.1f} output tok/s "
                     f"over {result['duration_s']:.2f} s")
    return table


STARTUP_ROWS = (("join_group", "join the rank group (workers)"), ("load", "load weights"),
                ("profile", "profile memory"), ("compile", "compile"),
                ("capture", "capture CUDA graphs"), ("kv_cache", "allocate KV cache"))


def startup_table(report: dict) -> Table:
    """Cold and warm start side by side (seconds), from `bench.startup`'s report."""
    cold, warm = report["cold"], report["warm"]
    table = Table(title=f"start-up: {report['model']} (cold: empty caches; warm: the "
                        "same command again)")
    for col in ("stage", "cold s", "warm s", "warm / cold"):
        table.add_column(col, justify="left" if col == "stage" else "right")

    def row(label: str, a: float | None, b: float | None, **kw: Any) -> None:
        ratio = f"{b / a:.2f}" if a and b is not None else "-"
        table.add_row(label, _secs(a), _secs(b), ratio, **kw)

    row("python + imports", cold["import_s"], warm["import_s"])
    for key, label in STARTUP_ROWS:
        if key in cold["stages"] or key in warm["stages"]:
            row(label, cold["stages"].get(key), warm["stages"].get(key))
    workers = "join_group" in cold["stages"]  # rank 0's stages; the ranks start in parallel
    row("other (config, buffers, gc" + ("; the workers' start)" if workers else ")"),
        cold["engine_s"] - sum(cold["stages"].values()),
        warm["engine_s"] - sum(warm["stages"].values()))
    row("engine (all of LLM(...))", cold["engine_s"], warm["engine_s"])
    row("first token (one step)", cold["first_step_s"], warm["first_step_s"])
    row("time to first token", cold["time_to_first_token_s"], warm["time_to_first_token_s"],
        style="bold")
    table.caption = (f"compile cache hits/misses: cold {cold['compile_cache_hits']}/"
                     f"{cold['compile_cache_misses']}, warm {warm['compile_cache_hits']}/"
                     f"{warm['compile_cache_misses']}; device {cold['device']}"
                     + "".join(f"\n{name}: {run['compile_summary']}"
                               for name, run in (("cold", cold), ("warm", warm))
                               if run.get("compile_summary")))
    return table


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
