"""Engine overhead per decode step: everything but the model forward and the sampler.

Runs `random:tiny` (so the forward is small) with N requests all decoding, and times
each `engine.step()` split into forward (the model, lm_head included), sampler and the
rest (schedule, input preparation, sampling metadata, state updates, detokenisation). Prints medians per batch size.

    python scripts/bench_engine_overhead.py --sizes 1,64,256

Wall-clock, with the forward and sampler on torch's default threads. For the host's
share by engine phase, on the thread's CPU clock and with the GPU run's vocabulary and
tokenizer, use scripts/bench_host_phases.py (this script stays for the earlier profiles
that cite it: profiles/host-overhead-cpu.md, profiles/cpu-engine.md).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from llmfast import LLM, SamplingParams


def measure(num_reqs: int, steps: int, stream: bool) -> dict[str, float]:
    llm = LLM("random:tiny", device="cpu", max_num_seqs=max(num_reqs, 1),
              max_num_batched_tokens=max(2048, num_reqs * 17), max_model_len=512)
    engine = llm.engine
    runner = engine.runner
    for i in range(num_reqs):
        engine.add_request({"prompt_token_ids": [3 + (i % 500)] * 16},
                           SamplingParams(temperature=0.0, max_tokens=steps + 10, ignore_eos=True),
                           stream=stream)
    engine.step()  # all prefills
    engine.step()
    timings = {"forward": 0.0, "sampler": 0.0}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            timings[name] += time.perf_counter() - t
            return out
        return wrapper

    runner.forward_fn = timed("forward", runner.forward_fn)
    # The lm_head is the model's last layer (run apart, on the sampled rows only).
    runner.model.compute_logits = timed("forward", runner.model.compute_logits)
    runner.sampler.forward = timed("sampler", runner.sampler.forward)
    totals, forwards, samplers = [], [], []
    for _ in range(steps):
        timings["forward"] = timings["sampler"] = 0.0
        t = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - t)
        forwards.append(timings["forward"])
        samplers.append(timings["sampler"])
    overhead = [a - b - c for a, b, c in zip(totals, forwards, samplers)]
    return {
        "step_ms": statistics.median(totals) * 1e3,
        "forward_ms": statistics.median(forwards) * 1e3,
        "sampler_ms": statistics.median(samplers) * 1e3,
        "overhead_ms": statistics.median(overhead) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,64,256")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--stream", action="store_true",
                    help="streaming requests (an output per request per step), as chat does; "
                         "default: offline, as LLM.generate")
    args = ap.parse_args()
    print(f"# engine overhead per decode step (random:tiny, CPU, torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"{'streaming' if args.stream else 'offline'} requests)")
    print("| running requests | step (ms) | forward (ms) | sampler (ms) | overhead (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for n in (int(s) for s in args.sizes.split(",")):
        r = measure(n, args.steps, args.stream)
        print(f"| {n} | {r['step_ms']:.2f} | {r['forward_ms']:.2f} | {r['sampler_ms']:.2f} "
              f"| {r['overhead_ms']:.2f} |")


if __name__ == "__main__":
    main()
