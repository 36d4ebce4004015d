"""Online latency: Poisson arrivals and vLLM-style TTFT, TPOT, ITL and e2e per request."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from llmfast.bench.stats import Summary, summarize
from llmfast.bench.workload import (
    BenchError,
    BenchRequest,
    bench_params,
    check_fits,
    warm_up,
)
from llmfast.utils.progress import CountProgress


@dataclass
class LatencyResult:
    num_requests: int
    request_rate: float  # requests/s; inf = all at once
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft: Summary  # seconds
    tpot: Summary | None  # None when every request has a single output token
    itl: Summary | None
    e2e: Summary
    per_request: list[dict] = field(default_factory=list)  # raw figures


# The longest a benchmark may wait for its requests to arrive (the expected arrival time
# of the last one): a rate so low that arrivals take longer is a typo, not a benchmark.
MAX_ARRIVAL_SPAN_S = 3600.0


def check_request_rate(rate: float, num_requests: int) -> None:
    """A rate > 0 (or inf) whose arrivals end within MAX_ARRIVAL_SPAN_S on average."""
    if not rate > 0:
        raise BenchError(f"--request-rate must be > 0 (or inf), got {rate}")
    span = num_requests / rate
    if span > MAX_ARRIVAL_SPAN_S:
        raise BenchError(
            f"--request-rate {rate:g} spreads {num_requests} requests over ~{span:.3g} s; "
            f"arrivals may span at most {MAX_ARRIVAL_SPAN_S:.0f} s (raise --request-rate or "
            "lower --num-prompts)")


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets (seconds) of a Poisson process of `rate` requests/s; inf: all at 0."""
    check_request_rate(rate, n)
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


def request_latencies(metrics, arrival: float, output_len: int) -> dict:
    """vLLM-style latencies of one finished request; `arrival` is its scheduled arrival
    (time.monotonic), so time spent waiting for a running step to end counts."""
    ttft = metrics.first_token_time - arrival
    e2e = metrics.finish_time - arrival
    tpot = (e2e - ttft) / (output_len - 1) if output_len > 1 else None
    times = metrics.token_times
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e, "output_len": output_len,
            "itl": [b - a for a, b in itertools.pairwise(times)]}


def run_latency(engine, requests: Sequence[BenchRequest], request_rate: float, seed: int = 0,
                progress: CountProgress | None = None) -> LatencyResult:
    """Requests arrive at Poisson times; the step loop adds each once its time has come."""
    check_fits(requests, engine.config.scheduler.max_model_len)
    check_request_rate(request_rate, len(requests))
    warm_up(engine)
    offsets = poisson_arrivals(len(requests), request_rate, seed)
    start = time.monotonic()
    arrivals = [start + off for off in offsets]
    pending = 0
    ids: dict[str, int] = {}
    per_request: list[dict | None] = [None] * len(requests)
    done = 0
    try:
        while done < len(requests):
            now = time.monotonic()
            while pending < len(requests) and arrivals[pending] <= now:
                r = requests[pending]
                req_id = engine.add_request({"prompt_token_ids": r.prompt_token_ids},
                                            bench_params(r.output_len), request_id=f"lat-{pending}")
                ids[req_id] = pending
                pending += 1
            if not engine.has_unfinished():
                if pending == len(requests):  # every request added and none left running
                    break
                time.sleep(max(0.0, arrivals[pending] - time.monotonic()))
                continue
            for out in engine.step():
                if out.finished:
                    i = ids[out.request_id]
                    per_request[i] = request_latencies(out.metrics, arrivals[i],
                                                       len(out.outputs[0].token_ids))
                    done += 1
            if progress:
                progress(done, len(requests))
    except BaseException:
        for req_id in ids:
            engine.abort(req_id)
        raise
    duration = time.monotonic() - start
    rows = [r for r in per_request if r is not None]
    output_tokens = sum(r["output_len"] for r in rows)
    return LatencyResult(
        num_requests=len(rows), request_rate=request_rate, duration_s=duration,
        requests_per_s=len(rows) / duration, output_tokens_per_s=output_tokens / duration,
        ttft=summarize([r["ttft"] for r in rows]),
        tpot=summarize([r["tpot"] for r in rows if r["tpot"] is not None]),
        itl=summarize([gap for r in rows for gap in r["itl"]]),
        e2e=summarize([r["e2e"] for r in rows]),
        per_request=rows,
    )
