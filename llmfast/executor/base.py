"""`Executor`: what the engine sees of the workers that run the model, whatever runs them.

The engine hands each scheduler step to `execute_async`, which launches it on every rank
and returns a handle at once (None when nothing was scheduled: no token to compute);
`collect(handle)` waits for that step and returns rank 0's `ModelRunnerOutput` (only
rank 0 samples for the engine: every rank computes the same tokens). Handles are
collected in launch order; at most one step is launched and not yet collected when the
engine schedules the next (async scheduling), so a worker can run step N+1 before the
engine reads step N.

The engine collects right after it launches (step N in the synchronous loop, step N-1 in
the pipelined one) and says so with `execute_async(..., then_collect=True)`: a backend
that reaches its workers by message asks for the oldest launched step's tokens in the
same message as the new step (one message and one wake-up per rank and step), and
`collect` then only reads the reply. A `collect` that no launch announced (draining the
last step in flight) asks for the tokens itself.

Backends (`--distributed-executor-backend`): `uni` runs the model runner in this
process; `mp` runs one worker process per rank on this node; `ray` one Ray actor per
rank. A backend that loses a worker raises `WorkerDied` / `WorkerFailed` (naming the
rank) after stopping the rest; `shutdown()` stops every worker and may be called twice.
"""

from __future__ import annotations

import logging
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmfast.executor.errors import PEER_DEATH_GRACE_S, ExecutorError, WorkerFailed

if TYPE_CHECKING:
    from llmfast.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from llmfast.worker.runner_info import RunnerInfo
    from llmfast.worker.worker import WorkerReady
    from llmfast.utils.progress import Progress
    from llmfast.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Executor(ABC):
    #: The backend's name, as `--distributed-executor-backend` spells it.
    backend: str = ""
    world_size: int = 1

    #: `initialize` may run before the end-of-sequence ids are known, which then come
    #: through `set_eos_token_ids` before the first step: the engine loads its tokenizer
    #: in a thread meanwhile. (Workers get them with their start-up message instead, and
    #: boot while the engine loads its tokenizer.)
    late_eos_token_ids: bool = False

    @abstractmethod
    def initialize(self, eos_token_ids: tuple[int, ...] = (),
                   progress: Progress | None = None) -> int:
        """Load the model and allocate the KV cache on every rank (compiling and capturing
        graphs on the way); returns the number of KV blocks the scheduler may use: the
        fewest any rank has. Constructing the executor only starts the workers (they boot
        while the engine loads its tokenizer, which decides `eos_token_ids`)."""

    def set_eos_token_ids(self, eos_token_ids: tuple[int, ...]) -> None:
        """The end-of-sequence ids, after an `initialize` without them (only where
        `late_eos_token_ids`)."""
        raise ExecutorError(f"the {self.backend} executor takes the end-of-sequence ids "
                            "at initialize")

    @abstractmethod
    def execute_async(self, sched_out: SchedulerOutput, then_collect: bool = False
                      ) -> object | None:
        """Launch one step on every rank; a handle for `collect`, or None when the step
        computes nothing (the ranks still apply its finished and preempted ids).
        `then_collect`: the engine's next call collects the oldest launched step (this
        one, or one launched before it); a backend may ask for its tokens now."""

    @abstractmethod
    def collect(self, handle: object) -> ModelRunnerOutput:
        """Wait for a launched step; rank 0's sampled tokens."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise `ExecutorError` if a worker is gone; cheap (no step is run)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every worker (idempotent; also runs when the executor is collected and at
        interpreter exit)."""

    @property
    @abstractmethod
    def startup_times(self) -> dict[str, float]:
        """Seconds per start-up stage (load, kv_cache, compile, capture) of rank 0."""

    @property
    @abstractmethod
    def runner_infos(self) -> tuple[RunnerInfo, ...]:
        """What each rank's runner reports about itself (device, weight bytes of its
        shards, compile stats), in rank order; after `initialize`."""

    @property
    def runner_info(self) -> RunnerInfo:
        """Rank 0's `RunnerInfo`."""
        return self.runner_infos[0]

    def set_phase_timer(self, timer) -> None:
        """Time the runner's phases of the following steps (None: stop). Only the
        in-process runner can be timed; other backends time the engine's phases only."""

    @property
    def runner(self) -> ModelRunner:
        """The in-process model runner (the `uni` backend only: with workers, the runners
        live in other processes)."""
        raise ExecutorError(
            f"the model runner lives in {self.world_size} worker(s) of the {self.backend} "
            "executor, not in this process; only --distributed-executor-backend uni has one "
            "(runner_info has what each rank reports)")

    @property
    def local_runner(self) -> ModelRunner | None:
        """The in-process runner, or None when the model runs in workers."""
        return None


class DistributedExecutor(Executor):
    """An executor whose ranks run in other processes (mp, ray). Once a worker dies or
    fails, every worker is stopped (the others may be blocked on it in a collective) and
    the executor refuses further steps, naming the first failure."""

    # Why the workers were stopped: the message only (the error object's traceback would
    # keep the engine's frames, and the engine, alive).
    _failure: str | None = None
    # Longest a step may take before it counts as a hang (a CPU prefill of a full batch
    # of a big model is the slowest legitimate step).
    execute_timeout_s: float = 600.0
    # Stops the workers once (shutdown, garbage collection, interpreter exit); set by
    # the backend before it starts any worker.
    _finalizer: weakref.finalize
    # Every rank's ready message, in rank order, once `initialize` has returned.
    _ready: Sequence[WorkerReady] = ()
    # Launched steps whose tokens no message has asked the workers for yet.
    _unrequested: int = 0

    @property
    def startup_times(self) -> dict[str, float]:
        return dict(self._ready[0].startup_times) if self._ready else {}

    @property
    def runner_infos(self) -> tuple[RunnerInfo, ...]:
        if not self._ready:
            raise ExecutorError(f"the {self.backend} executor's workers are not initialised")
        return tuple(r.info for r in self._ready)

    def shutdown(self) -> None:
        self._finalizer()

    def _fail(self, error: ExecutorError) -> ExecutorError:
        """Stop every worker now and remember why; returns the error to raise: `error`,
        or for a rank's failure the death of another rank behind it."""
        if isinstance(error, WorkerFailed):
            error = self._peer_death_behind(error)
        if self._failure is None:
            self._failure = str(error)
        logger.debug("stopping the workers: %s", error)
        self._stop_after_failure()
        return error

    def _stop_after_failure(self) -> None:
        self._finalizer()

    def _peer_death_behind(self, failure: WorkerFailed,
                           grace_s: float = PEER_DEATH_GRACE_S) -> ExecutorError:
        """Another rank's death if one shows within `grace_s` (it caused `failure`: see
        PEER_DEATH_GRACE_S), else `failure`. A backend that can see deaths overrides."""
        return failure

    def _time_left(self, deadline: float | None) -> float | None:
        """Seconds until `deadline` (time.monotonic; None: no limit); past it, the
        workers are stopped and a hang is raised."""
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise self._fail(ExecutorError(
                f"no answer from the workers within {self.execute_timeout_s:.0f} s; "
                "a worker hangs"))
        return left

    def _book_launch(self, launched: bool, then_collect: bool) -> bool:
        """Count a launch (`launched`: it returned a handle); whether its message should
        also ask for the oldest launched step's tokens (only when one awaits a request:
        a worker asked to collect with nothing launched fails the step)."""
        self._unrequested += launched
        if then_collect and self._unrequested:
            self._unrequested -= 1
            return True
        return False

    def _book_request(self) -> None:
        """Count a `collect` that asks the workers for the oldest step's tokens itself."""
        self._unrequested = max(0, self._unrequested - 1)

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise ExecutorError(f"the engine stopped earlier: {self._failure}")
        if not self._finalizer.alive:
            raise ExecutorError("the executor was shut down")
