"""`Frontend`: what the HTTP side (api/) uses of the engine, in a server process that holds
the tokenizer and talks to the engine core in its own process (`MPClient`).

It owns a request's life outside the core: its prompts are tokenized on the prompt
preparer's threads, checked by the `InputProcessor` (a request the core would refuse is
refused here, as a 400: it never reaches the core's process), then sent to the core as
one message per HTTP request; the core's per-step messages of token ids go through the
`OutputProcessor` (detokenizing, stop strings, logprobs) and become a `ChoiceDelta` per
choice, queued on the HTTP request's `DeltaQueue`. Everything here runs on the event
loop's thread but the client's I/O thread (receiving and decoding) and the preparer's.

Faults: the core's process ending, or the core stopping for good (a worker died), ends
every live request with a 503 error event, /health answers 503 with the cause from then
on, and `on_failure` (the server's "exit now") is called. `stop()` (SIGTERM, Ctrl-C)
ends every live request with a 503 naming the shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llmfast.engine.core_client import MPClient
from llmfast.engine.processing.tokenizer import FrontendTokenizer
from llmfast.engine.processing.input_processor import CoreLimits, InputProcessor
from llmfast.engine.messages import CoreMessage, EngineCoreOutputs, EngineCoreRequest, StepStats
from llmfast.engine.processing.output_processor import OutputProcessor
from llmfast.outputs import RequestOutput
from llmfast.sampling_params import SamplingParams
from llmfast.serve.api.tool_parsers import parser_for
from llmfast.serve.preparer_commands import AddCommand, QueryCommand
from llmfast.serve.prompt_preparer import PromptPreparer, PromptRules, job_chars
from llmfast.serve.frontend_types import (
    ChoiceDelta,
    DeltaQueue,
    EngineUnavailable,
    Limits,
    PreparedPrompt,
    PromptInput,
    Query,
    StreamError,
    TokenLogprob,
    check_open,
)

logger = logging.getLogger(__name__)

# A job with at most this much prompt (characters, token ids) is prepared on the event
# loop at once: handing it to a tokenizing thread and back costs two GIL hand-overs (up
# to a switch interval each while the loop is busy streaming), which at 256 requests
# arriving together added seconds to their first tokens on the CPU VM.
INLINE_JOB_CHARS = 4096


@dataclass(frozen=True)
class FrontendSpec:
    """What a frontend needs to start (pickled to each API server process)."""

    model_name: str
    limits: Limits
    core_limits: CoreLimits
    tokens: FrontendTokenizer
    stats: StepStats
    input_address: str
    output_address: str
    core_pid: int


def api_limits(config, tokens: FrontendTokenizer, tool_call_parser: str | None = None
               ) -> Limits:
    scheduler = config.scheduler
    tokenizer = tokens.tokenizer
    return Limits(max_n=scheduler.max_num_seqs, max_model_len=scheduler.max_model_len,
                  sampling_defaults=config.sampling_defaults,
                  vocab_size=config.model.vocab_size,
                  max_prompt_chars=None if tokenizer is None
                  else tokenizer.prompt_chars_bound(scheduler.max_model_len),
                  tool_call_parser=tool_call_parser or parser_for(
                      config.model.architecture,
                      None if tokenizer is None else tokenizer.template_text))


@dataclass(slots=True)
class _Route:
    stream: DeltaQueue  # where this choice's outputs go
    index: int
    num_logprobs: int | None  # top-k asked for, None: no logprobs
    num_prompt_logprobs: int | None = None  # the same for the prompt's tokens
    logprobs_sent: int = 0
    prompt_sent: bool = False


class Frontend:
    def __init__(self, spec: FrontendSpec, index: int = 0) -> None:
        self.spec = spec
        self.index = index
        self.limits = spec.limits
        self.failure: str | None = None
        self.stats = spec.stats
        self.num_steps = spec.stats.num_steps
        self.on_failure: Callable[[], None] | None = None
        tokenizer = spec.tokens.tokenizer
        reason = spec.tokens.no_tokenizer_reason(spec.model_name)
        self.input_processor = InputProcessor(spec.core_limits, tokenizer, lambda: reason)
        self.output_processor = OutputProcessor(tokenizer)
        self._tokenizer = tokenizer
        self._routes: dict[str, _Route] = {}  # engine request id -> where its outputs go
        # Engine ids of adds being tokenized, and those of them aborted meanwhile.
        self._unapplied: set[str] = set()
        self._cancelled: set[str] = set()
        self._token_texts: dict[int, str] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._rules = PromptRules(tokenizer, reason, spec.model_name,
                                  spec.core_limits.max_model_len, own_copy=False)
        self._preparer = PromptPreparer(tokenizer, reason, spec.model_name,
                                        spec.core_limits.max_model_len, self._prepared_ready,
                                        self._add_cancelled)
        self._client = MPClient(spec.input_address, spec.output_address, index, spec.core_pid,
                                self._from_io_thread)
        self._started = False
        self._stopping = False

    # ------------------------------------------------------------------ EngineFront

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._preparer.start()
        self._client.start()
        self._started = True

    @property
    def running(self) -> bool:
        return self._started and not self._stopping and self.failure is None

    async def add(self, stream: DeltaQueue, prompts: Sequence[PromptInput],
                  params: Sequence[SamplingParams], *, with_text: bool = False,
                  check_length: bool = False) -> list[PreparedPrompt]:
        """Tokenise the prompts and queue `len(params)` engine requests (the choices,
        prompt-major). Raises what the input processor refuses (ValueError: a 400)."""
        check_open(self)
        done = self._loop.create_future()
        command = AddCommand(stream, tuple(prompts), tuple(params), done, with_text,
                             check_length)
        if job_chars(command) <= INLINE_JOB_CHARS:
            prepared = self._rules.prepare_add(command)
            self._apply_add(command, prepared)
            return prepared
        self._unapplied.update(stream.engine_ids)
        self._preparer.submit(command)
        return await done

    async def query(self, query: Query) -> list[int] | str:
        check_open(self)
        done = self._loop.create_future()
        command = QueryCommand(query, done)
        if job_chars(command) <= INLINE_JOB_CHARS:
            return self._rules.run_query(query)
        self._preparer.submit(command)
        return await done

    def abort(self, engine_ids: Sequence[str]) -> None:
        added = []
        for req_id in engine_ids:
            if self._routes.pop(req_id, None) is not None:
                added.append(req_id)
            elif req_id in self._unapplied:
                self._cancelled.add(req_id)
        if added:
            self.output_processor.abort_requests(added)
            if self.failure is None:
                self._client.abort_requests(added)

    def stop(self, message: str = "the server is shutting down") -> None:
        """Accept no more requests; end every live one with a 503 error event."""
        if self._stopping:
            return
        self._stopping = True
        self._fail_all(message)

    def stop_threadsafe(self, message: str = "the server is shutting down") -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.stop, message)

    def join(self, timeout: float | None = None) -> None:
        self._client.shutdown()

    # ------------------------------------------------------------------ adds

    def _add_cancelled(self, command: AddCommand) -> bool:
        return command.stream.engine_ids[0] in self._cancelled or self._stopping

    def _prepared_ready(self) -> None:  # a preparer thread
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._take_prepared)

    def _take_prepared(self) -> None:
        while (ready := self._preparer.take_query()) is not None:
            _resolve(ready.command.done, ready.result, ready.error)
        while (ready := self._preparer.take_add()) is not None:
            command = ready.command
            ids = command.stream.engine_ids
            try:
                if ready.error is not None:
                    raise ready.error
                self._apply_add(command, ready.result)
            except BaseException as e:  # noqa: BLE001 - the handler's 400, 503 or 500
                self._unapplied.difference_update(ids)
                self._cancelled.difference_update(ids)
                _resolve(command.done, None, e)
            else:
                _resolve(command.done, ready.result, None)

    def _apply_add(self, command: AddCommand, prepared: list[PreparedPrompt]) -> None:
        """Check every choice as the core would, then send them all in one message."""
        check_open(self)
        for prompt in prepared:
            self.input_processor.check_prompt(list(prompt.token_ids))
        checked = {id(p): self.input_processor.check_params(p)
                   for p in {id(p): p for p in command.params}.values()}
        stream, ids = command.stream, command.stream.engine_ids
        per_prompt = len(command.params) // len(prepared)
        now = time.monotonic()
        requests = []
        for i, req_id in enumerate(ids):
            self._unapplied.discard(req_id)
            if req_id in self._cancelled:
                self._cancelled.discard(req_id)
                continue
            params = checked[id(command.params[i])]
            prompt = prepared[i // per_prompt]
            token_ids = list(prompt.token_ids)
            requests.append(EngineCoreRequest(req_id, token_ids, params, now, self.index))
            self.output_processor.add_request(req_id, prompt.text, token_ids, params, now)
            self._routes[req_id] = _Route(stream, i, params.logprobs, params.prompt_logprobs)
        if requests:
            self._client.add_requests(requests)

    # ------------------------------------------------------------------ outputs

    def _from_io_thread(self, kind: CoreMessage, payload: Any) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._on_message, kind, payload)

    def _on_message(self, kind: CoreMessage, payload: Any) -> None:
        if kind == CoreMessage.OUTPUTS:
            self._on_outputs(payload)
        elif kind == CoreMessage.READY:
            self.stats, self.num_steps = payload, payload.num_steps
        elif kind == CoreMessage.FAILED and self.failure is None:
            self.failure = payload
            logger.error("the engine stopped: %s", payload)
            self._fail_all(f"the engine stopped: {payload}")
            if self.on_failure is not None:
                self.on_failure()

    def _on_outputs(self, core_out: EngineCoreOutputs) -> None:
        if core_out.stats is not None:
            self.stats, self.num_steps = core_out.stats, core_out.stats.num_steps
        if core_out.errors:
            for req_id, (message, status) in core_out.errors.items():
                route = self._routes.pop(req_id, None)
                self.output_processor.abort_requests((req_id,))
                if route is not None:
                    route.stream.put(StreamError(message, status))
        outputs, stopped = self.output_processor.process(core_out)
        if stopped:
            self._client.finish_stopped(stopped)
        routes = self._routes
        for out in outputs:
            route = routes.get(out.request_id)
            if route is None:  # aborted since the step was scheduled
                continue
            route.stream.put(self._delta(route, out))
            if out.finished:
                del routes[out.request_id]

    def _delta(self, route: _Route, out: RequestOutput) -> ChoiceDelta:
        completion = out.outputs[0]
        logprobs = None
        if route.num_logprobs is not None and completion.logprobs is not None:
            new = completion.logprobs[route.logprobs_sent:]
            route.logprobs_sent += len(new)
            logprobs = tuple(self._token_logprob(entry, route.num_logprobs) for entry in new)
        prompt_logprobs = None
        if route.num_prompt_logprobs is not None and not route.prompt_sent:
            # Complete by the first output: the prompt is scored before the first token.
            route.prompt_sent = True
            prompt_logprobs = self._prompt_logprobs(out, route.num_prompt_logprobs)
        # Positional, in the fields' order: per streaming request and step.
        return ChoiceDelta(
            route.index, completion.delta_text, len(completion.delta_token_ids),
            len(completion.token_ids), out.num_cached_tokens, logprobs,
            completion.finish_reason, completion.stop_reason, prompt_logprobs)

    def _token_logprob(self, entry: dict[int, float], k: int, rank: int | None = None
                       ) -> TokenLogprob:
        # The processor's entry: the sampled (or prompt) token first, then the top-k.
        sampled, lp = next(iter(entry.items()))
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        return TokenLogprob(self._token_text(sampled), sampled, lp,
                            tuple((self._token_text(t), t, v) for t, v in top), rank)

    def _prompt_logprobs(self, out: RequestOutput, k: int) -> tuple[TokenLogprob, ...]:
        first = out.prompt_token_ids[0]
        head = TokenLogprob(self._token_text(first), first, None, ())
        return (head, *(self._token_logprob(entry, k, rank) for entry, rank in zip(
            out.prompt_logprobs[1:], out.prompt_logprob_ranks[1:])))

    def _token_text(self, token_id: int) -> str:
        # Memoised (at most the vocabulary): a scored prompt decodes (n + 1) ids a token.
        text = self._token_texts.get(token_id)
        if text is None:
            tokenizer = self._tokenizer
            text = (f"token_id:{token_id}" if tokenizer is None
                    else tokenizer.decode([token_id], skip_special_tokens=False))
            self._token_texts[token_id] = text
        return text

    def _fail_all(self, message: str) -> None:
        """End every live request and every add not applied yet with a 503."""
        routes, self._routes = self._routes, {}
        if routes:
            self.output_processor.abort_requests(list(routes))
            if self.failure is None:
                with contextlib.suppress(Exception):
                    self._client.abort_requests(list(routes))
        error = StreamError(message, 503)
        for stream in {id(r.stream): r.stream for r in routes.values()}.values():
            stream.put(error)
        for command in self._preparer.close():
            _resolve(command.done, None, EngineUnavailable(message))
        self._unapplied.clear()
        self._cancelled.clear()


def _resolve(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    if future.done():  # the handler went away meanwhile; its ids get aborted anyway
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
