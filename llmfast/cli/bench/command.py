"""`llmfast bench`: runs the runners of `llmfast.bench` and formats their results
(Rich tables, `--json`, `--plot`). No measuring happens here."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import gc
import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from llmfast.bench import BenchError
from llmfast.cli.bench.checks import (
    check_counts,
    check_mode_options,
    check_output_paths,
    save_elsewhere,
)
from llmfast.cli.bench.tables import (
    latency_table,
    startup_table,
    sweep_table,
    table_console,
    throughput_table,
)
from llmfast.cli.common import (
    EngineOptions,
    JsonPath,
    count_progress,
    load_llm,
    stderr_console,
    sweep_overrides,
)
from llmfast.utils.errors import one_line
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
# The modes without graphs drop a --cuda-graph-mode meant for the graphs mode.
EXEC_MODES: dict[str, dict[str, Any]] = {
    "eager": {"enforce_eager": True, "cuda_graph_mode": None},
    "compiled": {"enforce_eager": False, "compile": True, "cuda_graphs": False,
                 "cuda_graph_mode": None},
    "graphs": {"enforce_eager": False, "compile": True, "cuda_graphs": True},
}


def bench(
    *,
    ctx: typer.Context,
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
    json_out: JsonPath = None,
    plot_path: Annotated[Path | None, typer.Option("--plot", help="Write a plot (.png, .svg or .pdf).")] = None,
) -> None:
    """Benchmark decode latency, throughput, request latency or start-up."""
    json_path = None if json_out in (None, "-") else Path(json_out)
    if mode is None and not startup:
        mode = BenchMode.sweep
    check_mode_options(mode.value if mode else None, _given_options(ctx))
    check_output_paths(json_path, plot_path)
    check_counts({"--context": context, "--steps": steps, "--num-prompts": num_prompts,
                  "--input-len": input_len, "--output-len": output_len})
    if not 0.0 <= random_range_ratio < 1.0:  # else found only once the model is loaded
        raise BenchError(f"--random-range-ratio must be in [0, 1), got {random_range_ratio}")
    if mode is BenchMode.latency:
        from llmfast.bench import check_request_rate

        check_request_rate(request_rate, num_prompts)
    if hf_batch_size is not None and hf_batch_size < 1:
        raise BenchError("--hf-batch-size must be >= 1")
    seed = opts.engine_kwargs.get("seed", 0)
    config: dict[str, Any] = {"mode": mode.value if mode else "startup",
                              "model": opts.model or "default",
                              "engine_args": opts.engine_kwargs, "seed": seed}
    if mode is BenchMode.sweep:  # read before --startup runs: a bad list fails at once
        size_list = parse_sizes(sizes)
        exec_modes = parse_exec_modes(modes, opts)
        overrides = sweep_overrides(size_list, opts)
        config |= {"sizes": size_list, "context": context, "steps": steps,
                   "exec_modes": exec_modes}
    err = stderr_console()
    con = err if json_out == "-" else table_console()  # stdout holds the JSON alone
    startup_report = None
    runs: dict[str, dict] = {}
    try:
        if startup:
            from llmfast.bench.startup.runs import run_startup

            with count_progress("start-up: cold, then warm (two fresh processes)", err):
                startup_report = dataclasses.asdict(run_startup(opts.model, opts.engine_kwargs))
            con.print(startup_table(startup_report))
        if mode is BenchMode.sweep:
            for name in exec_modes:
                runs[name] = _sweep_run(opts, name, overrides, size_list, context, steps, seed,
                                        err)
            con.print(sweep_table(runs))
        elif mode is not None:
            from llmfast.bench import random_requests

            config |= {"num_prompts": num_prompts, "input_len": input_len,
                       "output_len": output_len, "random_range_ratio": random_range_ratio}
            run, llm = _start(opts, "default", {}, err)
            runs = {"default": run}  # kept with what it holds if a later part fails
            requests = random_requests(num_prompts, input_len, output_len,
                                       llm.engine.config.model.vocab_size, random_range_ratio,
                                       seed)
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
    except BaseException as e:  # Ctrl-C too: the runs that finished are kept
        _keep_partial(config, runs, startup_report, json_path, e, con, err)
        raise
    report = bench_report(config, runs, startup_report)
    if json_out == "-":
        print(report_json(report), end="")
    write_outputs(report, json_path, plot_path, err)


def _given_options(ctx: typer.Context | None) -> set[str]:
    """The command's options set on the command line (or from the environment)."""
    if ctx is None:
        return set()
    given = set()
    for name in ctx.params:
        source = ctx.get_parameter_source(name)
        if source is not None and source.name in ("COMMANDLINE", "ENVIRONMENT"):
            given.add(name)
    return given


def report_json(report: dict) -> str:
    return json.dumps(_finite(report), indent=2, allow_nan=False, default=str) + "\n"


def write_outputs(report: dict, json_path: Path | None, plot_path: Path | None,
                  err: Console) -> None:
    """--json, then --plot. A file that cannot be written after all (the disk filled,
    the directory went away during the run) does not lose the report: it is saved in the
    temp directory and named in the error, and the other output is still written."""
    failures = []
    if json_path is not None:
        text = report_json(report)
        try:
            json_path.write_text(text)
            err.print(f"wrote {json_path}", style="dim")
        except OSError as e:
            saved = save_elsewhere(text, json_path.name)
            failures.append(f"cannot write --json {json_path}: {e.strerror or e}; " + (
                f"the report is saved in {saved}" if saved else "the tables above hold it"))
    if plot_path is not None:
        from llmfast.cli.bench.plot import plot_report

        try:
            plot_report(report, plot_path)
            err.print(f"wrote {plot_path}", style="dim")
        except OSError as e:
            failures.append(f"cannot write --plot {plot_path}: {e.strerror or e}")
    if failures:
        raise BenchError("; ".join(failures))


def _keep_partial(config: dict, runs: dict, startup_report: dict | None,
                  json_path: Path | None, failure: BaseException, con: Console,
                  err: Console) -> None:
    """After a failure mid-benchmark: the tables of finished runs not printed yet and,
    with --json, the report so far, marked incomplete. Never raises: the failure itself
    is what the user must see."""
    done = {name: run for name, run in runs.items() if "sweep" in run or "throughput" in run}
    if not done and startup_report is None:
        return
    try:
        if config["mode"] == "sweep" and done:
            con.print(sweep_table(done))
        elif "throughput" in done.get("default", {}) and "baseline_hf" not in done["default"]:
            con.print(throughput_table(done["default"]))  # the HF baseline failed
        err.print("the benchmark failed; the results above were measured before it",
                  style="yellow")
        if json_path is not None:
            report = bench_report(config, done, startup_report)
            report["incomplete"] = f"{type(failure).__name__}: {one_line(failure)}"
            write_outputs(report, json_path, None, err)
    except Exception as e:  # noqa: BLE001 - the first failure stays the one reported
        err.print(f"could not keep the partial results: {one_line(e)}", style="yellow")


# ---------------------------------------------------------------------- checks


def parse_exec_modes(spec: str | None, opts: EngineOptions) -> list[str]:
    if spec is None:
        return ["default"]
    names = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in names if m not in EXEC_MODES]
    if unknown or not names:
        raise BenchError(f"unknown mode(s) {', '.join(unknown) or repr(spec)} in --modes; "
                         f"choose from {', '.join(EXEC_MODES)}")
    # Each mode sets whether its run compiles and replays graphs: a flag that says so too
    # would be overridden by some mode without a word (and recorded in the JSON as if it
    # had held). --cuda-graph-mode is not one: it picks the graphs mode's kind of graph.
    given = [flag for flag, name, unset in (("--enforce-eager", "enforce_eager", False),
                                            ("--compile/--no-compile", "compile", None),
                                            ("--no-cuda-graphs", "cuda_graphs", True))
             if opts.engine_kwargs.get(name, unset) != unset]
    if given:
        raise BenchError(f"--modes sets how each run executes; drop {given[0]}")
    if "graphs" in names:
        from llmfast.engine.args import resolve_device

        if resolve_device(opts.engine_kwargs.get("device", "auto")).type != "cuda":
            raise BenchError("mode graphs needs a CUDA device (CUDA graphs do not exist on CPU)")
    return list(dict.fromkeys(names))


# ---------------------------------------------------------------------- runs


def _start(opts: EngineOptions, name: str, overrides: dict[str, Any], err: Console):
    from llmfast.bench import rank_device_facts

    llm = load_llm(opts, err, **overrides)
    engine = llm.engine
    run = {"exec_mode": name, "model": engine.source.name,
           "engine_config": dataclasses.asdict(engine.config),
           # GPU name and memory as rank 0 measured them, wherever it runs.
           "device_facts": rank_device_facts(engine.runner_info),
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
    from llmfast.bench import local_device_facts, run_throughput

    with count_progress("throughput (llmfast)", err) as progress:
        run["throughput"] = dataclasses.asdict(run_throughput(llm.engine, requests, progress))
    if baseline is Baseline.hf:
        # In the log before the baseline runs: a failure in HF's part keeps this figure.
        err.print(f"llmfast: {run['throughput']['output_tokens_per_s']:.1f} output tok/s, "
                  f"{run['throughput']['total_tokens_per_s']:.1f} total tok/s", style="dim")
        from llmfast.bench.hf import (
            hf_batch_candidates,
            load_hf_model,
            run_hf_baseline,
            tune_hf_batch_size,
        )

        with count_progress("loading HF model", err):
            model = load_hf_model(llm.engine)
        # HF generate runs here, not where the engine's ranks run: this process's device.
        run["baseline_hf_device_facts"] = local_device_facts(str(model.device))
        hf = None
        if hf_batch_size is None and llm.engine.config.device.startswith("cuda"):
            with count_progress("HF generate: probing batch sizes", err) as progress:
                hf_batch_size, probes, hf = tune_hf_batch_size(
                    model, requests, hf_batch_candidates(len(requests)), progress=progress)
            run["hf_batch_probes"] = {str(k): v for k, v in probes.items()}
        run["hf_batch_size"] = hf_batch_size or len(requests)
        if hf is None:  # else the fastest probe ran every request: that is the run
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
    `startup` = {model, engine_args, cache_root, cold: {...}, warm: {...}}. The
    environment's device facts are rank 0's of the first run (or of the cold start-up)."""
    from llmfast.bench import environment_info

    if runs:
        device_facts = next(iter(runs.values()))["device_facts"]
    else:
        assert startup is not None
        device_facts = startup["cold"]["device_facts"]
    report = {
        "llmfast_bench_version": 1,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": config,
        "environment": environment_info(device_facts),
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
