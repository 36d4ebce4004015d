"""`EngineCore`: requests in (token ids, checked), one scheduler step at a time, token ids
out. No tokenizer, no text: what the frontends (the in-process `LLMEngine`, the server's
API processes) make of the ids is the output processor's work.

With async scheduling `step()` is a two-stage pipeline with one step in flight: it
schedules and launches step N+1, then waits for step N's sampled ids and turns them into
outputs while the device runs N+1. Tokens therefore come out one `step()` call after the
step that computed them, and stop conditions apply one step late: whatever the in-flight
step computed for a request that has stopped since is dropped by the scheduler.

One implementation serves every client: `LLM` and `chat` call it in their own process
(core_client.InprocClient), `serve` runs it in a process of its own
(core_process.EngineCoreProc).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from llmfast.config import EngineConfig
from llmfast.core.request import Request, RequestStatus
from llmfast.core.scheduler import Scheduler
from llmfast.core.scheduler_output import SchedulerOutput
from llmfast.engine.messages import EngineCoreOutputs, EngineCoreRequest, StepStats
from llmfast.profiling.nvtx_ranges import nvtx_range
from llmfast.utils.gc_freeze import hold_gc_freeze

if TYPE_CHECKING:
    from llmfast.engine.startup import Started

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, started: Started) -> None:
        self.config = config
        self.executor = started.executor
        self.eos_token_ids = started.tokens.eos_token_ids
        spec = config.speculative
        self.scheduler = Scheduler(config.scheduler, config.cache, started.num_blocks,
                                   config.model.kv_sliding_window,
                                   num_lookahead_slots=0 if spec is None
                                   else spec.num_lookahead_slots)
        self.async_scheduling = config.scheduler.async_scheduling
        # The launched step whose outputs the next step() reads (async scheduling only);
        # the second item is the executor's handle.
        self._in_flight: tuple[SchedulerOutput, object] | None = None
        # Requests scheduled for the first time, not reported in an output yet.
        self._scheduled: list[tuple[str, int]] = []
        self.num_steps = 0
        self.phase_timer = None  # a PhaseTimer while profiling (set_phase_timer)
        # What exists now (weights' modules, torch and transformers internals: ~400k
        # objects) lives as long as the core: keep it out of the collector's scans
        # (150 ms stalls otherwise) until the core is gone.
        weakref.finalize(self, hold_gc_freeze())

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a checked request (RequestRejected if its id is in use, or it cannot fit)."""
        self.scheduler.add_request(Request(
            request.request_id, request.prompt_token_ids, request.sampling_params,
            eos_token_ids=self.eos_token_ids, arrival_time=request.arrival_time))

    def check_prompt_fits(self, num_tokens: int) -> None:
        self.scheduler.check_prompt_fits(num_tokens)

    def abort_requests(self, req_ids: Iterable[str]) -> None:
        """Abort these requests at once (unknown or finished ids are ignored)."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: Sequence[str], reason: str) -> None:
        """End requests a frontend found finished (a stop string)."""
        self.scheduler.finish_requests(req_ids, reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> StepStats:
        s = self.scheduler.get_stats()
        return StepStats(s.num_running_reqs, s.num_waiting_reqs, s.num_preemptions,
                         s.prefix_cache_queries, s.prefix_cache_hits,
                         s.prefix_cache_hit_rate, s.kv_cache_usage, self.num_steps,
                         s.spec_num_draft_tokens, s.spec_num_accepted_tokens,
                         s.spec_num_verify_steps)

    def set_phase_timer(self, timer) -> None:
        self.phase_timer = timer
        self.executor.set_phase_timer(timer)

    def check_health(self) -> None:
        """Raise `ExecutorError` (one line, naming the rank) if a worker is gone."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ------------------------------------------------------------------ step

    def step(self) -> EngineCoreOutputs | None:
        """Schedule and launch a step; the outputs of the step that finished (this one,
        or with async scheduling the one before), None when no step finished."""
        with nvtx_range("schedule", self.phase_timer):
            sched_out = self.scheduler.schedule()
        self.num_steps += 1
        for new in sched_out.scheduled_new_reqs:
            self._scheduled.append((new.req_id, new.num_computed_tokens))
        # Whether this call collects right after the launch (the previous call's step when
        # pipelined, this one otherwise): the executor may then ask its workers for those
        # tokens along with this step (one message per worker and step).
        then_collect = (self._in_flight is not None if self.async_scheduling
                        else bool(sched_out.total_num_scheduled_tokens))
        pending = self.executor.execute_async(sched_out, then_collect)
        if self.async_scheduling:
            # Read the step launched by the previous call while this one runs.
            done, self._in_flight = self._in_flight, (
                None if pending is None else (sched_out, pending))
            if done is None:
                return None
            sched_out, pending = done
        elif pending is None:
            return None
        return self._finish_step(sched_out, pending)

    def set_async_scheduling(self, enabled: bool) -> EngineCoreOutputs | None:
        """Switch between the pipelined and the synchronous loop between steps; the
        outputs of a step still in flight."""
        if enabled and self.config.speculative is not None:
            raise ValueError("async scheduling does not run with speculative decoding (the "
                             "next step depends on how many drafts were accepted)")
        outputs = None
        if not enabled and self._in_flight is not None:
            done, self._in_flight = self._in_flight, None
            outputs = self._finish_step(*done)
        self.async_scheduling = enabled
        return outputs

    def _finish_step(self, sched_out: SchedulerOutput, pending: object) -> EngineCoreOutputs:
        with nvtx_range("wait_output", self.phase_timer):
            runner_out = self.executor.collect(pending)
        outputs = EngineCoreOutputs()
        if runner_out.prompt_logprobs:  # before the update: it forgets finished requests
            requests = self.scheduler.requests
            for req_id, c in runner_out.prompt_logprobs.items():
                request = requests.get(req_id)
                # Gone, or a later request that reuses the id.
                if request is None or request.first_step > sched_out.step_index:
                    continue
                outputs.prompt_logprobs[req_id] = (c.first_index, c.logprobs, c.ranks,
                                                   c.top_ids, c.top_logprobs)
        with nvtx_range("update", self.phase_timer):
            updates = self.scheduler.update(sched_out, runner_out)
        req_ids, new_ids = outputs.req_ids, outputs.new_token_ids
        for upd in updates:
            if upd.finish_reason is not None:
                outputs.finish_reasons[len(req_ids)] = upd.finish_reason
            if upd.logprobs:
                outputs.logprobs[len(req_ids)] = (
                    [lp for lp, _ in upd.logprobs],
                    [list(top) for _, top in upd.logprobs],
                    [list(top.values()) for _, top in upd.logprobs])
            req_ids.append(upd.req_id)
            new_ids.append(upd.new_token_ids)
        if self._scheduled:
            outputs.scheduled, self._scheduled = self._scheduled, []
        return outputs
