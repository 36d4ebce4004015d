"""Load-test a running `llmfast serve` (or any OpenAI-compatible server).

    llmfast serve --model random:smollm2-135m &          # or any model
    python scripts/bench_serve.py --url http://127.0.0.1:8000 \
        --num-prompts 64 --input-len 128 --output-len 64 --request-rate 1,2,4,inf

    # or, in one run: start the server here, and first run the same workload on the
    # engine in-process (no HTTP) for the side-by-side baseline:
    python scripts/bench_serve.py --launch default --engine-baseline --request-rate 2,inf

    # serve against offline `LLM.generate` on the same prompts (the serving bars):
    python scripts/bench_serve.py --cpu-bar --json profiles/serving/serving-cpu.json
    python scripts/bench_serve.py --gpu-bar --json profiles/serving/serving-gpu.json

Streaming /v1/completions requests with random token-id prompts (seeded), Poisson
arrivals at each rate (inf: all at once), at most --max-concurrency in flight. Prints,
per rate, throughput and TTFT / TPOT / ITL / e2e (mean, median, p90, p99, max) in ms,
then one summary table; --json writes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(1, str(REPO / "scripts"))

from llmfast.bench.environment import environment_info, local_device_facts
from llmfast.bench.serving import format_result, run_serve_bench
from llmfast.bench.workload import random_requests
from llmfast.engine.args import resolve_device
from llmfast.utils.ports import free_port

import bench_serve_offline as vs_offline  # noqa: E402 - scripts/ beside this file


def _rates(text: str) -> list[float]:
    try:
        return [math.inf if r.strip() == "inf" else float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read rates {text!r}; e.g. 1,2,4,inf") from None


def _counts(text: str) -> list[int]:
    try:
        return [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read counts {text!r}; e.g. 0,1,2") from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="lengths uniform in len*(1-r)..len*(1+r)")
    ap.add_argument("--vocab-size", type=int, default=1000,
                    help="prompt token ids are drawn from [0, this)")
    ap.add_argument("--request-rate", type=_rates, default=[math.inf],
                    help="requests/s, comma-separated list; inf = all at once")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write all results here")
    ap.add_argument("--launch", metavar="MODEL", default=None,
                    help="start `llmfast serve --model MODEL` on a free port for the run")
    ap.add_argument("--serve-args", default="",
                    help="more engine flags for --launch and --engine-baseline, e.g. "
                         "'--max-num-seqs 64 --kv-cache-memory 1GiB'")
    ap.add_argument("--api-servers", type=_counts, default=None,
                    help="with --launch: one server per value of its --api-servers (e.g. "
                         "0,1,2: HTTP in the engine's process, then in 1 and 2 processes of "
                         "their own), each under the same load, side by side")
    ap.add_argument("--engine-baseline", action="store_true",
                    help="with --launch: first run the same workload on the engine "
                         "in-process (llmfast.bench.latency), for comparison")
    vs_offline.add_arguments(ap)
    args = ap.parse_args()
    if vs_offline.wanted(args):
        return vs_offline.run(ap, args)

    requests = random_requests(args.num_prompts, args.input_len, args.output_len,
                               args.vocab_size, args.range_ratio, args.seed)
    rows: list[tuple[str, object]] = []
    if args.engine_baseline:
        if not args.launch:
            ap.error("--engine-baseline needs --launch MODEL")
        rows += engine_baseline(args.launch, shlex.split(args.serve_args), requests,
                                args.request_rate, args.seed)
    if args.api_servers is not None and not args.launch:
        ap.error("--api-servers needs --launch MODEL")
    for api_servers in args.api_servers or [None]:
        flags = shlex.split(args.serve_args)
        what = "server (HTTP)"
        if api_servers is not None:
            flags += ["--api-servers", str(api_servers)]
            what = f"server, --api-servers {api_servers}"
        server = launch(args.launch, flags) if args.launch else None
        url = server[1] if server else args.url
        try:
            for rate in args.request_rate:
                result = asyncio.run(run_serve_bench(url, requests, rate, args.max_concurrency,
                                                     args.model, args.api_key, args.seed))
                print(f"## {what}, rate {rate:g}/s\n\n{format_result(result)}\n", flush=True)
                rows.append((what, result))
        finally:
            if server:
                server[0].send_signal(signal.SIGTERM)
                server[0].wait(timeout=60)
    print_summary(rows)
    if args.json:
        args.json.write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "machine": platform.platform(),
            # This (the client's) machine: the server's too with --launch, as on the GPU
            # machine's check; a remote --url server's device is not known here.
            "environment": environment_info(local_device_facts(
                str(resolve_device("auto")))),
            "argv": sys.argv, "results": [
                {"what": what, **{k: (v if not (isinstance(v, float) and math.isinf(v))
                                      else "inf") for k, v in dataclasses.asdict(r).items()
                                  if k != "per_request"}} for what, r in rows]}, indent=2))
    return 1 if any(getattr(r, "failed", 0) for _, r in rows) else 0


def print_summary(rows) -> None:
    print("| run | rate req/s | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
          "| ITL p50 ms | ITL p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")

    def ms(s, attr):
        return f"{getattr(s, attr) * 1e3:.1f}" if s is not None else "-"

    for what, r in rows:
        print(f"| {what} | {r.request_rate:g} | {r.requests_per_s:.2f} | "
              f"{r.output_tokens_per_s:.1f} | {ms(r.ttft, 'median')} | {ms(r.ttft, 'p99')} | "
              f"{ms(r.tpot, 'median')} | {ms(r.itl, 'median')} | {ms(r.itl, 'p99')} |")


def engine_baseline(model: str, flags: list[str], requests, rates, seed: int):
    """The same requests on the engine in this process (no HTTP, no event loop)."""
    from llmfast.bench.latency import run_latency
    from llmfast.engine.flags import engine_kwargs_from_argv
    from llmfast.llm import LLM

    kwargs = engine_kwargs_from_argv(flags)
    kwargs.pop("model", None)
    engine = LLM(None if model == "default" else model, **kwargs).engine
    rows = []
    # In a worker thread, as the server steps it: the comparison then isolates what HTTP,
    # JSON and the event loop cost. (On a CPU oversubscribed by other processes, torch's
    # intra-op team in the main thread was many times slower than in a worker thread:
    # measured on the 2-core dev machine under load 8.)
    with ThreadPoolExecutor(max_workers=1) as worker:
        for rate in rates:
            result = worker.submit(run_latency, engine, requests, rate, seed).result()
            print(f"## engine in-process, rate {rate:g}/s: {result.output_tokens_per_s:.1f} "
                  f"output tok/s", flush=True)
            rows.append(("engine (in-process)", result))
    del engine
    gc.collect()
    return rows


def launch(model: str, flags: list[str], quiet: bool = False):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "llmfast", "serve", "--model", model,
                             "--port", str(port), *flags], env=env,
                            stderr=subprocess.DEVNULL if quiet else None)
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"llmfast serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("llmfast serve did not become healthy in 300 s")


if __name__ == "__main__":
    sys.exit(main())
