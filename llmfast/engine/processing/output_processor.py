"""`OutputProcessor`: the engine core's token ids made into `RequestOutput`s, on the
frontend's side: incremental detokenizing, stop strings (which the core cannot see),
logprobs and prompt logprobs as dicts, metrics, and each output routed to its request's
caller. A request a stop string ends is reported back (`ProcessedOutputs.stopped`) for
the caller to finish in the core.

Routing (vLLM's `RequestState.queue`): a request added with a queue gets its outputs
appended there, whoever runs `process` (`LLM`'s callers share one engine, and the one
that steps it serves the others: llm.py); one added without gets them in `process`'
returned list (`LLMEngine.step()`'s caller, the server's frontend).

Per request and step on the host (hundreds of requests per step): attribute lookups are
hoisted, and the stop-string and logprob work is done only for requests that ask.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from llmfast.engine.processing.detokenizer import IncrementalDetokenizer
from llmfast.engine.messages import EngineCoreOutputs
from llmfast.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmfast.sampling_params import SamplingParams
from llmfast.tokenizer import Tokenizer


@dataclass
class RequestState:
    """The frontend's state of one request: text, stop strings, metrics."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None
    metrics: RequestMetrics
    output_token_ids: list[int]
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
    # step takes `process`' short path.
    plain: bool = False
    # Where its outputs go: its caller's queue, or (None) `process`' returned list.
    queue: deque[RequestOutput] | None = None


class ProcessedOutputs(NamedTuple):
    outputs: list[RequestOutput]  # of the requests without a queue
    stopped: list[str]  # ended by a stop string here: to finish in the core


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float, stream: bool = True,
                    queue: deque[RequestOutput] | None = None) -> RequestState:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
        state = RequestState(request_id, prompt, prompt_token_ids, params, detok,
                             RequestMetrics(arrival_time=arrival_time), [], stream=stream,
                             plain=stream and not params.stop and params.logprobs is None,
                             queue=queue)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs, state.prompt_logprob_ranks = [None], [None]
        self.states[request_id] = state
        return state

    def abort_requests(self, req_ids) -> None:
        for req_id in req_ids:
            state = self.states.pop(req_id, None)
            if state is not None and state.finish_reason is None:
                state.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        return bool(self.states)

    def process(self, core_out: EngineCoreOutputs) -> ProcessedOutputs:
        now = time.monotonic()
        states = self.states
        get_state = states.get
        if core_out.scheduled:
            for req_id, num_cached in core_out.scheduled:
                state = get_state(req_id)
                if state is not None and state.metrics.first_scheduled_time is None:
                    state.metrics.first_scheduled_time = now
                    state.num_cached_tokens = num_cached
        if core_out.prompt_logprobs:
            self._add_prompt_logprobs(core_out.prompt_logprobs)
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        make_output = _make_output
        finish_reasons = core_out.finish_reasons
        logprobs = core_out.logprobs
        for i, (req_id, new_ids) in enumerate(zip(core_out.req_ids, core_out.new_token_ids)):
            state = get_state(req_id)
            if state is None:
                continue
            if state.plain and len(new_ids) == 1 and (not finish_reasons
                                                      or i not in finish_reasons):
                # A decode step of a running streaming request without stop strings or
                # logprobs (the common case): the general path below, cut to what it
                # does then.
                m = state.metrics
                if m.first_token_time is None:
                    m.first_token_time = now
                m.token_times.append(now)
                state.output_token_ids.append(new_ids[0])
                detok = state.detokenizer
                if detok is not None:
                    delta = detok.add_tokens(new_ids)
                    if delta:
                        state.text += delta
                out = make_output(state, new_ids, False)
                (outputs if state.queue is None else state.queue).append(out)
                continue
            params = state.params
            stops = params.stop
            if new_ids:
                m = state.metrics
                if m.first_token_time is None:
                    m.first_token_time = now
                if len(new_ids) == 1:
                    m.token_times.append(now)
                else:
                    m.token_times.extend([now] * len(new_ids))
                state.output_token_ids.extend(new_ids)
                detok = state.detokenizer
                if detok is not None:
                    if state.stream or stops:
                        delta = detok.add_tokens(new_ids)
                        if delta:
                            state.text += delta
                    else:  # text read only at the end: decoded then, in one go (flush)
                        detok.append(new_ids)
                if logprobs and i in logprobs:
                    self._add_logprobs(state, new_ids, logprobs[i])
            finish = finish_reasons.get(i) if finish_reasons else None
            if finish is None and not stops:  # the common case: a running request
                if state.stream:
                    out = make_output(state, new_ids, False)
                    (outputs if state.queue is None else state.queue).append(out)
                continue
            if finish is not None and state.detokenizer is not None:
                state.text += state.detokenizer.flush()  # text held back mid-character
            if stops:
                if len(state.output_token_ids) <= params.min_tokens:
                    state.stop_check_offset = len(state.text)
                if _hit_stop_string(state):
                    if finish is None:
                        stopped.append(req_id)  # the core still runs it
                    finish = "stop"
            if finish == "stop" and state.stop_reason is None and state.output_token_ids:
                last = state.output_token_ids[-1]
                if last in params.stop_token_ids:
                    state.stop_reason = last
            if finish is not None:
                state.finish_reason = finish
                state.metrics.finish_time = now
            elif not state.stream:
                continue
            out = make_output(state, new_ids, finish is not None)
            (outputs if state.queue is None else state.queue).append(out)
            if finish is not None:
                del states[req_id]
        return ProcessedOutputs(outputs, stopped)

    @staticmethod
    def _add_logprobs(state: RequestState, new_ids: list[int], entry) -> None:
        sampled, top_ids, top_lps = entry
        if state.logprobs is None:
            state.logprobs = []
        for token, lp, ids, lps in zip(new_ids, sampled, top_ids, top_lps):
            d = {token: lp}
            for t, v in zip(ids, lps):
                if t != token:
                    d[t] = v
            state.logprobs.append(d)

    def _add_prompt_logprobs(self, chunks: dict) -> None:
        """Append a step's prompt-logprob chunks to their requests' lists. A request
        preempted mid-prompt computes its prompt again from the start (it takes no
        prefix-cache hits): the tokens it already holds are skipped."""
        for req_id, (first_index, lps, ranks, top_ids, top_lps) in chunks.items():
            state = self.states.get(req_id)
            if state is None or state.prompt_logprobs is None:
                continue
            entries, rank_list = state.prompt_logprobs, state.prompt_logprob_ranks
            skip = len(entries) - first_index
            if skip < 0:
                raise RuntimeError(f"request {req_id}: prompt logprobs from token "
                                   f"{first_index}, {len(entries)} expected")
            tokens = state.prompt_token_ids[first_index:first_index + len(lps)]
            for token, lp, rank, ids, values in itertools.islice(
                    zip(tokens, lps, ranks, top_ids, top_lps), skip, None):
                entry = {token: lp}
                for t, v in zip(ids, values):
                    entry.setdefault(t, v)
                entries.append(entry)
                rank_list.append(rank)


def _hit_stop_string(state: RequestState) -> bool:
    stops = state.params.stop
    if not stops or not state.text:
        return False
    # Only the tail can hold a new match: what the last step added, plus the
    # longest stop string's length of earlier text.
    window = max(map(len, stops)) + 64
    start = max(0, len(state.text) - window)
    best = None
    for stop in stops:
        idx = state.text.find(stop, max(start, state.stop_check_offset - len(stop) + 1))
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return False
    keep = len(best[1]) if state.params.include_stop_str_in_output else 0
    state.text = state.text[: best[0] + keep]
    state.stop_reason = best[1]
    return True


def _make_output(state: RequestState, new_ids: list[int], finished: bool) -> RequestOutput:
    """`new_ids`: the step's ids, the output's delta (read by nobody else: not copied)."""
    params = state.params
    text = state.text
    # Hold back a possible stop-string prefix while streaming.
    stops = params.stop
    emitted = state.emitted
    if finished or not stops:
        visible = len(text)
    else:
        visible = max(emitted, len(text) - max(map(len, stops)) + 1)
    delta = text[emitted:visible] if visible != emitted else ""
    state.emitted = visible
    logprobs = None
    if params.logprobs is not None:
        logprobs = list(state.logprobs or [])
    # Positional (the fields' order): faster than keywords, per request and step.
    completion = CompletionOutput(
        0,  # index
        text if visible == len(text) else text[:visible],
        # While running this is the request's live list (copying it every step would
        # make streaming quadratic); a finished request's list is its own.
        state.output_token_ids,
        state.finish_reason,
        state.stop_reason,
        logprobs,
        delta,  # delta_text
        new_ids,  # delta_token_ids
    )
    return RequestOutput(
        state.request_id,
        state.prompt,
        state.prompt_token_ids,
        [completion],
        finished,
        state.metrics,
        state.num_cached_tokens,
        state.prompt_logprobs,
        state.prompt_logprob_ranks,
    )
