"""How long the server's running requests stall while another request is taken in.

    python scripts/bench_serve_stall.py [--model random:smollm2-135m] [--enforce-eager]
        [--prompts 200 --n 20] [--json PATH]

In process (the `--api-servers 0` engine loop, `AsyncEngine`): one request streams
greedy tokens while, after a calm stretch, one more request arrives:
- `long text`: one prompt of --chars characters to tokenise (refused afterwards if it
  is past max-model-len: the tokenising is what is timed);
- `many choices`: --prompts token-id prompts x n=--n choices (engine requests).
Per case: the running request's largest gap between two tokens and its median gap
during the interfering add, against the calm stretch's median; the engine loop's largest
time between two steps then (what the add itself held the steps up: a gap between tokens
also holds the steps, which the new requests make longer); and how long the add took to
be answered. Run it on two trees to compare (PYTHONPATH=<tree>).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from llmfast import LLM  # noqa: E402
from llmfast.sampling_params import SamplingParams  # noqa: E402
from llmfast.serve.engine_loop import AsyncEngine, ChoiceDelta, RequestStream  # noqa: E402


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


async def _case(front: AsyncEngine, steps: list, name: str, prompts, params,
                calm_tokens: int) -> dict:
    running = RequestStream(f"running-{name}", 1)
    await front.add(running, [[5] * 16], [_params(1_000_000)])
    arrivals: list[float] = []

    async def read() -> None:
        while True:
            item = await running.get()
            if not isinstance(item, ChoiceDelta) or item.finish_reason is not None:
                return
            arrivals.append(time.perf_counter())

    reader = asyncio.ensure_future(read())
    while len(arrivals) < calm_tokens:
        await asyncio.sleep(0.005)
    sent = time.perf_counter()
    other = RequestStream(f"other-{name}", len(params))
    error = None
    try:
        await front.add(other, prompts, params)
    except ValueError as e:  # past max-model-len: refused once tokenised
        error = type(e).__name__
    answered = time.perf_counter()
    front.abort(other.engine_ids)
    # A few tokens more, so the gap spanning the add is seen whole.
    count = len(arrivals)
    while len(arrivals) < count + 5:
        await asyncio.sleep(0.005)
    front.abort(running.engine_ids)
    reader.cancel()
    calm = [b - a for a, b in zip(arrivals[: calm_tokens - 1], arrivals[1:calm_tokens])]
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > sent and a < answered + 0.001]
    spans = list(steps)
    between = [nxt[0] - prev[1] for prev, nxt in zip(spans, spans[1:])
               if nxt[0] > sent and prev[1] < answered]
    return {
        "case": name,
        "engine_requests": len(params),
        "add_answered_ms": (answered - sent) * 1e3,
        "add_error": error,
        "calm_median_gap_ms": statistics.median(calm) * 1e3,
        "during_median_gap_ms": statistics.median(during) * 1e3 if during else None,
        "during_max_gap_ms": max(during) * 1e3 if during else None,
        "tokens_during_add": sum(1 for t in arrivals if sent < t <= answered),
        "max_between_steps_ms": max(between) * 1e3 if between else None,
        "max_step_ms": max(b - a for a, b in spans if b > sent and a < answered) * 1e3,
    }


async def _run(args) -> list[dict]:
    engine_args = {"max_num_seqs": args.max_num_seqs, "dtype": args.dtype}
    if args.device:
        engine_args["device"] = args.device
    if args.enforce_eager:
        engine_args["enforce_eager"] = True
    llm = LLM(args.model, **engine_args)
    engine = llm.engine
    steps: list[tuple[float, float]] = []  # (start, end) of each engine step
    real_step = engine.step

    def timed_step():
        start = time.perf_counter()
        try:
            return real_step()
        finally:
            steps.append((start, time.perf_counter()))

    engine.step = timed_step  # on this instance only
    front = AsyncEngine(engine)
    front.start()
    vocab = llm.engine.config.model.vocab_size
    words = "the quick brown fox jumps over a lazy dog while tokens stream out ".split()
    text = " ".join(words[i % len(words)] for i in range(args.chars // 4))[: args.chars]
    try:
        results = [await _case(front, steps, "long text", [text], [_params(1)], args.calm_tokens)]
        # One-token prompts, one token each: cheap to run, so the gaps show the add.
        prompts = [[(7 * p + 3) % vocab] for p in range(args.prompts)]
        results.append(await _case(front, steps, "many choices", prompts,
                                   [_params(1)] * (args.prompts * args.n), args.calm_tokens))
        return results
    finally:
        front.stop()
        await asyncio.to_thread(front.join, 60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:smollm2-135m")
    parser.add_argument("--chars", type=int, default=400_000)
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no compile, no CUDA graphs (quick to start on a CPU)")
    parser.add_argument("--calm-tokens", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = asyncio.run(_run(args))
    print(f"{'case':<14}{'requests':>9}{'add ms':>9}{'calm gap ms':>13}"
          f"{'median gap ms':>15}{'max gap ms':>12}{'tokens':>8}{'max step ms':>13}"
          f"{'max between steps ms':>22}")
    for r in results:
        fmt = (lambda v: "-" if v is None else f"{v:.1f}")  # noqa: E731
        print(f"{r['case']:<14}{r['engine_requests']:>9}{r['add_answered_ms']:>9.0f}"
              f"{r['calm_median_gap_ms']:>13.1f}{fmt(r['during_median_gap_ms']):>15}"
              f"{fmt(r['during_max_gap_ms']):>12}{r['tokens_during_add']:>8}"
              f"{r['max_step_ms']:>13.1f}{fmt(r['max_between_steps_ms']):>22}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=1))


if __name__ == "__main__":
    main()
