"""Time Scheduler.schedule() + update() per step, without a model.

    python scripts/bench_scheduler.py [--steps 200]

Decode steps at 1, 64, 256 and 512 running requests, and a step admitting 32 new
512-token prompts whose first 448 tokens are prefix-cache hits. The fake runner output
is built outside the timed region. Prints medians (and p90) in milliseconds.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmfast.config import CacheConfig, SchedulerConfig
from llmfast.core.request import Request
from llmfast.core.scheduler import Scheduler
from llmfast.core.scheduler_output import ModelRunnerOutput
from llmfast.sampling_params import SamplingParams

BLOCK_SIZE = 16


def fake_runner_output(sched: Scheduler, out) -> ModelRunnerOutput:
    req_ids, sampled = [], []
    requests = sched.requests
    for rid in out.num_scheduled_tokens:
        req = requests[rid]
        req_ids.append(rid)
        sampled.append([7] if req.num_computed_tokens == len(req.all_token_ids) else [])
    return ModelRunnerOutput(req_ids, sampled)


def make_scheduler(max_num_seqs: int, budget: int, num_blocks: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=4096
        ),
        CacheConfig(block_size=BLOCK_SIZE),
        num_blocks,
    )


def bench_decode(num_reqs: int, steps: int) -> list[float]:
    prompt_len = 128
    num_blocks = num_reqs * (prompt_len + steps + 64) // BLOCK_SIZE + 64
    sched = make_scheduler(max(num_reqs, 1), 8192, num_blocks)
    params = SamplingParams(max_tokens=steps + 1000, ignore_eos=True)
    for i in range(num_reqs):
        # Distinct prompts: no sharing, every block is the request's own.
        prompt = [(i * 7919 + j) % 50000 for j in range(prompt_len)]
        sched.add_request(Request(f"req-{i}", prompt, params, eos_token_ids=(2,)))
    while sched.waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running):
        out = sched.schedule()
        sched.update(out, fake_runner_output(sched, out))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        runner_out = fake_runner_output(sched, out)
        t2 = time.perf_counter()
        sched.update(out, runner_out)
        t3 = time.perf_counter()
        assert len(out.num_scheduled_tokens) == num_reqs
        times.append((t1 - t0) + (t3 - t2))
    return times


def bench_admit(
    reps: int, num_new: int = 32, prompt_len: int = 512, shared: int = 448
) -> list[float]:
    sched = make_scheduler(256, num_new * (prompt_len - shared), 4096)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    system = [(j * 31) % 50000 for j in range(shared)]
    warm = Request("warm", system + [1] * (prompt_len - shared), params)
    sched.add_request(warm)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update(out, fake_runner_output(sched, out))
    times = []
    for rep in range(reps):
        reqs = [
            Request(f"r{rep}-{i}", system + [rep * 1000 + i + 3] * (prompt_len - shared), params)
            for i in range(num_new)
        ]
        for req in reqs:
            sched.add_request(req)
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        runner_out = fake_runner_output(sched, out)
        t2 = time.perf_counter()
        sched.update(out, runner_out)
        t3 = time.perf_counter()
        assert len(out.scheduled_new_reqs) == num_new
        assert all(new.num_computed_tokens == shared for new in out.scheduled_new_reqs)
        times.append((t1 - t0) + (t3 - t2))
        for req in reqs:
            sched.abort(req.request_id)
    return times


def fmt(times: list[float]) -> str:
    times = sorted(times)
    med = statistics.median(times) * 1e3
    p90 = times[int(0.9 * (len(times) - 1))] * 1e3
    return f"median {med:7.3f} ms   p90 {p90:7.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}, block_size {BLOCK_SIZE}")
    print("schedule() + update() per step")
    for n in (1, 64, 256, 512):
        print(f"  decode, {n:4d} running      : {fmt(bench_decode(n, args.steps))}")
    admit = bench_admit(max(args.steps // 4, 10))
    print(f"  admit 32 x 512-token prompts, 448 cached: {fmt(admit)}")


if __name__ == "__main__":
    main()
