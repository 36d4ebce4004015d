"""Keep long-lived objects out of the cyclic garbage collector's scans, for as long as
someone needs it, and give them back afterwards.

Why: after start-up an engine holds ~400k objects (modules, tokenizer, torch and
transformers internals) that live as long as it does. Left in the collector's oldest
generation, every full collection rescans them: a 150 ms stall in the middle of a
generation, every few hundred steps. `gc.freeze()` moves every object alive into a
permanent generation the collector skips; graph capture, which makes many small objects,
uses it too.

`gc.freeze()` acts on the whole process, so this module counts holds: each hold freezes
what is alive when it starts; when the last hold ends, everything frozen since the first
one is handed back (`gc.unfreeze()`). Objects that someone else froze before the first
hold stay frozen: we cannot tell them apart, so then nothing is unfrozen.

The trade-off: while a hold lasts, an object that was alive when it started and later
becomes cyclic garbage is not collected until the last hold ends (plain reference
counting still frees everything outside cycles at once).
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator

_lock = threading.Lock()
_holds = 0
_unfreeze_at_end = False


def hold_gc_freeze() -> Callable[[], None]:
    """Freeze everything alive now; returns the release (call it once; later calls do
    nothing)."""
    global _holds, _unfreeze_at_end
    gc.collect()  # what is garbage now must not be frozen with the rest
    with _lock:
        if _holds == 0:
            _unfreeze_at_end = gc.get_freeze_count() == 0
        _holds += 1
        gc.freeze()
    released = False

    def release() -> None:
        global _holds
        nonlocal released
        with _lock:
            if released:
                return
            released = True
            _holds -= 1
            if _holds == 0 and _unfreeze_at_end:
                gc.unfreeze()

    return release


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """A hold for the duration of a block (e.g. CUDA-graph capture)."""
    release = hold_gc_freeze()
    try:
        yield
    finally:
        release()


def active_holds() -> int:
    return _holds
