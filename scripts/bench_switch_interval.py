"""A step that lets go of the GIL, beside a thread that never stops running Python, at
several GIL switch intervals (llmfast/serve/switch_interval.py says why it matters).

The "step" stands for the engine loop's on a GPU: some Python (inputs), a release of the
GIL while the device works (a sleep here), some Python (outputs), a second short
release. The busy thread stands for the HTTP handlers writing hundreds of streams (JSON
encoding in a loop). Figures: the step's median alone and beside the busy thread, and
how much work the busy thread got done (JSON documents per second).

    python scripts/bench_switch_interval.py [--intervals-ms 5,1,0.5,0.2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

_DOC = {"id": "cmpl-0", "object": "text_completion", "choices": [
    {"index": 0, "text": " hello", "logprobs": None, "finish_reason": None}]}


def _python_work(n: int = 3000) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def _step(device_s: float) -> float:
    t0 = time.perf_counter()
    _python_work()
    time.sleep(device_s)  # the GIL let go: a graph replay, waiting for the device
    _python_work()
    time.sleep(device_s / 3)  # a second release (an event sync)
    return time.perf_counter() - t0


def measure(interval_s: float, steps: int, device_s: float) -> dict:
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        alone = [_step(device_s) for _ in range(steps // 4)]
        stop = threading.Event()
        done = [0]

        def busy() -> None:
            while not stop.is_set():
                for _ in range(100):
                    json.dumps(_DOC)
                done[0] += 100

        spinner = threading.Thread(target=busy)
        t0 = time.perf_counter()
        spinner.start()
        beside = [_step(device_s) for _ in range(steps)]
        stop.set()
        spinner.join()
        elapsed = time.perf_counter() - t0
    finally:
        sys.setswitchinterval(previous)
    return dict(interval_ms=interval_s * 1e3, step_alone_ms=statistics.median(alone) * 1e3,
                step_beside_ms=statistics.median(beside) * 1e3,
                busy_docs_per_s=done[0] / elapsed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals-ms", default="5,1,0.5,0.2")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device-ms", type=float, default=1.5,
                        help="the step's first release of the GIL")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = [measure(float(ms) / 1e3, args.steps, args.device_ms / 1e3)
            for ms in args.intervals_ms.split(",")]
    print("| switch interval ms | step alone ms | step beside a busy thread ms | "
          "slowdown | busy thread k docs/s |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['interval_ms']:g} | {r['step_alone_ms']:.2f} | {r['step_beside_ms']:.2f} "
              f"| {r['step_beside_ms'] / r['step_alone_ms']:.2f}x "
              f"| {r['busy_docs_per_s'] / 1e3:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
