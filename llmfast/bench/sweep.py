"""The batch-size sweep: prefill a batch, then time pure-decode engine steps per size."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from llmfast.bench.sizes import BenchError
from llmfast.bench.stats import Summary, summarize
from llmfast.bench.workload import BenchProgress, bench_params, warm_up

logger = logging.getLogger(__name__)


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
