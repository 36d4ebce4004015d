"""How soon a thread that waits for the GIL gets it while the server runs.

The engine loop shares its process with busy Python threads: the HTTP handlers
(`--api-servers 0`), the tokenising threads, the queue to the HTTP processes. A step
lets go of the GIL several times (a CUDA graph replay, waiting for the GPU's output),
and each time it takes it back it waits until the running thread is made to yield:
every `sys.getswitchinterval()`, 5 ms by default. Beside a thread that is always busy
(hundreds of streams being written), a 2.5 ms step that lets go twice took 12.6 ms on
the CPU VM; with 0.5 ms, 3.5 ms, while the busy thread did as much work as before
(scripts/bench_switch_interval.py; profiles/cpu-2026-11-27f-session25.md). On the H100
a 2.3 ms decode step at batch 256 came out as 18.4 ms per token through the server.

`serving_switch_interval(device)` is what `serve` sets for as long as it runs (and
restores after): `LLMFAST_SWITCH_INTERVAL_MS`, else 0.5 ms where the engine runs on a
GPU. On the CPU Python's own stays: there a step's torch ops are computation on the same
few cores the handlers need, not a wait, and on the 2-core VM the server's output rate at
256 streams did not improve at 0.5 ms (6.9-7.9k against 7.9-8.1k tok/s at 5 ms).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections.abc import Iterator

SERVE_SWITCH_INTERVAL_S = 0.0005
ENV = "LLMFAST_SWITCH_INTERVAL_MS"


def serving_switch_interval(device: str) -> float | None:
    """Seconds: `$LLMFAST_SWITCH_INTERVAL_MS` / 1000 when set, else 0.5 ms for an engine
    on a GPU (`device` not "cpu"), None (leave Python's) on the CPU. A value that is not
    a positive number raises ValueError (one line, naming the variable)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None if device.split(":")[0] == "cpu" else SERVE_SWITCH_INTERVAL_S
    try:
        ms = float(text)
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and 0 < ms <= 1000):
        raise ValueError(f"{ENV}={text!r}: expected milliseconds in (0, 1000], e.g. 0.5 "
                         "(Python's default is 5)")
    return ms / 1000


_lock = threading.Lock()
_holders = 0
_previous = 0.0


@contextlib.contextmanager
def switch_interval(seconds: float | None) -> Iterator[None]:
    """`sys.setswitchinterval(seconds)` for the block (None: as it is). The value before
    the first of overlapping blocks (servers on several threads) comes back when the
    last one ends, whatever order they end in."""
    global _holders, _previous
    if seconds is None:
        yield
        return
    with _lock:
        if _holders == 0:
            _previous = sys.getswitchinterval()
        _holders += 1
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                sys.setswitchinterval(_previous)
