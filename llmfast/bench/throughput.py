"""Offline throughput: every request at once, stepped to completion."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from llmfast.bench.workload import (
    BenchRequest,
    bench_params,
    check_fits,
    warm_up,
)
from llmfast.core.spec_decode import spec_rates
from llmfast.kernels.launch.compile_watch import TritonCompileWatch
from llmfast.utils.progress import CountProgress


@dataclass
class ThroughputResult:
    num_requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    # Triton kernel variants specialized inside the timed run (compile_watch.py): start-up
    # should leave none, or the run times the compiler.
    triton_compiles: dict | None = None
    # Speculative decoding in the timed run (None when off): draft tokens verified and
    # accepted, verify steps, acceptance rate, mean accepted length.
    spec_decode: dict | None = None


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
                   progress: CountProgress | None = None) -> ThroughputResult:
    """All requests at once, stepped to completion (an offline batch job)."""
    check_fits(requests, engine.config.scheduler.max_model_len)
    warm_up(engine)
    before = engine.stats()
    with TritonCompileWatch() as watch:
        result = _timed_run(engine, requests, progress)
    result.triton_compiles = watch.summary()
    if engine.config.speculative is not None:
        result.spec_decode = spec_decode_delta(before, engine.stats())
    return result


def spec_decode_delta(before, after) -> dict:
    """Speculative decoding's counts between two engine stats, and their rates."""
    drafts = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    steps = after.spec_num_verify_steps - before.spec_num_verify_steps
    rate, length = spec_rates(drafts, accepted, steps)
    return {"num_draft_tokens": drafts, "num_accepted_tokens": accepted,
            "num_verify_steps": steps, "acceptance_rate": rate,
            "mean_accepted_length": length}


def _timed_run(engine, requests: Sequence[BenchRequest],
               progress: CountProgress | None) -> ThroughputResult:
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
