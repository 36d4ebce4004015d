"""Load-test a running `llmfast serve` (or any OpenAI-compatible server).

    llmfast serve --model random:smollm2-135m &          # or any model
    python scripts/bench_serve.py --url http://127.0.0.1:8000 \
        --num-prompts 64 --input-len 128 --output-len 64 --request-rate 1,2,4,inf

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
import json
import math
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmfast.bench.serving import format_result, run_serve_bench
from llmfast.bench.workload import random_requests


def _rates(text: str) -> list[float]:
    try:
        return [math.inf if r.strip() == "inf" else float(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"cannot read rates {text!r}; e.g. 1,2,4,inf") from None


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
    args = ap.parse_args()

    requests = random_requests(args.num_prompts, args.input_len, args.output_len,
                               args.vocab_size, args.range_ratio, args.seed)
    results = []
    for rate in args.request_rate:
        result = asyncio.run(run_serve_bench(args.url, requests, rate, args.max_concurrency,
                                             args.model, args.api_key, args.seed))
        print(f"## rate {rate:g}/s\n\n{format_result(result)}\n", flush=True)
        results.append(result)
    print("| rate req/s | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms "
          "| ITL p50 ms | ITL p99 ms | failed |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        def ms(s, attr):
            return f"{getattr(s, attr) * 1e3:.1f}" if s is not None else "-"
        print(f"| {r.request_rate:g} | {r.requests_per_s:.2f} | {r.output_tokens_per_s:.1f} | "
              f"{ms(r.ttft, 'median')} | {ms(r.ttft, 'p99')} | {ms(r.tpot, 'median')} | "
              f"{ms(r.itl, 'median')} | {ms(r.itl, 'p99')} | {r.failed} |")
    if args.json:
        args.json.write_text(json.dumps({
            "date": datetime.date.today().isoformat(), "machine": platform.platform(),
            "argv": sys.argv, "results": [
                {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf")
                 for k, v in dataclasses.asdict(r).items()} for r in results]}, indent=2))
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
