"""Benchmarks as a library: size specs, workloads, percentile maths, and the sweep,
throughput and latency runners. Results are plain dataclasses; `llmfast bench` only
formats them (and the tests call these directly).

Definitions follow vLLM's `bench`: TTFT from a request's arrival to its first token,
TPOT = (e2e - ttft) / (output_len - 1), ITL = the gaps between consecutive tokens.
The HF transformers baseline lives in `llmfast.bench_hf`.
"""

from __future__ import annotations

import logging
import math
import platform
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from llmfast.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# A batch of more than this many sequences is a typo, not a benchmark.
MAX_BENCH_SIZE = 65536

# Called as (done, total) while a runner makes progress.
BenchProgress = Callable[[int, int], None]


class BenchError(ValueError):
    """A benchmark that cannot run as asked; the message is one user-facing line."""


# ---------------------------------------------------------------------- size specs

_RANGE = re.compile(r"^(\d+)\.\.(\d+)(?::(\d+))?$")


def parse_sizes(spec: str, limit: int = MAX_BENCH_SIZE, flag: str = "--sizes") -> list[int]:
    """Batch sizes from a spec: `1..512` doubles from 1 up to 512, `8..64:8` steps by 8,
    `1,8,64` lists; items can be mixed (`1,2,8..64:8`). Sorted, without duplicates."""
    if not spec or not spec.strip():
        raise BenchError(f"empty {flag}; use e.g. 1..512, 8..64:8 or 1,8,64")
    where = f"{flag} {spec!r}"
    sizes: set[int] = set()
    for item in (part.strip() for part in spec.split(",")):
        sizes.update(_parse_size_item(item, where))
    too_big = max(sizes)
    if too_big > limit:
        raise BenchError(f"size {too_big} in {where} is above the limit {limit}")
    return sorted(sizes)


def _parse_size_item(item: str, where: str) -> list[int]:
    if item.isdigit():
        value = int(item)
        if value < 1:
            raise BenchError(f"sizes must be >= 1, got {value} in {where}")
        return [value]
    match = _RANGE.match(item)
    if match is None:
        raise BenchError(f"cannot parse {item!r} in {where}; use e.g. 1..512, 8..64:8 or 1,8,64")
    start, stop = int(match[1]), int(match[2])
    if start < 1:
        raise BenchError(f"sizes must be >= 1, got {start} in {where}")
    if start > stop:
        raise BenchError(f"range {item!r} in {where} runs backwards ({start} > {stop})")
    if stop > MAX_BENCH_SIZE:  # checked before expanding so `1..10**12:1` stays cheap
        raise BenchError(f"size {stop} in {where} is above the limit {MAX_BENCH_SIZE}")
    if match[3] is None:  # doubling: 1..512 -> 1, 2, 4, ..., 512
        return [start << k for k in range(int(math.log2(stop / start)) + 1)]
    step = int(match[3])
    if step < 1:
        raise BenchError(f"the step in {item!r} must be >= 1")
    return list(range(start, stop + 1, step))


# ---------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Summary:
    """Order statistics of one metric (same unit as the input, usually seconds)."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float
    min: float
    max: float


def summarize(values: Sequence[float]) -> Summary | None:
    """Mean and percentiles (numpy's linear interpolation, as vLLM's bench); None if empty."""
    if len(values) == 0:
        return None
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return Summary(len(arr), float(arr.mean()), float(p50), float(p90), float(p99),
                   float(arr.min()), float(arr.max()))


# ---------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> list[int]:
    """`n` lengths uniform in [mean * (1 - r), mean * (1 + r)] (at least 1), as vLLM's
    random dataset; r = 0 gives fixed lengths."""
    if not 0.0 <= range_ratio < 1.0:
        raise BenchError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def random_requests(
    num: int, input_len: int, output_len: int, vocab_size: int,
    range_ratio: float = 0.0, seed: int = 0,
) -> list[BenchRequest]:
    """Seeded random-token prompts with fixed or random input and output lengths."""
    if num < 1 or input_len < 1 or output_len < 1:
        raise BenchError("--num-prompts, --input-len and --output-len must be >= 1")
    rng = np.random.default_rng(seed)
    in_lens = random_lengths(rng, num, input_len, range_ratio)
    out_lens = random_lengths(rng, num, output_len, range_ratio)
    return [
        BenchRequest(rng.integers(0, vocab_size, size=n_in).tolist(), n_out)
        for n_in, n_out in zip(in_lens, out_lens)
    ]


def shared_prefix_requests(
    num: int, prefix_len: int, suffix_len: int, output_len: int, vocab_size: int, seed: int = 0
) -> list[BenchRequest]:
    """Prompts that share their first `prefix_len` tokens (a system prompt, a document):
    the prefix cache should serve all but the first."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab_size, size=prefix_len).tolist()
    return [
        BenchRequest(prefix + rng.integers(0, vocab_size, size=suffix_len).tolist(), output_len)
        for _ in range(num)
    ]


def bench_params(output_len: int) -> SamplingParams:
    """Greedy, exactly `output_len` tokens: benchmarks must not end early on EOS."""
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def warm_up(engine, prompt_len: int = 16, output_len: int = 4) -> None:
    """One short request outside the timed region: first-call costs (allocator, lazy
    kernels, compile guards) must not be billed to the first measured requests."""
    vocab = engine.config.model.vocab_size
    max_len = engine.config.scheduler.max_model_len
    prompt = [(7 * i + 3) % vocab for i in range(min(prompt_len, max_len - output_len - 1))]
    req_id = engine.add_request({"prompt_token_ids": prompt}, bench_params(output_len),
                                request_id="bench-warmup")
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.abort(req_id)


def check_fits(requests: Sequence[BenchRequest], max_model_len: int) -> None:
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    if longest > max_model_len:
        raise BenchError(
            f"a request needs {longest} tokens (input + output), above max-model-len "
            f"{max_model_len}; shorten --input-len/--output-len or raise --max-model-len"
        )


# ---------------------------------------------------------------------- sweep


@dataclass
class SweepPoint:
    """One batch size: prefill of the whole batch, then timed all-decode steps."""

    batch_size: int
    context_len: int
    steps: int
    step_latency: Summary  # seconds per engine.step()
    decode_tokens_per_s: float  # batch_size tokens per step over the timed steps
    prefill_tokens: int
    prefill_time_s: float
    prefill_steps: int
    prefill_tokens_per_s: float
    all_decode: bool  # every timed step gave exactly one token to every request
    step_latencies_s: list[float] = field(default_factory=list)


def run_sweep_point(engine, batch_size: int, context_len: int, steps: int,
                    warmup_steps: int = 2, seed: int = 0) -> SweepPoint:
    """Prefill `batch_size` random prompts of `context_len` tokens, run `warmup_steps`
    untimed decode steps, then time `steps` calls of `engine.step()`."""
    sched = engine.config.scheduler
    # Prompts prefilled in an early step of a chunked prefill decode while later ones
    # still prefill, so they run up to that many steps ahead: give them room, or the
    # first ones would finish inside the timed window and it would not be pure decode.
    # (+1: the decodes of the first prompts take budget from the later ones' chunks.)
    max_lead = -(-batch_size * context_len // sched.max_num_batched_tokens) + 1
    num_decode = warmup_steps + steps + max_lead
    if context_len + num_decode > sched.max_model_len:
        raise BenchError(
            f"--context {context_len} + {num_decode} decode steps exceeds "
            f"max-model-len {sched.max_model_len}"
        )
    # A seed per batch size: the prompts of one size must not hit the prefix cache
    # filled by the previous size, or prefill would be measured on cached blocks.
    rng = np.random.default_rng([seed, batch_size, context_len])
    vocab = engine.config.model.vocab_size
    params = bench_params(num_decode)
    ids = [
        engine.add_request({"prompt_token_ids": rng.integers(0, vocab, size=context_len).tolist()},
                           params, request_id=f"sweep-{batch_size}-{i}")
        for i in range(batch_size)
    ]
    try:
        started: set[str] = set()
        t0 = time.perf_counter()
        prefill_steps = 0
        while len(started) < batch_size:
            for out in engine.step():
                if out.outputs[0].token_ids:
                    started.add(out.request_id)
            prefill_steps += 1
        prefill_time = time.perf_counter() - t0
        for _ in range(warmup_steps):
            engine.step()
        latencies = []
        all_decode = True
        for _ in range(steps):
            t = time.perf_counter()
            outs = engine.step()
            latencies.append(time.perf_counter() - t)
            all_decode &= len(outs) == batch_size and all(
                len(o.outputs[0].delta_token_ids) == 1 for o in outs)
    finally:
        for req_id in ids:
            engine.abort(req_id)
    if not all_decode:
        logger.warning("batch %d: some timed steps were not pure decode (KV cache too "
                       "small for the batch? preemption?)", batch_size)
    stats = summarize(latencies)
    prefill_tokens = batch_size * context_len
    return SweepPoint(
        batch_size=batch_size, context_len=context_len, steps=steps, step_latency=stats,
        decode_tokens_per_s=batch_size * steps / sum(latencies),
        prefill_tokens=prefill_tokens, prefill_time_s=prefill_time, prefill_steps=prefill_steps,
        prefill_tokens_per_s=prefill_tokens / prefill_time, all_decode=all_decode,
        step_latencies_s=latencies,
    )


def run_sweep(engine, sizes: Sequence[int], context_len: int, steps: int, seed: int = 0,
              progress: BenchProgress | None = None) -> list[SweepPoint]:
    limit = engine.config.scheduler.max_num_seqs
    if max(sizes) > limit:
        raise BenchError(f"size {max(sizes)} is above --max-num-seqs {limit}")
    warm_up(engine)
    points = []
    for i, size in enumerate(sizes):
        points.append(run_sweep_point(engine, size, context_len, steps, seed=seed))
        if progress:
            progress(i + 1, len(sizes))
    return points


# ---------------------------------------------------------------------- throughput


@dataclass
class ThroughputResult:
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float


def throughput_result(requests: Sequence[BenchRequest], output_tokens: int,
                      elapsed: float) -> ThroughputResult:
    input_tokens = sum(len(r.prompt_token_ids) for r in requests)
    return ThroughputResult(
        num_requests=len(requests), input_tokens=input_tokens, output_tokens=output_tokens,
        elapsed_s=elapsed, requests_per_s=len(requests) / elapsed,
        output_tokens_per_s=output_tokens / elapsed,
        total_tokens_per_s=(input_tokens + output_tokens) / elapsed,
    )


def run_throughput(engine, requests: Sequence[BenchRequest],
                   progress: BenchProgress | None = None) -> ThroughputResult:
    """All requests at once, stepped to completion (an offline batch job)."""
    check_fits(requests, engine.config.scheduler.max_model_len)
    warm_up(engine)
    t0 = time.perf_counter()
    ids = [engine.add_request({"prompt_token_ids": r.prompt_token_ids}, bench_params(r.output_len),
                              request_id=f"tput-{i}") for i, r in enumerate(requests)]
    done = 0
    output_tokens = 0
    try:
        while done < len(ids):
            for out in engine.step():
                if out.finished:
                    done += 1
                    output_tokens += len(out.outputs[0].token_ids)
            if progress:
                progress(done, len(ids))
    except BaseException:
        for req_id in ids:
            engine.abort(req_id)
        raise
    return throughput_result(requests, output_tokens, time.perf_counter() - t0)


# ---------------------------------------------------------------------- latency


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


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets (seconds) of a Poisson process of `rate` requests/s; inf: all at 0."""
    if not rate > 0:
        raise BenchError(f"--request-rate must be > 0 (or inf), got {rate}")
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
            "itl": [b - a for a, b in zip(times, times[1:])]}


def run_latency(engine, requests: Sequence[BenchRequest], request_rate: float, seed: int = 0,
                progress: BenchProgress | None = None) -> LatencyResult:
    """Requests arrive at Poisson times; the step loop adds each once its time has come."""
    check_fits(requests, engine.config.scheduler.max_model_len)
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


# ---------------------------------------------------------------------- environment


def environment_info(device: str) -> dict:
    """Versions and hardware, so a JSON result says where it came from."""
    import torch

    import llmfast

    try:
        import transformers
        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    info = {
        "device": device,
        "torch": torch.__version__,
        "transformers": hf_version,
        "llmfast": llmfast.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_threads": torch.get_num_threads(),
    }
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
