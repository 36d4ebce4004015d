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

    python scripts/bench_serve.py --vs-offline --launch random:tiny --streams 64,256 ...

Streaming /v1/completions requests with random token-id prompts (seeded), Poisson
arrivals at each rate (inf: all at once), at most --max-concurrency in flight. Prints,
per rate, throughput and TTFT / TPOT / ITL / e2e (mean, median, p90, p99, max) in ms,
then one summary table; --json writes every figure.

Serve against offline (--vs-offline, --cpu-bar, --gpu-bar: the serving bars of the
engine-core split, serve/offline output tok/s, TTFT and TPOT): each repeat runs the
offline engine in a child process of its own (every stream count, then it exits, freeing
its memory: on a GPU the server needs it), then starts the server (once per
--api-servers value) and sends each stream count as that many streaming /v1/completions
requests at once (greedy, ignore_eos, fixed lengths). Repeats interleave offline and
serve, so a machine whose load drifts shifts both; the table gives medians over the
repeats (llmfast/bench/serving/vs_offline.py).
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

from llmfast.bench.environment import environment_info, local_device_facts
from llmfast.bench.serving.vs_offline import offline_rows, spec_requests, vs_offline_table
from llmfast.bench.serving.load_generator import format_result, run_serve_bench
from llmfast.bench.workload import random_requests
from llmfast.engine.args import resolve_device
from llmfast.utils.ports import free_port

# The bars of issue "[serve-core]": serve/offline output tok/s at least this, per streams.
CPU_BAR = {"model": "random:tiny", "input_len": 32, "output_len": 96, "streams": [64, 256],
           "vocab_size": 500, "serve_args": "--device cpu --max-num-seqs 256",
           "bars": {64: 0.6, 256: 0.5}}
GPU_BAR = {"model": "random:llama-3.2-1b", "input_len": 256, "output_len": 128,
           "streams": [256], "vocab_size": 1000,
           "serve_args": "--dtype bfloat16 --max-num-seqs 256", "bars": {256: 0.85}}


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
    args = ap.parse_args()
    if args.offline_child:
        return _offline_child(json.loads(args.offline_child))
    if args.vs_offline or args.cpu_bar or args.gpu_bar:
        return vs_offline(ap, args)

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
    proc = subprocess.Popen([sys.executable, "-m", "llmfast", "serve", "--model", model,
                             "--port", str(port), *flags], env=_env(),
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


def vs_offline(ap: argparse.ArgumentParser, args) -> int:
    """--vs-offline, --cpu-bar, --gpu-bar: offline and serve, --repeat times."""
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
    table = vs_offline_table(rows, spec["streams"], api_servers, bars)
    print(table, flush=True)
    if args.json:
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


def _offline(spec: dict) -> list[dict]:
    """Every stream count's offline figures, from a child process of its own."""
    proc = subprocess.run([sys.executable, __file__, "--offline-child", json.dumps(spec)],
                          env=_env(), stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _offline_child(spec: dict) -> int:
    from llmfast.engine.flags import engine_kwargs_from_argv
    from llmfast.llm import LLM

    kwargs = engine_kwargs_from_argv(shlex.split(spec["serve_args"]))
    model = spec["model"]
    llm = LLM(None if model == "default" else model, **kwargs)
    print(json.dumps(offline_rows(llm, spec)))
    return 0


def _serve(spec: dict, api_servers: int | None, rep: int) -> list[dict]:
    flags = shlex.split(spec["serve_args"])
    what = "serve"
    if api_servers is not None:
        flags += ["--api-servers", str(api_servers)]
        what = f"serve --api-servers {api_servers}"
    proc, url = launch(spec["model"], flags, quiet=True)
    rows = []
    try:
        for streams in spec["streams"]:
            r = asyncio.run(run_serve_bench(url, spec_requests(spec, streams), math.inf,
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


if __name__ == "__main__":
    sys.exit(main())
