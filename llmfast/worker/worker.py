"""`Worker`: one rank's side of an executor, whatever process hosts it (an `mp` worker
process or a Ray actor).

It joins the tensor-parallel group, builds and initialises this rank's `ModelRunner`,
then applies steps in the order the engine sends them: `execute` launches a step (it
does not wait for its tokens), `collect` reads the oldest launched step. The engine
sends step N+1 before it asks for step N's tokens (async scheduling), so a rank has
launched N+1 by the time it collects N, exactly as the in-process runner does.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass

import torch

from llmfast.config import EngineConfig
from llmfast.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from llmfast.distributed import init_tensor_parallel
from llmfast.worker.runner_info import RunnerInfo, runner_info
from llmfast.models.sources.model_source import ModelSource
from llmfast.worker.model_runner import ModelRunner
from llmfast.worker.step_output import PendingStep

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """What a rank needs to start: sent to it once, pickled."""

    rank: int
    world_size: int
    config: EngineConfig  # this rank's: its device is the rank's own
    source: ModelSource
    eos_token_ids: tuple[int, ...]
    init_method: str  # torch.distributed rendezvous, e.g. "tcp://127.0.0.1:29500"
    # CPU: torch threads for this rank (the node's cores split between its ranks);
    # None leaves torch's default.
    cpu_threads: int | None = None


@dataclass(frozen=True)
class WorkerReady:
    """A rank's answer once its runner is initialised."""

    rank: int
    num_blocks: int
    startup_times: dict[str, float]
    pid: int
    info: RunnerInfo


class Worker:
    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.runner: ModelRunner | None = None
        # Launched steps not yet collected, oldest first (None: launched, nothing to read).
        self._launched: collections.deque[PendingStep | None] = collections.deque()

    def start(self) -> WorkerReady:
        spec = self.spec
        if spec.cpu_threads is not None:
            torch.set_num_threads(spec.cpu_threads)
        t0 = time.perf_counter()
        group = init_tensor_parallel(spec.rank, spec.world_size, spec.init_method,
                                     torch.device(spec.config.device))
        join_s = time.perf_counter() - t0
        self.runner = ModelRunner(spec.config, spec.source, eos_token_ids=spec.eos_token_ids,
                                  tp_group=group)
        num_blocks = self.runner.initialize()
        times = {"join_group": join_s, **self.runner.startup_times}
        logger.debug("rank %d ready: %d KV blocks", spec.rank, num_blocks)
        return WorkerReady(spec.rank, num_blocks, times, os.getpid(), runner_info(self.runner))

    def execute(self, sched_out: SchedulerOutput) -> None:
        pending = self.runner.execute_async(sched_out)
        # The engine expects tokens exactly when tokens were scheduled (see
        # Executor.execute_async): keep the queue in step with its handles.
        if sched_out.total_num_scheduled_tokens:
            self._launched.append(pending)

    def collect(self) -> ModelRunnerOutput | None:
        """The oldest launched step's tokens: rank 0's for the engine, None elsewhere
        (the other ranks collect too, to keep their runner state the same as rank 0's)."""
        if not self._launched:
            raise RuntimeError("collect without a launched step")
        pending = self._launched.popleft()
        out = (self.runner.collect(pending) if pending is not None
               else ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        return out if self.rank == 0 else None
