"""`LLMEngine`: requests in, one step at a time, `RequestOutput`s out, all in this process.

It joins the three parts every frontend has: the `InputProcessor` (tokenize, check, build
the core's request), the engine core behind an `InprocClient` (schedule, run the model,
token ids out) and the `OutputProcessor` (detokenize, stop strings, logprobs, outputs).
`LLM` and `llmfast chat` use it; `llmfast serve` runs the same core in a process of its
own and the same processors in its frontends.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from llmfast.config import EngineConfig
from llmfast.core.request import RequestRejected
from llmfast.engine.core import EngineCore
from llmfast.engine.core_client import InprocClient
from llmfast.engine.processing.input_processor import CoreLimits, InputProcessor, Prompt, tokenize_prompt
from llmfast.engine.processing.output_processor import OutputProcessor
from llmfast.engine.startup import start_engine
from llmfast.engine.args import EngineArgs
from llmfast.engine.model_resolution import resolve_model
from llmfast.models.sources.model_source import ModelSource
from llmfast.outputs import RequestOutput
from llmfast.profiling.nvtx_ranges import nvtx_range
from llmfast.sampling_params import SamplingParams
from llmfast.utils.progress import Progress

if TYPE_CHECKING:
    from llmfast.worker.runner_info import RunnerInfo
    from llmfast.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "Prompt", "tokenize_prompt"]


class LLMEngine:
    def __init__(self, config: EngineConfig, source: ModelSource,
                 progress: Progress | None = None) -> None:
        self.config = config
        self.source = source
        started = start_engine(config, source, progress)
        self.executor = started.executor
        self.tokenizer = started.tokens.tokenizer
        # Why there is no tokenizer although the model ships one (it failed to load).
        self.tokenizer_error = started.tokens.error
        self.eos_token_ids = started.tokens.eos_token_ids
        t0 = time.perf_counter()
        self.core = EngineCore(config, started)
        self._startup_times = {**started.startup_times,
                               "scheduler": time.perf_counter() - t0}
        self.client = InprocClient(self.core)
        self.input_processor = InputProcessor(
            CoreLimits(config.scheduler.max_model_len, config.model.vocab_size,
                       self.core.scheduler.block_size,
                       self.core.scheduler.kv_cache_manager.num_usable_blocks),
            # A partial over the tokens, not the bound method: the processor must not hold
            # the engine (a cycle would keep a deleted LLM's engine alive until a full GC).
            self.tokenizer, functools.partial(started.tokens.no_tokenizer_reason,
                                              source.name))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, progress: Progress | None = None) -> LLMEngine:
        """Resolve the model (the one step that reads disk or network), build the config
        from it, then start."""
        resolved = resolve_model(args, progress)
        return cls(args.create_engine_config(resolved), resolved.source, progress)

    def default_sampling_params(self) -> SamplingParams:
        """What a request without sampling parameters gets: SamplingParams' defaults,
        overridden by the model's generation_config.json (`--generation-config`)."""
        return SamplingParams(**dict(self.config.sampling_defaults))

    # ------------------------------------------------------------------ the core's parts

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    @property
    def runner(self) -> ModelRunner:
        """The in-process model runner (uni backend); with workers (mp, ray) an
        ExecutorError, since the runners live in other processes."""
        return self.executor.runner

    @property
    def startup_times(self) -> dict[str, float]:
        """Seconds per start-up stage: the model runner's (rank 0's with workers), then
        the engine's own (tokenizer, scheduler)."""
        return {**self.executor.startup_times, **self._startup_times}

    @property
    def runner_info(self) -> RunnerInfo:
        """What rank 0's model runner reports (device, weight bytes of its shards, compile
        stats), whatever the backend: the way to read it with workers."""
        return self.executor.runner_info

    @property
    def runner_infos(self) -> tuple[RunnerInfo, ...]:
        """Every rank's `RunnerInfo`, in rank order."""
        return self.executor.runner_infos

    def check_health(self) -> None:
        """Raise `ExecutorError` (one line, naming the rank) if a worker is gone; cheap,
        runs no step."""
        self.core.check_health()

    def shutdown(self) -> None:
        """Stop the executor's workers (also done when the engine is collected and at
        exit); the engine runs no step afterwards."""
        self.client.shutdown()

    def set_phase_timer(self, timer) -> None:
        """Time every phase of the following steps (llmfast.profiling.phase_timing); None: stop."""
        self.core.set_phase_timer(timer)

    def stats(self):
        """Scheduler and prefix-cache statistics (a SchedulerStats)."""
        return self.core.scheduler.get_stats()

    # ------------------------------------------------------------------ requests

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.input_processor.tokenize(prompt)

    def no_tokenizer_reason(self) -> str:
        """Why this engine cannot take text: the tokenizer failed to load, or there is none."""
        if self.tokenizer_error is not None:
            return self.tokenizer_error
        return f"model {self.source.name} has no tokenizer files"

    def check_params(self, params: SamplingParams) -> SamplingParams:
        return self.input_processor.check_params(params)

    def check_prompt(self, ids: list[int]) -> None:
        """RequestRejected for prompt token ids that `add_request` would refuse whatever
        the parameters. Lets a caller refuse a batch before adding any of it."""
        self.input_processor.check_prompt(ids)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = True,
                    queue: deque[RequestOutput] | None = None) -> str:
        """Queue a request; returns its id. With `stream=False` it is reported only once
        it finishes (offline batches skip building an output per token). Its outputs go
        to `queue` when given (whoever steps), else `step()` returns them."""
        req_id = request_id if request_id is not None else str(next(self._ids))
        if req_id in self.output_processor.states:
            raise RequestRejected(f"request id {req_id!r} is already in use")
        text, request = self.input_processor.process(
            req_id, prompt, params or self.default_sampling_params())
        self.client.add_requests((request,))  # may raise RequestRejected
        self.output_processor.add_request(req_id, text, request.prompt_token_ids,
                                          request.sampling_params, request.arrival_time,
                                          stream, queue)
        return req_id

    def abort(self, req_id: str) -> None:
        self.abort_many((req_id,))

    def abort_many(self, req_ids: Sequence[str]) -> None:
        """Abort these requests at once (unknown or finished ids are ignored)."""
        self.client.abort_requests(req_ids)
        self.output_processor.abort_requests(req_ids)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # ------------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        """Run one step; the outputs of the requests added without a queue (those with
        one found theirs in it)."""
        core_out = self.client.step()
        if core_out is None:
            return []
        return self._process(core_out)

    def _process(self, core_out) -> list[RequestOutput]:
        with nvtx_range("detokenize", self.core.phase_timer):
            outputs, stopped = self.output_processor.process(core_out)
        if stopped:
            self.client.finish_stopped(stopped)
        return outputs

    def set_async_scheduling(self, enabled: bool) -> list[RequestOutput]:
        """Switch between the pipelined and the synchronous loop between steps (benchmarks
        compare both on one engine); returns the outputs of a step still in flight."""
        core_out = self.core.set_async_scheduling(enabled)
        return [] if core_out is None else self._process(core_out)
