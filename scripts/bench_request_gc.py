"""How long one full garbage collection takes while many requests wait in the engine.

A server with a deep queue keeps every waiting request's objects alive; CPython's full
collections walk all of them (the engine freezes what start-up made, so that is mostly
what is left), and the engine's thread stops meanwhile. This adds --requests requests of
each --prompt-lens length to an engine (random:tiny on the CPU, no step run), then times
gc.collect() (the median of --repeats).

    PYTHONPATH=$PWD python scripts/bench_request_gc.py [--requests 10000] [--prompt-lens 1 1000]

For a before/after, run the same script with PYTHONPATH at another tree (`git archive
<rev> llmfast | tar -x -C /tmp/oldtree`, run from /tmp/oldtree).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import llmfast
from llmfast import LLM, SamplingParams


def collection_ms(num_requests: int, prompt_len: int, repeats: int) -> tuple[float, float]:
    """(median ms of a full collection, GC-tracked objects per request)."""
    llm = LLM("random:tiny", device="cpu", dtype="float32", enforce_eager=True,
              max_model_len=max(4096, prompt_len + 8))
    engine = llm.engine
    params = SamplingParams(max_tokens=4)
    vocab = 400  # under random:tiny's 512
    gc.collect()
    before = len(gc.get_objects())
    for i in range(num_requests):
        engine.add_request([5 + (i * 7 + j) % vocab for j in range(prompt_len)], params,
                           request_id=f"r{i}")
    gc.collect()
    per_request = (len(gc.get_objects()) - before) / num_requests
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t0)
    engine.abort_many([f"r{i}" for i in range(num_requests)])
    return statistics.median(times) * 1e3, per_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[1, 1000])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    print(f"llmfast from {llmfast.__file__}")
    for prompt_len in args.prompt_lens:
        ms, per_request = collection_ms(args.requests, prompt_len, args.repeats)
        rows.append(dict(requests=args.requests, prompt_len=prompt_len, full_gc_ms=ms,
                         tracked_per_request=per_request))
        print(f"{args.requests} waiting requests x {prompt_len}-token prompts: full "
              f"collection {ms:.1f} ms (median of {args.repeats}), {per_request:.1f} "
              "GC-tracked objects per request")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
