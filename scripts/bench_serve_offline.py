"""`llmfast serve` against offline `LLM.generate` on the same prompts, in one run: the
serving bars of the engine-core split (serve/offline output tok/s, TTFT and TPOT).

    python scripts/bench_serve.py --cpu-bar --json profiles/serving/serving-cpu.json
    python scripts/bench_serve.py --gpu-bar --json profiles/serving/serving-gpu.json
    python scripts/bench_serve.py --vs-offline --launch random:tiny --streams 64,256 ...

Each repeat runs the offline engine in a child process of its own (every stream count,
then it exits, freeing its memory: on a GPU the server needs it), then starts the server
(once per --api-servers value) and sends each stream count as that many streaming
/v1/completions requests at once (greedy, ignore_eos, fixed lengths). Repeats interleave
offline and serve, so a machine whose load drifts shifts both; the table gives medians
over the repeats. The offline TPOT p50 is the engine's decode step at that batch (every
request decodes in every step), the figure the GPU bar compares the server's TPOT with.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The bars of issue "[serve-core]": serve/offline output tok/s at least this, per streams.
CPU_BAR = {"model": "random:tiny", "input_len": 32, "output_len": 96, "streams": [64, 256],
           "vocab_size": 500, "serve_args": "--device cpu --max-num-seqs 256",
           "bars": {64: 0.6, 256: 0.5}}
GPU_BAR = {"model": "random:llama-3.2-1b", "input_len": 256, "output_len": 128,
           "streams": [256], "vocab_size": 1000,
           "serve_args": "--dtype bfloat16 --max-num-seqs 256", "bars": {256: 0.85}}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("serve against offline LLM.generate")
    g.add_argument("--vs-offline", action="store_true",
                   help="with --launch MODEL: offline LLM.generate and the server on the "
                        "same prompts, --streams at once each, --repeat times")
    g.add_argument("--cpu-bar", action="store_true",
                   help=f"--vs-offline with the CPU bar's workload: {CPU_BAR}")
    g.add_argument("--gpu-bar", action="store_true",
                   help=f"--vs-offline with the GPU bar's workload: {GPU_BAR}")
    g.add_argument("--streams", default=None, help="stream counts, e.g. 64,256")
    g.add_argument("--repeat", type=int, default=3)
    g.add_argument("--offline-child", default=None, help=argparse.SUPPRESS)


def wanted(args) -> bool:
    return bool(args.vs_offline or args.cpu_bar or args.gpu_bar or args.offline_child)


def run(ap: argparse.ArgumentParser, args) -> int:
    if args.offline_child:
        return _offline_child(json.loads(args.offline_child))
    preset = CPU_BAR if args.cpu_bar else GPU_BAR if args.gpu_bar else None
    explicit = set(sys.argv)
    spec = {
        "model": args.launch or (preset or {}).get("model"),
        "input_len": args.input_len if "--input-len" in explicit or not preset
        else preset["input_len"],
        "output_len": args.output_len if "--output-len" in explicit or not preset
        else preset["output_len"],
        "vocab_size": args.vocab_size if "--vocab-size" in explicit or not preset
        else preset["vocab_size"],
        "serve_args": args.serve_args if "--serve-args" in explicit or not preset
        else preset["serve_args"],
        "streams": [int(n) for n in args.streams.split(",")] if args.streams
        else (preset or {}).get("streams", [args.num_prompts]),
        "seed": args.seed,
    }
    if not spec["model"]:
        ap.error("--vs-offline needs --launch MODEL")
    bars = (preset or {}).get("bars", {})
    api_servers = args.api_servers or [None]
    rows: list[dict] = []
    for rep in range(args.repeat):
        for row in _offline(spec):
            rows.append({"what": "offline", "repeat": rep, **row})
            _say(rows[-1])
        for n_api in api_servers:
            rows += _serve(spec, n_api, rep)
    table = _table(rows, spec["streams"], api_servers, bars)
    print(table, flush=True)
    if args.json:
        from llmfast.bench.environment import environment_info, local_device_facts
        from llmfast.engine.args import resolve_device

        args.json.write_text(json.dumps({
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "argv": sys.argv, "workload": spec, "bars": bars,
            "tree": _git_head(), "load_average_at_end": os.getloadavg(),
            "environment": environment_info(local_device_facts(str(resolve_device("auto")))),
            "table": table, "runs": rows}, indent=2) + "\n")
    return 0 if all(r.get("failed", 0) == 0 for r in rows) else 1


def _say(row: dict) -> None:
    print(f"[{row['what']} repeat {row['repeat']}] {row['streams']} streams: "
          f"{row['out_tok_s']:.0f} out tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
          f"TPOT p50 {row['tpot_p50_ms']:.2f} ms", flush=True)


def _requests(spec: dict, streams: int):
    from llmfast.bench.workload import random_requests

    return random_requests(streams, spec["input_len"], spec["output_len"],
                           spec["vocab_size"], 0.0, spec["seed"])


def _offline(spec: dict) -> list[dict]:
    """Every stream count's offline figures, from a child process of its own."""
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "bench_serve.py"),
                           "--offline-child", json.dumps(spec)],
                          env=_env(), stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _offline_child(spec: dict) -> int:
    from llmfast.bench.stats import summarize
    from llmfast.engine.flags import engine_kwargs_from_argv
    from llmfast.llm import LLM
    from llmfast.sampling_params import SamplingParams

    kwargs = engine_kwargs_from_argv(shlex.split(spec["serve_args"]))
    model = spec["model"]
    llm = LLM(None if model == "default" else model, **kwargs)

    def generate(requests):
        params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
                  for r in requests]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                            params)
        return outs, time.perf_counter() - start

    rows = []
    # In a worker thread, as the server's engine steps (torch's main-thread team was many
    # times slower on an oversubscribed VM: profiles/serve-cpu.md).
    with ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(generate, _requests(spec, 4)).result()  # warm-up
        for streams in spec["streams"]:
            outs, wall = worker.submit(generate, _requests(spec, streams)).result()
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            ttft = summarize([o.metrics.ttft for o in outs])
            tpot = summarize([o.metrics.tpot for o in outs if o.metrics.tpot is not None])
            rows.append({"streams": streams, "duration_s": wall, "out_tok_s": tokens / wall,
                         "ttft_p50_ms": ttft.median * 1e3, "ttft_p99_ms": ttft.p99 * 1e3,
                         "tpot_p50_ms": tpot.median * 1e3, "tpot_p99_ms": tpot.p99 * 1e3})
    print(json.dumps(rows))
    return 0


def _serve(spec: dict, api_servers: int | None, rep: int) -> list[dict]:
    from bench_serve import launch

    from llmfast.bench.serving import run_serve_bench

    flags = shlex.split(spec["serve_args"])
    what = "serve"
    if api_servers is not None:
        flags += ["--api-servers", str(api_servers)]
        what = f"serve --api-servers {api_servers}"
    proc, url = launch(spec["model"], flags, quiet=True)
    rows = []
    try:
        for streams in spec["streams"]:
            r = asyncio.run(run_serve_bench(url, _requests(spec, streams), math.inf,
                                            seed=spec["seed"]))
            rows.append({"what": what, "repeat": rep, "streams": streams,
                         "duration_s": r.duration_s, "out_tok_s": r.output_tokens_per_s,
                         "failed": r.failed, "errors": r.errors,
                         "ttft_p50_ms": r.ttft.median * 1e3, "ttft_p99_ms": r.ttft.p99 * 1e3,
                         "tpot_p50_ms": r.tpot.median * 1e3, "tpot_p99_ms": r.tpot.p99 * 1e3,
                         "itl_p50_ms": r.itl.median * 1e3, "itl_p99_ms": r.itl.p99 * 1e3})
            _say(rows[-1])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return rows


def _table(rows: list[dict], streams: list[int], api_servers: list, bars: dict) -> str:
    """Medians over the repeats; serve/offline is the median of each repeat's ratio."""
    def med(what, n, key):
        vals = [r[key] for r in rows if r["what"] == what and r["streams"] == n]
        return statistics.median(vals) if vals else math.nan

    lines = ["| run | streams | out tok/s | serve/offline | bar | TTFT p50 ms | TTFT p99 ms "
             "| TPOT p50 ms | TPOT p99 ms |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    whats = ["offline"] + ["serve" if a is None else f"serve --api-servers {a}"
                           for a in api_servers]
    for n in streams:
        offline = {r["repeat"]: r["out_tok_s"] for r in rows
                   if r["what"] == "offline" and r["streams"] == n}
        for what in whats:
            ratio, bar = "", ""
            if what != "offline":
                ratios = [r["out_tok_s"] / offline[r["repeat"]] for r in rows
                          if r["what"] == what and r["streams"] == n and r["repeat"] in offline]
                ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
                if n in bars and ratios:
                    bar = f"{bars[n]} {'ok' if statistics.median(ratios) >= bars[n] else 'MISSED'}"
            lines.append(f"| {what} | {n} | {med(what, n, 'out_tok_s'):.0f} | {ratio} | {bar} | "
                         f"{med(what, n, 'ttft_p50_ms'):.0f} | {med(what, n, 'ttft_p99_ms'):.0f} | "
                         f"{med(what, n, 'tpot_p50_ms'):.2f} | {med(what, n, 'tpot_p99_ms'):.2f} |")
    return "\n".join(lines)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _git_head() -> str | None:
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], text=True,
                              capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "llmfast"],
                               text=True, capture_output=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


