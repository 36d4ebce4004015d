"""Host time the server's SSE loop spends per generated token when its streams lag.

`--streams` streaming completions each find `--lag` deltas (one token each) queued when
their handler wakes up, as when the engine steps faster than HTTP writes. The figure is
the SSE loop's time (api/generation.py `_events`: chunk building, JSON, SSE framing) per
token, with the queued deltas merged into one chunk per choice (the default since
session 25) and, for comparison, one chunk per delta (the merge switched off here).

    PYTHONPATH=$PWD python scripts/bench_sse_chunks.py [--streams 256] [--lags 1,2,4,8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from llmfast.serve.api import generation
from llmfast.serve.api.responses import ResponseBuilder
from llmfast.serve.stream import ChoiceDelta, DeltaQueue, PreparedPrompt


class _Quiet:  # the tracker's and metrics' stand-ins: the loop's own cost is measured
    def on_delta(self, delta) -> None:
        pass


async def _drain(streams: int, lag: int, rounds: int) -> float:
    prompt = [PreparedPrompt(None, list(range(16)))]
    handlers = []
    queues = []
    for s in range(streams):
        rs = DeltaQueue(f"cmpl-{s}", 1)
        builder = ResponseBuilder("completion", rs.request_id, "m", prompt, 1)
        queues.append(rs)
        handlers.append(generation._events(None, None, rs, builder, _Quiet(), False))
    total = 0.0
    for r in range(rounds):
        for rs in queues:
            for k in range(lag):
                n = r * lag + k + 1
                last = r == rounds - 1 and k == lag - 1
                rs.put(ChoiceDelta(0, " tok", 1, n, 0, None, "length" if last else None,
                                   None))
        t0 = time.perf_counter()
        for gen in handlers:
            await gen.__anext__()
        total += time.perf_counter() - t0
    return total / (streams * rounds * lag)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--lags", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    merged = generation.merged_in_order
    print(f"SSE loop µs per token, {args.streams} streams (median of {args.repeats}):\n")
    print("| deltas queued per wake-up | one chunk per delta | merged | ratio |")
    print("|---:|---:|---:|---:|")
    for lag in (int(x) for x in args.lags.split(",")):
        figures = {}
        for name, merge in (("per delta", lambda items, *_: items), ("merged", merged)):
            generation.merged_in_order = merge
            figures[name] = statistics.median(
                asyncio.run(_drain(args.streams, lag, args.rounds)) * 1e6
                for _ in range(args.repeats))
        generation.merged_in_order = merged
        print(f"| {lag} | {figures['per delta']:.1f} | {figures['merged']:.1f} "
              f"| {figures['per delta'] / figures['merged']:.2f}x |")


if __name__ == "__main__":
    main()
