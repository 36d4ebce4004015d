"""What a JSON-schema constraint costs in decode throughput: tok/s at batch 1 and 64 with
the constraint and without, in one run, medians of repeats.

    PYTHONPATH=. python scripts/structured_cost.py --model default --device cpu \
        --out profiles/structured/cost-cpu.json
    # GPU (the <= 10 % bar at batch 64):
    PYTHONPATH=. python scripts/structured_cost.py --model random:llama-3.2-1b \
        --device cuda --max-tokens 256 --out OUT.json

The schema cannot end within max_tokens (an array of at least 100 objects), so every
step of every constrained row fills and applies a mask; ignore_eos keeps the plain rows
as long. Each batch size runs both modes back to back, after a warm-up of each (the
grammar's compile, the first steps' allocations), alternating plain and constrained
repeats so a machine's drift hits both alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time

SCHEMA = {"type": "array", "minItems": 100, "items": {
    "type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "pattern": "^[A-Za-z]{1,12}$"},
        "ok": {"type": "boolean"}},
    "required": ["id", "name", "ok"], "additionalProperties": False}}
PROMPT = "List the users of the system as a JSON array of objects with id, name and ok."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()

    import torch

    from llmfast import LLM, SamplingParams
    from llmfast.structured_params import StructuredOutputs

    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(args.model, device=args.device, max_num_seqs=max(batches))
    spec = StructuredOutputs(json=SCHEMA)
    modes = {"plain": None, "json_schema": spec}

    def run(batch: int, structured) -> tuple[float, int]:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                                structured=structured)
        t0 = time.perf_counter()
        outs = llm.generate([PROMPT] * batch, params)
        elapsed = time.perf_counter() - t0
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)

    results = {}
    for batch in batches:
        samples = {m: [] for m in modes}
        for m, s in modes.items():  # warm-up: compile, first allocations
            run(batch, s)
        for _ in range(args.repeats):
            for m, s in modes.items():
                elapsed, tokens = run(batch, s)
                samples[m].append(tokens / elapsed)
        med = {m: statistics.median(v) for m, v in samples.items()}
        results[str(batch)] = {
            "tok_s_median": {m: round(v, 1) for m, v in med.items()},
            "tok_s_samples": {m: [round(x, 1) for x in v] for m, v in samples.items()},
            "json_schema_over_plain": round(med["json_schema"] / med["plain"], 3),
        }
        print(f"batch {batch:3d}: plain {med['plain']:8.1f} tok/s, json_schema "
              f"{med['json_schema']:8.1f} tok/s, ratio {med['json_schema'] / med['plain']:.3f}",
              flush=True)
    record = {
        "what": "decode tok/s with a JSON-schema constraint against without",
        "model": args.model, "device": args.device, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "schema": SCHEMA, "results": results,
        "torch": torch.__version__, "machine": platform.machine(),
        "tree": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                               text=True).stdout.strip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
