"""`MultiprocExecutor`: one worker process per rank on this node (`--distributed-executor-
backend mp`): torch.distributed with NCCL between GPUs (rank r on cuda:r), gloo on CPU.

Each step is pickled once and the same bytes are written to every worker's socket. The
engine collects right after each launch, so the step's message usually also asks for the
oldest launched step's tokens (EXECUTE_THEN_COLLECT: one message and one wake-up per
worker and step); a plain COLLECT (a constant) asks alone when the engine collects
without launching. Rank 0 alone sends the tokens back, oldest first. The other ranks
only ever write to the engine to report an error, so the engine reads one reply per
step and, while it waits for it, also watches every other worker's socket and process:
a worker that dies or fails ends the wait at once with an error naming its rank, after
the remaining workers are stopped. A step that takes longer than `execute_timeout_s` is
a hang and ends the same way.
"""

from __future__ import annotations

import logging
import time
import weakref
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from llmfast.executor.mp import messages
from llmfast.executor.base import DistributedExecutor
from llmfast.executor.errors import (
    PEER_DEATH_GRACE_S,
    ExecutorError,
    WorkerDied,
    WorkerFailed,
)
from llmfast.executor.mp.processes import WorkerProcess
from llmfast.utils.child_processes import stop_children
from llmfast.executor.ranks import cpu_threads_per_rank, rank_config, rank_devices
from llmfast.worker.worker import WorkerReady, WorkerSpec
from llmfast.utils.ports import free_port

if TYPE_CHECKING:
    from llmfast.config import EngineConfig
    from llmfast.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from llmfast.models.sources.model_source import ModelSource
    from llmfast.utils.progress import Progress

logger = logging.getLogger(__name__)

# Longest a step may take before the engine calls it a hang (a CPU prefill of a full
# batch of a big model is the slowest legitimate step).
EXECUTE_TIMEOUT_S = 600.0
# After SHUTDOWN, how long the workers have to exit by themselves.
SHUTDOWN_GRACE_S = 5.0


class MultiprocExecutor(DistributedExecutor):
    backend = "mp"

    def __init__(self, config: EngineConfig, source: ModelSource,
                 progress: Progress | None = None,
                 execute_timeout_s: float = EXECUTE_TIMEOUT_S) -> None:
        world = config.parallel.tensor_parallel_size
        self.world_size = world
        self.execute_timeout_s = execute_timeout_s
        self._config, self._source = config, source
        self._devices = rank_devices(config.device, world)
        if progress:
            progress(f"starting {world} worker process{'es' if world > 1 else ''}", None)
        self._workers: list[WorkerProcess] = []
        # Stops the workers when the executor is shut down, collected, or at exit.
        self._finalizer = weakref.finalize(self, _stop, self._workers, SHUTDOWN_GRACE_S)
        self._ready: list[WorkerReady] = []
        # Steps whose tokens a message asked for and `collect` has not read yet.
        self._replies_due = 0
        log_level = logging.getLogger("llmfast").getEffectiveLevel()
        for rank in range(world):
            self._workers.append(WorkerProcess(rank, log_level))
        # The handles `wait` watches, and whose worker each is.
        self._owner = {w.conn: w for w in self._workers}
        self._owner.update({w.pidfd: w for w in self._workers if w.pidfd is not None})
        self._watched = list(self._owner)

    # ------------------------------------------------------------------ start-up

    def initialize(self, eos_token_ids: tuple[int, ...] = (),
                   progress: Progress | None = None) -> int:
        config, world = self._config, self.world_size
        threads = cpu_threads_per_rank(config.device, world)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        for w, device in zip(self._workers, self._devices):
            spec = WorkerSpec(rank=w.rank, world_size=world,
                              config=rank_config(config, device, world),
                              source=self._source, eos_token_ids=tuple(eos_token_ids),
                              init_method=init_method, cpu_threads=threads)
            self._send(w, messages.encode(messages.SPEC, spec))
        if progress:
            progress(f"loading the model on {self.world_size} rank(s)", None)
        ready: dict[int, WorkerReady] = {}
        while len(ready) < self.world_size:
            worker, kind, payload = self._next_message(None)
            if kind != messages.READY:
                raise self._fail(ExecutorError(f"worker rank {worker.rank} sent {kind!r} "
                                               "before it was ready"))
            ready[worker.rank] = payload
        self._ready = [ready[r] for r in range(self.world_size)]
        return min(r.num_blocks for r in self._ready)

    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    # ------------------------------------------------------------------ steps

    def execute_async(self, sched_out: SchedulerOutput, then_collect: bool = False
                      ) -> int | None:
        launched = bool(sched_out.total_num_scheduled_tokens)
        if self._book_launch(launched, then_collect):
            kind = messages.EXECUTE_THEN_COLLECT
            self._replies_due += 1
        else:
            kind = messages.EXECUTE
        data = messages.encode(kind, sched_out)  # once, for every rank
        for w in self._workers:
            self._send(w, data)
        return sched_out.step_index if launched else None

    def collect(self, handle: int) -> ModelRunnerOutput:
        if self._replies_due:
            self._replies_due -= 1  # asked for with a launch: rank 0's reply is coming
        else:
            self._book_request()
            for w in self._workers:
                self._send(w, messages.COLLECT_MESSAGE)
        worker, kind, payload = self._next_message(
            time.monotonic() + self.execute_timeout_s)
        if kind != messages.OUTPUT or worker.rank != 0:
            raise self._fail(ExecutorError(
                f"worker rank {worker.rank} sent {kind!r} where rank 0's tokens were due"))
        return payload

    def check_health(self) -> None:
        self._check_usable()
        for w in self._workers:
            if w.conn.poll(0) or w.exit_description() is not None:
                raise self._fail(self._failure_of(w))

    # ------------------------------------------------------------------ plumbing

    def _send(self, worker: WorkerProcess, data: bytes) -> None:
        self._check_usable()
        try:
            worker.conn.send_bytes(data)
        except OSError:  # broken pipe: the worker is gone
            raise self._fail(self._failure_of(worker)) from None

    def _next_message(self, deadline: float | None) -> tuple[WorkerProcess, str, object]:
        """The next message any worker sends; raises (after stopping the workers) if one
        died, reported an error, or nothing came before `deadline` (monotonic)."""
        self._check_usable()
        while True:
            ready = wait(self._watched, self._time_left(deadline))
            # A socket first: an error message explains the exit that follows it.
            for handle in sorted(ready, key=lambda h: isinstance(h, int)):
                worker = self._owner[handle]
                if isinstance(handle, int) or not worker.conn.poll(0):
                    continue  # a process that exited: below, unless its socket has data
                try:
                    kind, payload = messages.decode(worker.conn.recv_bytes())
                except (EOFError, OSError):
                    raise self._fail(self._failure_of(worker)) from None
                if kind == messages.ERROR:
                    raise self._fail(_worker_failed(payload))
                return worker, kind, payload
            for handle in ready:
                raise self._fail(self._failure_of(self._owner[handle]))

    def _failure_of(self, worker: WorkerProcess) -> ExecutorError:
        """The error to report for a worker that seems gone: the one it sent, else how
        it died."""
        try:
            if worker.conn.poll(0):
                kind, payload = messages.decode(worker.conn.recv_bytes())
                if kind == messages.ERROR:
                    return _worker_failed(payload)
        except (EOFError, OSError):
            pass
        return WorkerDied(worker.rank, worker.wait_exit(2.0))

    def _peer_death_behind(self, failure: WorkerFailed,
                           grace_s: float = PEER_DEATH_GRACE_S) -> ExecutorError:
        others = [w for w in self._workers if w.rank != failure.rank]
        deadline = time.monotonic() + grace_s
        while others:
            for w in [w for w in others if w.exit_description() is not None]:
                cause = self._failure_of(w)
                if isinstance(cause, WorkerDied):
                    return cause
                others.remove(w)  # exited after an error of its own: not a death
            left = deadline - time.monotonic()
            if left <= 0 or not others:
                break
            pidfds = [w.pidfd for w in others if w.pidfd is not None]
            if len(pidfds) == len(others):
                wait(pidfds, left)  # wakes at the first exit
            else:  # no pidfd here: poll
                time.sleep(min(left, 0.05))
        return failure

    def _stop_after_failure(self) -> None:
        # Briefly: a worker blocked on the failed one never reads SHUTDOWN.
        self._finalizer.detach()
        _stop(self._workers, grace_s=0.5)


def _worker_failed(report: messages.WorkerError) -> WorkerFailed:
    logger.debug("worker rank %d traceback:\n%s", report.rank, report.traceback)
    return WorkerFailed(report.rank, report.message, report.during)


def _stop(workers: list[WorkerProcess], grace_s: float) -> None:
    for w in workers:
        try:
            w.conn.send_bytes(messages.SHUTDOWN_MESSAGE)
        except OSError:
            pass  # gone already
    stop_children(workers, grace_s)
