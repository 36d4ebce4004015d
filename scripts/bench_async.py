"""Async scheduling against the synchronous loop, side by side on one engine: the decode
step time end to end (`engine.step()`, medians) against the model step alone (forward +
sampler: CUDA-event spans on a GPU, host time on a CPU), per batch size.

The modes alternate on the same engine (`LLMEngine.set_async_scheduling`), `--repeats`
times each, so both see the same weights, KV cache and machine state. The model step is
timed in a separate pass with a PhaseTimer on the runner, so its events do not slow the
end-to-end passes. In that synchronous pass the GPU is idle when each span's start event
is recorded, so a span also holds the host's launch latency of its work (~10-30 us for a
graph replay or the sampler's launches): the model step reads that much long, and the
async / model ratio that much better than the device alone would give. A size whose
timed steps are not all pure decode (a preemption) is reported as skipped.

    python scripts/bench_async.py --model random:llama-3.2-1b --sizes 1,64,256    # GPU
    python scripts/bench_async.py --model random:smollm2-135m --device cpu --sizes 1,8,32
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics

import torch

from llmfast import LLM
from llmfast.bench import (
    NotPureDecode,
    environment_info,
    rank_device_facts,
    run_sweep_point,
    warm_up,
)
from llmfast.profiling.phase_timing import PhaseTimer


def measure_size(engine, size: int, context: int, steps: int, repeats: int) -> dict:
    """One table row: the model step, then sync and async `repeats` times each, in turns.
    NotPureDecode when a timed step was not pure decode."""
    model = model_step_ms(engine, size, context, steps)
    latencies: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(repeats):
        for mode in (False, True):
            engine.set_async_scheduling(mode)
            point = run_sweep_point(engine, size, context, steps, seed=2 * rep + mode)
            latencies[mode] += [t * 1e3 for t in point.step_latencies_s]
    sync, async_ = (statistics.median(latencies[m]) for m in (False, True))
    return {"batch": size, "model_step_ms": model, "sync_ms": sync, "async_ms": async_}


def model_step_ms(engine, size: int, context: int, steps: int) -> float:
    """Median forward + sample time of `steps` decode steps at `size` (synchronous loop)."""
    engine.set_async_scheduling(False)
    timer = PhaseTimer(engine.config.device)
    engine.runner.phase_timer = timer
    try:
        run_sweep_point(engine, size, context, steps, seed=99)
    finally:
        engine.runner.phase_timer = None
    forward = timer.per_call_ms("forward")[-steps:]
    sample = timer.per_call_ms("sample")[-steps:]
    return statistics.median(f + s for f, s in zip(forward, sample))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama-3.2-1b")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sizes", default="1,64,256")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(sizes),
              max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.context + args.steps + 64, enforce_eager=args.enforce_eager)
    engine = llm.engine
    warm_up(engine)
    device = engine.config.device
    environment = environment_info(rank_device_facts(engine.runner_info))
    name = environment.get("gpu") or environment["cpu"]
    print(f"# async scheduling vs synchronous loop: {args.model}, {device} ({name}), "
          f"{engine.config.dtype}, torch {torch.__version__}, "
          f"{'eager' if engine.config.compile.enforce_eager else 'compiled'}, "
          f"context {args.context}, {args.steps} timed steps x {args.repeats} repeats, "
          f"{datetime.date.today()}")
    print("| batch | model step ms | sync ms/step | async ms/step | sync / model | "
          "async / model | async / sync |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for size in sizes:
        try:
            row = measure_size(engine, size, args.context, args.steps, args.repeats)
        except NotPureDecode as e:  # (a preemption): this size only, the others still run
            rows.append({"batch": size, "skipped": str(e)})
            print(f"| {size} | skipped: {e} | | | | | |", flush=True)
            continue
        rows.append(row)
        model, sync, async_ = row["model_step_ms"], row["sync_ms"], row["async_ms"]
        print(f"| {size} | {model:.2f} | {sync:.2f} | {async_:.2f} | {sync / model:.2f} | "
              f"{async_ / model:.2f} | {async_ / sync:.3f} |", flush=True)
    engine.set_async_scheduling(False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "device": device, "device_name": name,
                       "torch": torch.__version__, "environment": environment,
                       "args": vars(args), "rows": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
