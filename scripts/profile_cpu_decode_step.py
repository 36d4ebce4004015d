"""One batch-1 decode step on the CPU, by op: torch.profiler's self CPU time per op of a
(steps + 1)-token generation less a 1-token one from the same prompt (prefix-cached, so
the difference is `steps` decode steps), per step. Rows named after the engine's phase
ranges (`forward[1]`, `sample`, `prepare_inputs`, ...) are their own Python time.

    python scripts/profile_cpu_decode_step.py --quantization gguf [--compile] \\
        --out profiles/cpu/cpu-decode-step-gguf.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantization", default="gguf")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from llmfast import LLM, SamplingParams

    llm = LLM(quantization=args.quantization, compile=args.compile,
              max_model_len=args.context + args.steps + 8)
    prompt = {"prompt_token_ids": list(range(1000, 1000 + args.context))}
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    many = SamplingParams(max_tokens=args.steps + 1, temperature=0, ignore_eos=True)
    llm.generate(prompt, many)  # warm-up (and the prefix cache)
    step_ms = []
    for _ in range(5):
        t0 = time.perf_counter()
        llm.generate(prompt, one)
        t1 = time.perf_counter()
        llm.generate(prompt, many)
        step_ms.append(((time.perf_counter() - t1) - (t1 - t0)) / args.steps * 1e3)

    def self_times(params) -> dict[str, tuple[int, float]]:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(prompt, params)
        return {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()}

    short, long = self_times(one), self_times(many)
    rows = []
    for op, (count, ms) in long.items():
        count0, ms0 = short.get(op, (0, 0.0))
        rows.append({"op": op, "calls_per_step": (count - count0) / args.steps,
                     "self_ms_per_step": (ms - ms0) / args.steps})
    rows.sort(key=lambda r: -r["self_ms_per_step"])
    total = sum(r["self_ms_per_step"] for r in rows if r["self_ms_per_step"] > 0)
    report = {"command": " ".join(sys.argv), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "loadavg": os.getloadavg(),
              "step_ms_unprofiled": step_ms, "step_ms_median": statistics.median(step_ms),
              "profiled_self_ms_per_step": total, "ops": rows}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"step {statistics.median(step_ms):.1f} ms unprofiled (median of 5), "
          f"{torch.get_num_threads()} threads; profiled self time {total:.1f} ms/step")
    print("| op | calls/step | self CPU ms/step | % |\n|---|---:|---:|---:|")
    for r in rows[:args.rows]:
        print(f"| `{r['op']}` | {r['calls_per_step']:.0f} | {r['self_ms_per_step']:.2f} | "
              f"{100 * r['self_ms_per_step'] / total:.1f} |")


if __name__ == "__main__":
    main()
