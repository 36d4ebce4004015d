"""`graph_capture(name)`: the one place where capture-time process state changes.

Capture allocates many small Python objects (graph handles, weak output views); with
the heap frozen the collector does not rescan it for every one of hundreds of graphs.
The freeze is a counted hold (llmfast.utils.gc_freeze), so an engine's own hold and this one
compose: the heap is unfrozen only when the last hold ends.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator

from llmfast.utils.gc_freeze import gc_frozen

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def graph_capture(name: str) -> Iterator[None]:
    start = time.perf_counter()
    with gc_frozen():
        try:
            yield
        finally:
            logger.debug("%s: %.2f s", name, time.perf_counter() - start)
