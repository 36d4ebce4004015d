"""The Rich tables of `llmfast bench`: the decode sweep, throughput, latency and
start-up reports, built from the JSON-ready dicts the runs produce."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.table import Table


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
        weights = run.get("weight_bytes_per_rank") or []
        if weights:  # on every device: what a quantization saves shows here
            where = "" if name == "default" else f"{name}: "
            quant = run["engine_config"].get("quantization")
            notes.append(f"{where}weights read per decode step: {weights[0] / 1e6:.1f} MB"
                         + (" per rank" if len(weights) > 1 else "")
                         + (f" (--quantization {quant})" if quant else ""))
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
        compiled = [p for p in run["sweep"] if p.get("triton_compiles")]
        if compiled:
            where = "" if name == "default" else f"{name}: "
            sizes = ", ".join(f"{p['batch_size']} ({p['triton_compiles']}, "
                              f"{p['triton_compile_s']:.1f} s)" for p in compiled)
            notes.append(f"{where}Triton kernels compiled at batch {sizes}: start-up "
                         "missed them; their prefill rates time the compiler")
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
    spec = run["throughput"].get("spec_decode")
    if spec:
        note = (f"speculative decoding: acceptance {spec['acceptance_rate']:.1%}, mean "
                f"accepted length {spec['mean_accepted_length']:.2f} tokens per verify step "
                f"({spec['num_verify_steps']} steps)")
        table.caption = f"{table.caption}\n{note}" if table.caption else note
    compiles = run["throughput"].get("triton_compiles") or {}
    if compiles.get("count"):
        kernels = ", ".join(f"{k} x{n}" for k, n in compiles["by_kernel"].items())
        note = (f"llmfast compiled {compiles['count']} Triton kernel variant(s) in the timed "
                f"run ({compiles['seconds']:.1f} s: {kernels}): start-up missed them")
        table.caption = f"{table.caption}\n{note}" if table.caption else note
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
                ("setup", "runner buffers + compiler set-up"),
                ("tokenizer", "load tokenizer"),
                ("tune", "tune prefill tiles (once per GPU)"),
                ("gemv", "time the GEMV against cuBLAS (once per GPU)"),
                ("precompile", "submit Triton compiles (threads)"),
                ("profile", "profile memory"), ("compile", "compile"),
                ("capture", "capture CUDA graphs"), ("kv_cache", "allocate KV cache"),
                ("tokenizer_wait", "wait for the tokenizer (loaded beside the above)"),
                ("scheduler", "scheduler + KV block pool"))


def startup_table(report: dict) -> Table:
    """Cold and warm start side by side (seconds), from `bench.startup.runs`' report."""
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
    row("other (config, gc" + ("; the workers' start)" if workers else ")"),
        cold["engine_s"] - sum(cold["stages"].values()),
        warm["engine_s"] - sum(warm["stages"].values()))
    row("engine (all of LLM(...))", cold["engine_s"], warm["engine_s"])
    row("first token (one step)", cold["first_step_s"], warm["first_step_s"])
    row("time to first token", cold["time_to_first_token_s"], warm["time_to_first_token_s"],
        style="bold")
    table.caption = (_bytecode_note(report.get("bytecode_prime_s"),
                                    report.get("bytecode_primed_modules"))
                     + f"compile cache hits/misses: cold {cold['compile_cache_hits']}/"
                     f"{cold['compile_cache_misses']}, warm {warm['compile_cache_hits']}/"
                     f"{warm['compile_cache_misses']}; device {cold['device']}"
                     + "".join(f"\n{name}: {run['compile_summary']}"
                               for name, run in (("cold", cold), ("warm", warm))
                               if run.get("compile_summary"))
                     + "".join(f"\n{name}: {_variants_note(v)}"
                               for name, run in (("cold", cold), ("warm", warm))
                               if (v := run.get("triton_variants"))))
    return table


def _variants_note(variants: dict) -> str:
    """The caption's line on a start's Triton variants (RunnerInfo.triton_variants)."""
    at_launch = variants["compiled_at_launch"]
    if variants.get("precompile_failed"):
        return (f"Triton variants: compiling them ahead failed (see the log), {at_launch} "
                f"compiled at their launch")
    return (f"Triton variants {variants['precompiled']} compiled in threads ahead, "
            f"{at_launch} at their launch")


def _bytecode_note(prime_s: float | None, modules: int | None) -> str:
    """The caption's line on the bytecode priming before the cold start, if any ran."""
    if prime_s is None:
        return ""
    if modules:
        return (f"python bytecode: none installed, llmfast keeps its own; {modules} modules "
                f"of a start compiled into it before the cold start in {prime_s:.2f} s (a "
                "machine's very first start pays that too)\n")
    return (f"python bytecode: none installed, llmfast keeps its own, which held a start's "
            f"imports already ({prime_s:.2f} s to import them before the cold start)\n")


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
