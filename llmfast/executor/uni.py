"""`UniExecutor`: one rank, the model runner in this process (the default for one device).

Nothing crosses a process boundary: each call is the runner's own, so the engine's step
costs what it cost before there were executors (one Python call more)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from llmfast.executor.base import Executor
from llmfast.worker.runner_info import RunnerInfo, runner_info
from llmfast.worker.model_runner import ModelRunner
from llmfast.worker.startup.cpu_threads import configure_cpu_threads, sample_cpu_times

if TYPE_CHECKING:
    from llmfast.config import EngineConfig
    from llmfast.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from llmfast.models.sources.model_source import ModelSource
    from llmfast.utils.progress import Progress
    from llmfast.worker.step_output import PendingStep


class UniExecutor(Executor):
    backend = "uni"
    late_eos_token_ids = True  # the runner reads them at each step, not at start-up

    def __init__(self, config: EngineConfig, source: ModelSource,
                 progress: Progress | None = None) -> None:
        self._config, self._source = config, source
        self._runner: ModelRunner | None = None

    def initialize(self, eos_token_ids: tuple[int, ...] = (),
                   progress: Progress | None = None) -> int:
        if progress:
            progress("loading weights", None)
        on_cpu = torch.device(self._config.device).type == "cpu"
        # The load of other processes, measured while the weights load: it sets the
        # intra-op threads before the first step (worker/startup/cpu_threads.py).
        started, before = time.perf_counter(), sample_cpu_times() if on_cpu else None
        self._runner = ModelRunner(self._config, self._source, eos_token_ids=eos_token_ids,
                                   progress=progress)
        if on_cpu:
            configure_cpu_threads(before, started)
        return self._runner.initialize(progress)

    def set_eos_token_ids(self, eos_token_ids: tuple[int, ...]) -> None:
        self._runner.eos_token_ids = tuple(eos_token_ids)

    # The runner is looked up on every call (not bound once) so that tests and profilers
    # that wrap the runner's methods see every step.
    def execute_async(self, sched_out: SchedulerOutput, then_collect: bool = False
                      ) -> PendingStep | None:
        return self._runner.execute_async(sched_out)

    def collect(self, handle: PendingStep) -> ModelRunnerOutput:
        return self._runner.collect(handle)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    @property
    def startup_times(self) -> dict[str, float]:
        return self._runner.startup_times

    @property
    def runner_infos(self) -> tuple[RunnerInfo]:
        return (runner_info(self._runner),)

    def set_phase_timer(self, timer) -> None:
        self._runner.phase_timer = timer

    @property
    def runner(self) -> ModelRunner:
        return self._runner

    @property
    def local_runner(self) -> ModelRunner:
        return self._runner
