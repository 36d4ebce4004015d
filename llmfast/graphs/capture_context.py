"""`graph_capture(name)`: the one place where capture-time process state changes.

Capture allocates many small Python objects (graph handles, weak output views); with
the heap frozen the collector does not rescan it for every one of hundreds of graphs.
The freeze is undone on leaving, but only if this context made it: objects frozen
before (e.g. by an engine that already started) stay frozen.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def graph_capture(name: str) -> Iterator[None]:
    froze = gc.get_freeze_count() == 0
    if froze:
        gc.collect()
        gc.freeze()
    start = time.perf_counter()
    try:
        yield
    finally:
        if froze:
            gc.unfreeze()
        logger.debug("%s: %.2f s", name, time.perf_counter() - start)
