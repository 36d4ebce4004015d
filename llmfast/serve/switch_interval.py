"""How soon a thread that waits for the GIL gets it while the server runs.

The engine loop shares its process with busy Python threads: the HTTP handlers
(`--api-servers 0`), the tokenising threads, the queue to the HTTP processes. A step
lets go of the GIL several times (a CUDA graph replay, waiting for the GPU's output),
and each time it takes it back it waits until the running thread is made to yield:
every `sys.getswitchinterval()`, 5 ms by default. Beside a thread that is always busy
(hundreds of streams being written), a 2.5 ms step that lets go twice took 12.6 ms on
the CPU VM; with 0.5 ms, 3.5 ms, while the busy thread did as much work as before
(profiles/serving.md).

The server as a whole did not follow that synthetic step. On the H100 (2026-11-27,
gpu_check `serve_gil`: the 1B, `--api-servers 0`, 256 streams at once) it served 13.3k
output tok/s (TPOT 14.9 ms) at 5 ms and 11.6k (17.4 ms) at 0.5 ms; on the 2-core VM
6.9-7.9k against 7.9-8.1k. More switches also cost the busy threads (each hand-over is a
futex round trip and a cold cache), and the engine is not the only waiter. So `serve`
leaves Python's interval unless `LLMFAST_SWITCH_INTERVAL_MS` asks for another
(`serving_switch_interval`), which it sets for as long as it runs and restores after.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from collections.abc import Iterator

ENV = "LLMFAST_SWITCH_INTERVAL_MS"


def serving_switch_interval() -> float | None:
    """Seconds: `$LLMFAST_SWITCH_INTERVAL_MS` / 1000 when set, else None (leave Python's:
    the module docstring says why). A value that is not a positive number raises
    ValueError (one line, naming the variable)."""
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
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
