"""`LLMEngine`: requests in, one scheduler step at a time, `RequestOutput`s out.

Each `step()` schedules, runs the model once, applies the sampled tokens, detokenises
incrementally and checks stop strings (which the scheduler cannot see).

With async scheduling `step()` is a two-stage pipeline with one step in flight: it
schedules and launches step N+1, then waits for step N's sampled ids and turns them into
outputs while the device runs N+1. Tokens therefore come out one `step()` call after the
step that computed them, and stop conditions apply one step late: whatever the in-flight
step computed for a request that has stopped since is dropped by the scheduler.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llmfast.config import ConfigError, EngineConfig
from llmfast.core.request import Request, RequestRejected, RequestStatus, check_prompt_length
from llmfast.core.scheduler import Scheduler
from llmfast.core.scheduler_output import PromptLogprobsChunk, SchedulerOutput
from llmfast.engine_args import EngineArgs
from llmfast.executor import Executor, create_executor
from llmfast.models.sources.model_source import ModelSource
from llmfast.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmfast.profiling.nvtx_ranges import nvtx_range
from llmfast.sampling_params import SamplingParams
from llmfast.tokenizer import Tokenizer, TokenizerError, has_tokenizer_files
from llmfast.utils.gc_freeze import hold_gc_freeze
from llmfast.utils.progress import Progress
from llmfast.utils.value_checks import int_list

if TYPE_CHECKING:
    from llmfast.worker.runner_info import RunnerInfo
    from llmfast.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict


def tokenize_prompt(prompt: Prompt, tokenizer: Tokenizer | None,
                    no_tokenizer_reason: Callable[[], str]) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of a prompt: text is encoded by `tokenizer`, token ids
    (a list, or a dict with 'prompt_token_ids' and maybe its 'prompt' text) are checked
    to be ints. RequestRejected for anything else, or for text without a tokenizer."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" not in prompt:
            raise RequestRejected("a dict prompt needs 'prompt_token_ids'")
        ids = int_list(prompt["prompt_token_ids"], "prompt token ids", RequestRejected)
        return prompt.get("prompt"), ids
    if isinstance(prompt, list):
        return None, int_list(prompt, "prompt token ids", RequestRejected)
    if not isinstance(prompt, str):
        raise RequestRejected(
            f"a prompt must be a string or token ids, not {type(prompt).__name__}")
    if tokenizer is None:
        raise RequestRejected(f"{no_tokenizer_reason()}; pass prompt_token_ids instead of text")
    return prompt, tokenizer.encode(prompt)


@dataclass
class _Tracked:
    """Engine-side state of one request: text, stop strings, metrics."""

    request: Request
    prompt: str | None
    detokenizer: object | None
    metrics: RequestMetrics
    text: str = ""
    emitted: int = 0  # chars of `text` already streamed
    # A stop string counts only if it ends past this many chars: the text of the first
    # min_tokens tokens cannot stop the request (as vLLM).
    stop_check_offset: int = 0
    stop_reason: str | int | None = None
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    # With prompt logprobs: RequestOutput's two lists, joined chunk by chunk.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    stream: bool = True  # False: an output only when the request finishes
    # Streams, and asks for no stop strings and no logprobs: a running request's decode
    # step takes _process_updates' short path.
    plain: bool = False
    # The outputs' prompt_token_ids: a list made at the first output and shared by the
    # later ones (the request keeps a tuple, which the collector does not walk: a
    # waiting request holds no list of its prompt).
    prompt_ids: list[int] | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig, source: ModelSource,
                 progress: Progress | None = None) -> None:
        self.config = config
        self.source = source
        # The model runs behind an executor: in this process (uni) or in one worker per
        # tensor-parallel rank (mp, ray). Workers boot while the tokenizer loads; they
        # are stopped if the rest of start-up fails.
        self.executor: Executor = create_executor(config, source, progress=progress)
        # Start-up seconds of the engine's own stages (the runner keeps its own).
        self._startup_times: dict[str, float] = {}
        try:
            if self.executor.late_eos_token_ids and config.chat_template is None:
                num_blocks = self._initialize_beside_tokenizer(progress)
            else:
                t0 = time.perf_counter()
                self.eos_token_ids = self._load_tokenizer()
                self._startup_times["tokenizer"] = time.perf_counter() - t0
                num_blocks = self.executor.initialize(self.eos_token_ids, progress)
        except BaseException:
            self.executor.shutdown()
            raise
        t0 = time.perf_counter()
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks)
        self._startup_times["scheduler"] = time.perf_counter() - t0
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self.async_scheduling = config.scheduler.async_scheduling
        # The launched step whose outputs the next step() reads (async scheduling only);
        # the second item is the executor's handle.
        self._in_flight: tuple[SchedulerOutput, object] | None = None
        self.phase_timer = None  # a PhaseTimer while profiling (set_phase_timer)
        # What exists now (weights' modules, tokenizer, torch and transformers internals:
        # ~400k objects) lives as long as the engine: keep it out of the collector's
        # scans (150 ms stalls otherwise) until the engine is gone.
        weakref.finalize(self, hold_gc_freeze())

    def _initialize_beside_tokenizer(self, progress: Progress | None) -> int:
        """The runner's start-up in this thread, the tokenizer's load in another. On a warm
        start the tokenizer (importing transformers: 1.6 s on an H100 machine) was a sixth
        of the time to the first token, while the runner's stages leave the interpreter
        free for much of theirs (waits on the device, graph instantiation, file reads).
        Only the wait for it after the runner's start counts as a stage
        (`tokenizer_wait`). A --chat-template loads first instead: a bad one should fail
        before the start-up's seconds, not after them."""
        loading: Future = Future()

        def load() -> None:
            t0 = time.perf_counter()
            try:
                eos_token_ids = self._load_tokenizer()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                loading.set_exception(e)
            else:
                loading.set_result((eos_token_ids, time.perf_counter() - t0))

        # A daemon: a start that fails meanwhile (or is interrupted) exits at once, not
        # after the tokenizer's load.
        threading.Thread(target=load, name="llmfast-tokenizer", daemon=True).start()
        num_blocks = self.executor.initialize((), progress)
        t0 = time.perf_counter()
        self.eos_token_ids, load_s = loading.result()
        self._startup_times["tokenizer_wait"] = time.perf_counter() - t0
        self.executor.set_eos_token_ids(self.eos_token_ids)
        logger.debug("tokenizer loaded in %.2f s beside the runner's start-up", load_s)
        return num_blocks

    def _load_tokenizer(self) -> tuple[int, ...]:
        """Load the tokenizer when the model has one; the end-of-sequence ids of the
        model's config and of its tokenizer."""
        source = self.source
        self.tokenizer = None
        # Why there is no tokenizer although the model ships one (it failed to load).
        self.tokenizer_error: str | None = None
        # Random presets carry one (models/sources/preset_tokenizer.py); a weights-only
        # directory has none and runs on token ids.
        if source.path is None or has_tokenizer_files(source.path):
            try:
                self.tokenizer = source.load_tokenizer()
            except TokenizerError as e:
                self.tokenizer_error = str(e)
                logger.info("%s; only token-id prompts will work", e)
        template = self.config.chat_template
        if template is not None:
            if self.tokenizer is None:
                raise ConfigError(f"--chat-template: {self.no_tokenizer_reason()}")
            self.tokenizer = self.tokenizer.with_chat_template(template)
        eos = tuple(source.config.eos_token_ids)
        if self.tokenizer is not None:
            eos = tuple(dict.fromkeys(eos + tuple(self.tokenizer.eos_token_ids)))
        return eos

    def default_sampling_params(self) -> SamplingParams:
        """What a request without sampling parameters gets: SamplingParams' defaults,
        overridden by the model's generation_config.json (`--generation-config`)."""
        return SamplingParams(**dict(self.config.sampling_defaults))

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
        runs no step (the server's engine thread calls it while idle)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stop the executor's workers (also done when the engine is collected and at
        exit); the engine runs no step afterwards."""
        self.executor.shutdown()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, progress: Progress | None = None) -> LLMEngine:
        config, source = args.create_engine_config(progress)
        return cls(config, source, progress)

    # ------------------------------------------------------------------ requests

    def tokenize_prompt(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return tokenize_prompt(prompt, self.tokenizer, self.no_tokenizer_reason)

    def no_tokenizer_reason(self) -> str:
        """Why this engine cannot take text: the tokenizer failed to load, or there is none."""
        if self.tokenizer_error is not None:
            return self.tokenizer_error
        return f"model {self.source.name} has no tokenizer files"

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, stream: bool = True) -> str:
        """Queue a request; returns its id. With `stream=False` `step()` reports it only
        once it finishes (offline batches skip building an output per token)."""
        params = self.check_params(params or self.default_sampling_params())
        text, ids = self.tokenize_prompt(prompt)
        self._validate_prompt(ids)
        req_id = request_id if request_id is not None else str(next(self._ids))
        if req_id in self._tracked:
            raise RequestRejected(f"request id {req_id!r} is already in use")
        request = Request(req_id, ids, params, eos_token_ids=self.eos_token_ids)
        self.scheduler.add_request(request)  # may raise RequestRejected
        detok = None
        if self.tokenizer is not None:
            from llmfast.tokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(self.tokenizer, ids)
        tracked = _Tracked(request, text, detok, RequestMetrics(arrival_time=time.monotonic()),
                           stream=stream,
                           plain=stream and not params.stop and params.logprobs is None)
        if params.prompt_logprobs is not None:
            tracked.prompt_logprobs, tracked.prompt_logprob_ranks = [None], [None]
        self._tracked[req_id] = tracked
        return req_id

    def check_params(self, params: SamplingParams) -> SamplingParams:
        """`params` as `add_request` keeps them (fitted to the model); RequestRejected for
        token ids outside the vocabulary."""
        params = params.fit_to_model(self.config.model.vocab_size,
                                     self.config.scheduler.max_model_len)
        outside = params.token_ids_outside(self.config.model.vocab_size)
        if outside is not None:
            raise RequestRejected(outside)
        return params

    def check_prompt(self, ids: list[int]) -> None:
        """RequestRejected for prompt token ids that `add_request` would refuse whatever
        the parameters: ids outside the vocabulary, a length past max-model-len, more KV
        blocks than the cache has. Lets a caller refuse a batch before adding any of it."""
        self._validate_prompt(ids)
        self.scheduler.check_prompt_fits(len(ids))

    def _validate_prompt(self, ids: list[int]) -> None:
        check_prompt_length(len(ids), self.config.scheduler.max_model_len)
        vocab = self.config.model.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestRejected(f"prompt token ids must be in [0, {vocab})")

    def abort(self, req_id: str) -> None:
        self.abort_many((req_id,))

    def abort_many(self, req_ids: Sequence[str]) -> None:
        """Abort these requests at once (unknown or finished ids are ignored): one pass
        over the waiting queue for all of them, where one abort after another would scan
        it for each."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
        for req_id in req_ids:
            tracked = self._tracked.pop(req_id, None)
            if tracked is not None and tracked.finish_reason is None:
                tracked.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def set_phase_timer(self, timer) -> None:
        """Time every phase of the following steps (llmfast.profiling.phase_timing); None: stop."""
        self.phase_timer = timer
        self.executor.set_phase_timer(timer)

    # ------------------------------------------------------------------ step

    def step(self) -> list[RequestOutput]:
        with nvtx_range("schedule", self.phase_timer):
            sched_out = self.scheduler.schedule()
        now = time.monotonic()
        for new in sched_out.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None and tracked.metrics.first_scheduled_time is None:
                tracked.metrics.first_scheduled_time = now
                tracked.num_cached_tokens = new.num_computed_tokens
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
                return []
            sched_out, pending = done
        elif pending is None:
            return []
        return self._finish_step(sched_out, pending)

    def _finish_step(self, sched_out: SchedulerOutput, pending: object
                     ) -> list[RequestOutput]:
        with nvtx_range("wait_output", self.phase_timer):
            runner_out = self.executor.collect(pending)
        if runner_out.prompt_logprobs:
            self._add_prompt_logprobs(sched_out.step_index, runner_out.prompt_logprobs)
        with nvtx_range("update", self.phase_timer):
            updates = self.scheduler.update(sched_out, runner_out)
        with nvtx_range("detokenize", self.phase_timer):
            return self._process_updates(updates)

    def _add_prompt_logprobs(self, step_index: int,
                             chunks: dict[str, PromptLogprobsChunk]) -> None:
        """Append a step's prompt-logprob chunks to their requests' lists. A request
        preempted mid-prompt computes its prompt again from the start (it takes no
        prefix-cache hits): the tokens it already holds are skipped."""
        for req_id, chunk in chunks.items():
            tracked = self._tracked.get(req_id)
            # Gone, or a later request that reuses the id.
            if tracked is None or tracked.request.first_step > step_index:
                continue
            entries, ranks = tracked.prompt_logprobs, tracked.prompt_logprob_ranks
            skip = len(entries) - chunk.first_index
            if skip < 0:
                raise RuntimeError(f"request {req_id}: prompt logprobs from token "
                                   f"{chunk.first_index}, {len(entries)} expected")
            start = chunk.first_index
            tokens = tracked.request.prompt_token_ids[start:start + len(chunk.logprobs)]
            for token, lp, rank, top_ids, top_lps in itertools.islice(zip(
                    tokens, chunk.logprobs, chunk.ranks, chunk.top_ids, chunk.top_logprobs),
                    skip, None):
                entry = {token: lp}
                for t, v in zip(top_ids, top_lps):
                    entry.setdefault(t, v)
                entries.append(entry)
                ranks.append(rank)

    def set_async_scheduling(self, enabled: bool) -> list[RequestOutput]:
        """Switch between the pipelined and the synchronous loop between steps (benchmarks
        compare both on one engine); returns the outputs of a step still in flight."""
        outputs: list[RequestOutput] = []
        if not enabled and self._in_flight is not None:
            done, self._in_flight = self._in_flight, None
            outputs = self._finish_step(*done)
        self.async_scheduling = enabled
        return outputs

    def _process_updates(self, updates) -> list[RequestOutput]:
        # Per request and step on the host (hundreds of requests per step): attribute
        # lookups hoisted, the stop-string and logprob work only for requests asking.
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        get_tracked = self._tracked.get
        make_output = self._make_output
        for upd in updates:
            tracked = get_tracked(upd.req_id)
            if tracked is None:
                continue
            new_ids = upd.new_token_ids
            if tracked.plain and upd.finish_reason is None and len(new_ids) == 1:
                # A decode step of a running streaming request without stop strings or
                # logprobs (the common case): the general path below, cut to what it
                # does then.
                m = tracked.metrics
                if m.first_token_time is None:
                    m.first_token_time = now
                m.token_times.append(now)
                detok = tracked.detokenizer
                if detok is not None:
                    delta = detok.add_tokens(new_ids)
                    if delta:
                        tracked.text += delta
                outputs.append(make_output(tracked, new_ids, False))
                continue
            request = tracked.request
            params = request.sampling_params
            stops = params.stop
            if new_ids:
                m = tracked.metrics
                if m.first_token_time is None:
                    m.first_token_time = now
                if len(new_ids) == 1:
                    m.token_times.append(now)
                else:
                    m.token_times.extend([now] * len(new_ids))
                detok = tracked.detokenizer
                if detok is not None:
                    if tracked.stream or stops:
                        delta = detok.add_tokens(new_ids)
                        if delta:
                            tracked.text += delta
                    else:  # text read only at the end: decoded then, in one go (flush)
                        detok.append(new_ids)
                if upd.logprobs:
                    if tracked.logprobs is None:
                        tracked.logprobs = []
                    for (token, (lp, top)) in zip(new_ids, upd.logprobs):
                        tracked.logprobs.append({token: lp, **{t: v for t, v in top.items() if t != token}})
            finish = upd.finish_reason
            if finish is None and not stops:  # the common case: a running request
                if tracked.stream:
                    outputs.append(make_output(tracked, new_ids, False))
                continue
            if finish is not None and tracked.detokenizer is not None:
                tracked.text += tracked.detokenizer.flush()  # text held back mid-character
            if stops:
                if len(request.output_token_ids) <= request.min_tokens:
                    tracked.stop_check_offset = len(tracked.text)
                if self._hit_stop_string(tracked):
                    if finish is None:
                        stopped.append(upd.req_id)  # the scheduler still runs it
                    finish = "stop"
            if finish == "stop" and tracked.stop_reason is None and request.output_token_ids:
                last = request.output_token_ids[-1]
                if last in params.stop_token_ids:
                    tracked.stop_reason = last
            if finish is not None:
                tracked.finish_reason = finish
                tracked.metrics.finish_time = now
            elif not tracked.stream:
                continue
            outputs.append(make_output(tracked, new_ids, finish is not None))
            if finish is not None:
                del self._tracked[upd.req_id]
        if stopped:
            self.scheduler.finish_requests(stopped, "stop")
        return outputs

    def _hit_stop_string(self, tracked: _Tracked) -> bool:
        stops = tracked.request.sampling_params.stop
        if not stops or not tracked.text:
            return False
        # Only the tail can hold a new match: what the last step added, plus the
        # longest stop string's length of earlier text.
        window = max(map(len, stops)) + 64
        start = max(0, len(tracked.text) - window)
        best = None
        for stop in stops:
            idx = tracked.text.find(stop, max(start, tracked.stop_check_offset - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return False
        keep = len(best[1]) if tracked.request.sampling_params.include_stop_str_in_output else 0
        tracked.text = tracked.text[: best[0] + keep]
        tracked.stop_reason = best[1]
        return True

    @staticmethod
    def _make_output(tracked: _Tracked, new_ids: list[int], finished: bool) -> RequestOutput:
        """`new_ids`: the step's ids, the output's delta (the scheduler's list, read by
        nobody else: not copied)."""
        request = tracked.request
        params = request.sampling_params
        text = tracked.text
        # Hold back a possible stop-string prefix while streaming.
        stops = params.stop
        emitted = tracked.emitted
        if finished or not stops:
            visible = len(text)
        else:
            visible = max(emitted, len(text) - max(map(len, stops)) + 1)
        delta = text[emitted:visible] if visible != emitted else ""
        tracked.emitted = visible
        logprobs = None
        if params.logprobs is not None:
            logprobs = list(tracked.logprobs or [])
        # Positional (the fields' order): faster than keywords, per request and step.
        completion = CompletionOutput(
            0,  # index
            text if visible == len(text) else text[:visible],
            # While running this is the request's live list (copying it every step would
            # make streaming quadratic); a finished request's list is its own copy.
            list(request.output_token_ids) if finished else request.output_token_ids,
            tracked.finish_reason,
            tracked.stop_reason,
            logprobs,
            delta,  # delta_text
            new_ids,  # delta_token_ids
        )
        prompt_ids = tracked.prompt_ids
        if prompt_ids is None:
            prompt_ids = tracked.prompt_ids = list(request.prompt_token_ids)
        return RequestOutput(
            request.request_id,
            tracked.prompt,
            prompt_ids,
            [completion],
            finished,
            tracked.metrics,
            tracked.num_cached_tokens,
            tracked.prompt_logprobs,
            tracked.prompt_logprob_ranks,
        )

    def stats(self):
        """Scheduler and prefix-cache statistics (a SchedulerStats)."""
        return self.scheduler.get_stats()
