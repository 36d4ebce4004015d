"""`RayWorkerActor`: one rank's `Worker` inside a Ray actor (the `ray` backend).

A plain class: `ray_executor` wraps it with `ray.remote` when the ray backend is chosen,
so importing llmfast never imports ray. Ray runs an actor's calls one at a time in the
order the engine made them, so `execute` of step N+1 runs before `collect` of step N
exactly as the engine sent them (`execute_then_collect` does both in one call). A step
that fails in `execute` (whose result nobody waits for) is remembered and raised by the
next `collect`, which the engine does wait for.
"""

from __future__ import annotations

import os
import pickle
import socket

from llmfast.core.scheduler_output import ModelRunnerOutput
from llmfast.worker.worker import Worker, WorkerReady, WorkerSpec
from llmfast.utils.errors import one_line


class StepFailed(RuntimeError):
    """A step failed on this rank; the message is the original error's line."""


class RayWorkerActor:
    def __init__(self) -> None:
        self.worker: Worker | None = None
        self._failure: str | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a port free on it, for torch.distributed's store."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return host, s.getsockname()[1]

    def pid(self) -> int:
        return os.getpid()

    def start(self, spec: WorkerSpec) -> WorkerReady:
        self.worker = Worker(spec)
        return self.worker.start()

    def execute(self, data: bytes) -> None:
        if self._failure is not None:
            return
        try:
            self.worker.execute(pickle.loads(data))
        except Exception as e:  # noqa: BLE001 - raised by the next collect
            self._failure = one_line(e, max_chars=None)

    def execute_then_collect(self, data: bytes) -> ModelRunnerOutput | None:
        """Launch a step, then collect the oldest launched one (one call per step)."""
        self.execute(data)
        return self.collect()

    def collect(self) -> ModelRunnerOutput | None:
        if self._failure is not None:
            raise StepFailed(self._failure)
        return self.worker.collect()
