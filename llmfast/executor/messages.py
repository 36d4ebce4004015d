"""The messages between the engine and its `mp` worker processes: pickled tuples on a
pipe per worker.

Engine -> every worker (the same bytes to each: a step is pickled once, whatever the
number of ranks): `(EXECUTE, SchedulerOutput)`, `(COLLECT, None)`, `(SHUTDOWN, None)`.
The first message a worker reads is `(SPEC, WorkerSpec)`.
Worker -> engine: `(READY, WorkerReady)` once, `(OUTPUT, ModelRunnerOutput)` per
collected step from rank 0 only, `(ERROR, WorkerError)` before a worker exits on an
exception.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

SPEC = "spec"
EXECUTE = "execute"
COLLECT = "collect"
SHUTDOWN = "shutdown"
READY = "ready"
OUTPUT = "output"
ERROR = "error"


@dataclass(frozen=True)
class WorkerError:
    rank: int
    message: str  # one line
    during: str  # "during start-up", "in a step"
    traceback: str  # the worker's, for --debug logs


def encode(kind: str, payload: object = None) -> bytes:
    return pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> tuple[str, object]:
    return pickle.loads(data)


# Constant messages, pickled once.
COLLECT_MESSAGE = encode(COLLECT)
SHUTDOWN_MESSAGE = encode(SHUTDOWN)
