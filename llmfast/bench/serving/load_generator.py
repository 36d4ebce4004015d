"""Load generator for `llmfast serve` (or any OpenAI-compatible server), like vLLM's
serving benchmark: N streaming /v1/completions requests arriving as a Poisson process
(or all at once), at most `max_concurrency` in flight, each a fixed number of greedy
tokens (`ignore_eos`). Per request: TTFT (send to first streamed token), ITL (gaps
between streamed chunks), TPOT = (e2e - ttft) / (output_len - 1), e2e.

Runs on httpx's asyncio client; imports neither torch nor the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmfast.bench.latency import poisson_arrivals
from llmfast.bench.stats import Summary, summarize
from llmfast.bench.workload import BenchError, BenchRequest
from llmfast.utils.errors import one_line


@dataclass
class ServeBenchResult:
    url: str
    model: str
    num_requests: int
    request_rate: float  # requests/s; inf = all at once
    max_concurrency: int | None
    duration_s: float
    completed: int
    failed: int
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float  # prompt + output
    ttft: Summary | None  # seconds
    tpot: Summary | None
    itl: Summary | None
    e2e: Summary | None
    errors: list[str] = field(default_factory=list)  # the first few


async def fetch_model(client, url: str, headers: dict, model: str | None
                      ) -> tuple[str, int | None]:
    """The model to ask for (`model`, else the served one) and its max_model_len (None
    where the server does not say). A server without a usable /v1/models is fine when
    `model` is given."""
    try:
        r = await client.get(url + "/v1/models", headers=headers)
        r.raise_for_status()
        cards = r.json()["data"]
        card = next((c for c in cards if model is None or c.get("id") == model), None)
        if card is None and model is None and cards:
            card = cards[0]
    except Exception as e:  # noqa: BLE001 - any failure: HTTP, JSON, shape
        if model is not None:
            return model, None
        raise BenchError(f"cannot read the served model from {url}/v1/models "
                         f"({type(e).__name__}: {one_line(e)}); pass the model name") from None
    if card is None:
        if model is not None:
            return model, None
        raise BenchError(f"{url}/v1/models lists no model; pass the model name")
    return model or card["id"], card.get("max_model_len")


def check_fits(requests: Sequence[BenchRequest], max_model_len: int) -> None:
    """Refuse a workload the server would refuse request by request (a prompt plus
    max_tokens past its context is a 400): the run would time only the failures."""
    longest = max(requests, key=lambda r: len(r.prompt_token_ids) + r.output_len)
    need = len(longest.prompt_token_ids) + longest.output_len
    if need > max_model_len:
        raise BenchError(
            f"a request needs {len(longest.prompt_token_ids)} prompt + {longest.output_len} "
            f"output = {need} tokens, past the server's max_model_len {max_model_len}; "
            "use shorter input/output lengths or a server with a longer --max-model-len")


async def _one(client, url: str, model: str, req: BenchRequest, headers: dict) -> dict:
    body = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    chunk_times: list[float] = []
    usage = None
    start = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers=headers) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")
            raise RuntimeError(f"HTTP {r.status_code}: {text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message", "error event"))
            if chunk.get("choices"):
                chunk_times.append(time.perf_counter())
            if chunk.get("usage"):
                usage = chunk["usage"]
    end = time.perf_counter()
    if not chunk_times or usage is None:
        raise RuntimeError("stream ended without tokens or usage")
    n_out = usage["completion_tokens"]
    ttft = chunk_times[0] - start
    e2e = end - start
    return {"ttft": ttft, "e2e": e2e, "output_len": n_out,
            "prompt_len": usage["prompt_tokens"],
            "tpot": (e2e - ttft) / (n_out - 1) if n_out > 1 else None,
            "itl": [b - a for a, b in itertools.pairwise(chunk_times)]}


async def run_serve_bench(url: str, requests: Sequence[BenchRequest], request_rate: float,
                          max_concurrency: int | None = None, model: str | None = None,
                          api_key: str | None = None, seed: int = 0,
                          timeout_s: float = 600.0) -> ServeBenchResult:
    import httpx

    url = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        model, max_model_len = await fetch_model(client, url, headers, model)
        if max_model_len is not None:
            check_fits(requests, max_model_len)
        # Warm-up outside the timed region (first-call costs in the server and here).
        await _one(client, url, model, BenchRequest(requests[0].prompt_token_ids[:16], 4),
                   headers)
        offsets = poisson_arrivals(len(requests), request_rate, seed)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        start = time.perf_counter()

        async def scheduled(offset: float, req: BenchRequest) -> dict | BaseException:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            try:
                if gate is None:
                    return await _one(client, url, model, req, headers)
                async with gate:
                    return await _one(client, url, model, req, headers)
            except Exception as e:  # noqa: BLE001 - counted as a failure, reported
                return e

        results = await asyncio.gather(*(scheduled(o, r) for o, r in zip(offsets, requests)))
        duration = time.perf_counter() - start
    rows = [r for r in results if isinstance(r, dict)]
    errors = [f"{type(r).__name__}: {r}" for r in results if not isinstance(r, dict)]
    out_tokens = sum(r["output_len"] for r in rows)
    all_tokens = out_tokens + sum(r["prompt_len"] for r in rows)
    return ServeBenchResult(
        url=url, model=model, num_requests=len(requests), request_rate=request_rate,
        max_concurrency=max_concurrency, duration_s=duration, completed=len(rows),
        failed=len(errors), requests_per_s=len(rows) / duration,
        output_tokens_per_s=out_tokens / duration, total_tokens_per_s=all_tokens / duration,
        ttft=summarize([r["ttft"] for r in rows]),
        tpot=summarize([r["tpot"] for r in rows if r["tpot"] is not None]),
        itl=summarize([gap for r in rows for gap in r["itl"]]),
        e2e=summarize([r["e2e"] for r in rows]),
        errors=errors[:5],
    )


def format_result(result: ServeBenchResult) -> str:
    """A markdown summary: throughput line, then a ms table of the latency metrics."""
    rate = "inf" if math.isinf(result.request_rate) else f"{result.request_rate:g}"
    lines = [
        (f"{result.completed}/{result.num_requests} requests ok ({result.failed} failed) in "
         f"{result.duration_s:.2f} s at rate {rate}/s, max concurrency "
         f"{result.max_concurrency or 'unlimited'}: {result.requests_per_s:.2f} req/s, "
         f"{result.output_tokens_per_s:.1f} output tok/s, "
         f"{result.total_tokens_per_s:.1f} total tok/s"),
        "",
        "| metric (ms) | mean | median | p90 | p99 | max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = getattr(result, name)
        if s is not None:
            lines.append(f"| {name.upper()} | {s.mean * 1e3:.1f} | {s.median * 1e3:.1f} | "
                         f"{s.p90 * 1e3:.1f} | {s.p99 * 1e3:.1f} | {s.max * 1e3:.1f} |")
    lines += [f"error: {e}" for e in result.errors]
    return "\n".join(lines)
