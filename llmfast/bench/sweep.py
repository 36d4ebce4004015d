"""The batch-size sweep: prefill a batch, then time pure-decode engine steps per size.

Every reported row is a step in which each of the batch's requests decoded exactly one
token, and nothing else ran: the engine's limits are sized for it (`sweep_engine_limits`:
a step holds the whole batch), requests may generate far past the timed window (none
finishes inside it), the KV cache is checked to hold the batch to the end, and the timed
steps are verified afterwards. A size that fails any of this is left out of the rows and
listed in `skipped` with the reason; it is never reported with a mixed step's timing.

On CUDA each row also gives the weight-streaming rate (weight bytes read per step /
median step time) and its fraction of the device's HBM bandwidth (`bench.bandwidth`).
With tensor parallelism every GPU streams its own shards at the same time: the bytes
are one rank's (the rank with the most: the step waits for it), the bandwidth one GPU's.
The figures come from the ranks' `RunnerInfo`, so the sweep runs the same whether the
model runs in this process or in workers (mp, ray).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from llmfast.bench.bandwidth import DeviceBandwidth, device_bandwidth
from llmfast.bench.stats import Summary, summarize
from llmfast.bench.workload import BenchError, bench_params, warm_up
from llmfast.kernels.launch.compile_watch import TritonCompileWatch
from llmfast.utils.progress import CountProgress

logger = logging.getLogger(__name__)


class NotPureDecode(BenchError):
    """A batch size whose timed steps cannot be (or were not) pure decode."""


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
    # Read by one decode step on one rank (with tensor parallelism: its shards, the
    # rank with the most; with one rank: all the weights).
    weight_bytes: int = 0
    weight_stream_bytes_per_s: float = 0.0  # weight_bytes / median step time: one GPU's
    hbm_fraction: float | None = None  # of one device's bandwidth; None on CPU
    # Triton kernel variants specialized during this size's prefill and timed steps
    # (compile_watch.py): a prefill rate with one in it times the compiler.
    triton_compiles: int = 0
    triton_compile_s: float = 0.0


@dataclass
class SweepSkip:
    batch_size: int
    reason: str


@dataclass
class SweepResult:
    points: list[SweepPoint]  # pure-decode rows only
    skipped: list[SweepSkip]
    bandwidth: DeviceBandwidth | None  # of rank 0's device; None on CPU
    # Decode weight bytes of each rank, in rank order (one entry without parallelism);
    # the rows' weight_bytes is the largest.
    weight_bytes_per_rank: list[int] = field(default_factory=list)


def sweep_engine_limits(largest: int, given_seqs: int | None, given_tokens: int | None,
                        defaults: tuple[int, int]) -> dict[str, int]:
    """Engine limits for a sweep up to batch `largest`: a decode step of the whole batch
    must fit in one step, so max_num_seqs and max_num_batched_tokens are at least
    `largest` (and at least the device's defaults, which keep prefill quick). A limit the
    user set below `largest` is an error; one the user set is kept.

    Worked example (CPU defaults 256 / 2048): largest 512 -> {512, 2048};
    largest 4096 -> {4096, 4096}; largest 8 -> {256, 2048}.
    """
    default_seqs, default_tokens = defaults
    limits = {}
    for name, flag, given, default in (
        ("max_num_seqs", "--max-num-seqs", given_seqs, default_seqs),
        ("max_num_batched_tokens", "--max-num-batched-tokens", given_tokens, default_tokens),
    ):
        if given is not None and largest > given:
            raise BenchError(f"size {largest} in --sizes is above {flag} {given}; a decode "
                             "step of the whole batch must fit in one step")
        if given is None:
            limits[name] = max(largest, default)
    return limits


def _max_lead(batch_size: int, context_len: int, budget: int) -> int:
    """Steps by which the first prompts of a chunked prefill run ahead of the last: an
    upper bound for the room they need (max_tokens) and the KV blocks they fill.

    Worked example: 4 prompts of 16 tokens, budget 32: step 1 prefills prompts 0-1,
    step 2 decodes 0-1 and prefills 30 tokens, step 3 the rest: a lead of 2 <= 3."""
    return -(-batch_size * context_len // budget) + 1


def _check_room(engine, batch_size: int, context_len: int, num_decode: int) -> None:
    sched = engine.config.scheduler
    if context_len + num_decode > sched.max_model_len:
        raise BenchError(
            f"--context {context_len} + {num_decode} decode steps exceeds "
            f"max-model-len {sched.max_model_len}"
        )
    if batch_size > sched.max_num_seqs or batch_size > sched.max_num_batched_tokens:
        raise NotPureDecode(
            f"batch {batch_size} does not fit in one step (max-num-seqs {sched.max_num_seqs}, "
            f"max-num-batched-tokens {sched.max_num_batched_tokens})")
    block_size = engine.config.cache.block_size
    usable = engine.scheduler.kv_cache_manager.num_usable_blocks
    groups = engine.scheduler.kv_groups  # several KV-cache groups: each holds its blocks
    if groups is None:
        needed = batch_size * -(-(context_len + num_decode) // block_size)
    else:
        needed = batch_size * groups.max_blocks_per_request(
            context_len + num_decode, sched.max_num_batched_tokens, block_size)
    if needed > usable:
        # Imported here: the sweep module is loaded by `llmfast bench --help`, which must not
        # pay for torch.
        import torch

        from llmfast.worker.startup.kv_cache_sizing import kv_cache_size_flag
        raise NotPureDecode(
            f"batch {batch_size} needs {needed} KV blocks, the cache holds {usable} "
            "(requests would be preempted); lower --context or raise "
            + kv_cache_size_flag(torch.device(engine.config.device), engine.config.cache))


def run_sweep_point(engine, batch_size: int, context_len: int, steps: int,
                    warmup_steps: int = 2, seed: int = 0, weight_bytes: int = 0,
                    bandwidth: DeviceBandwidth | None = None) -> SweepPoint:
    """Prefill `batch_size` random prompts of `context_len` tokens, run `warmup_steps`
    untimed decode steps, then time `steps` calls of `engine.step()`. Raises
    NotPureDecode when the timed steps cannot be or were not pure decode."""
    sched = engine.config.scheduler
    max_lead = _max_lead(batch_size, context_len, sched.max_num_batched_tokens)
    _check_room(engine, batch_size, context_len, warmup_steps + steps + max_lead)
    # As many tokens as the model length allows: no request can finish inside the timed
    # window, however far ahead a chunked prefill lets the first ones run.
    params = bench_params(sched.max_model_len - context_len)
    # A seed per batch size: the prompts of one size must not hit the prefix cache
    # filled by the previous size, or prefill would be measured on cached blocks.
    rng = np.random.default_rng([seed, batch_size, context_len])
    vocab = engine.config.model.vocab_size
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
                len(o.outputs[0].delta_token_ids) == 1 and not o.finished for o in outs)
    finally:
        for req_id in ids:
            engine.abort(req_id)
    if not all_decode:
        raise NotPureDecode(f"batch {batch_size}: some timed steps were not pure decode "
                            "(preemption?); left out")
    stats = summarize(latencies)
    prefill_tokens = batch_size * context_len
    stream_rate = weight_bytes / stats.median if stats.median > 0 else 0.0
    limit = bandwidth.limit_bytes_per_s if bandwidth is not None else None
    return SweepPoint(
        batch_size=batch_size, context_len=context_len, steps=steps, step_latency=stats,
        decode_tokens_per_s=batch_size * steps / sum(latencies),
        prefill_tokens=prefill_tokens, prefill_time_s=prefill_time, prefill_steps=prefill_steps,
        prefill_tokens_per_s=prefill_tokens / prefill_time, all_decode=all_decode,
        step_latencies_s=latencies, weight_bytes=weight_bytes,
        weight_stream_bytes_per_s=stream_rate,
        hbm_fraction=stream_rate / limit if limit else None,
    )


def run_sweep(engine, sizes: Sequence[int], context_len: int, steps: int, seed: int = 0,
              progress: CountProgress | None = None) -> SweepResult:
    sched = engine.config.scheduler
    if max(sizes) > sched.max_num_seqs:
        raise BenchError(f"size {max(sizes)} is above --max-num-seqs {sched.max_num_seqs}")
    if max(sizes) > sched.max_num_batched_tokens:
        raise BenchError(f"size {max(sizes)} is above --max-num-batched-tokens "
                         f"{sched.max_num_batched_tokens}: its decode steps would be split")
    infos = engine.runner_infos  # read once: in-process, each read sums the weights
    per_rank = [info.decode_weight_bytes for info in infos]
    weight_bytes = max(per_rank)
    rank0 = infos[0]
    bandwidth = device_bandwidth(rank0.device, rank0.device_name)
    warm_up(engine)
    points, skipped = [], []
    for i, size in enumerate(sizes):
        try:
            with TritonCompileWatch() as watch:
                point = run_sweep_point(engine, size, context_len, steps, seed=seed,
                                        weight_bytes=weight_bytes, bandwidth=bandwidth)
            point.triton_compiles, point.triton_compile_s = len(watch.compiles), watch.seconds
            points.append(point)
        except NotPureDecode as e:
            logger.warning("%s", e)
            skipped.append(SweepSkip(size, str(e)))
        if progress:
            progress(i + 1, len(sizes))
    return SweepResult(points, skipped, bandwidth, per_rank)
