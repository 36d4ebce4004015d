"""The messages between the engine and its `mp` worker processes: pickled tuples on a
pipe per worker.

Engine -> every worker (the same bytes to each: a step is pickled once, whatever the
number of ranks): `(EXECUTE, SchedulerOutput)`; `(EXECUTE_THEN_COLLECT, SchedulerOutput)`,
which also asks for the oldest launched step's tokens once this step is launched (the
engine's usual step: one message per step); `(COLLECT, None)`, the same request alone;
`(SHUTDOWN, None)`. The first message a worker reads is `(SPEC, WorkerSpec)`.
Worker -> engine: `(READY, WorkerReady)` once, `(OUTPUT, ModelRunnerOutput)` per
collected step from rank 0 only, `(ERROR, WorkerError)` before a worker exits on an
exception.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass

SPEC = "spec"
EXECUTE = "execute"
EXECUTE_THEN_COLLECT = "execute_then_collect"
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
