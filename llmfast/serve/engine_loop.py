"""The engine's side of the server: one loop owns `LLMEngine`, applies the HTTP side's
commands (add, abort, stop) between steps, steps while any request is live, and hands
each step's news back as `ChoiceDelta`s, one batch per step.

`EngineLoop` is that loop, whatever carries the commands and the outputs. Two carriers:

- `AsyncEngine` (this module): the loop on a thread of the HTTP server's process; commands
  through a queue, outputs onto the event loop with one `call_soon_threadsafe` per step.
- `ProcessEngineLoop` (engine_host.py, `--api-servers N`): the loop in the main process,
  the HTTP servers in N processes of their own, commands and outputs over pipes, so the
  HTTP work (JSON, SSE, sockets) never holds the engine's GIL.

Why one owner and not `asyncio.to_thread(engine.step)` per step: the engine is not
thread-safe, so every touch (adding, aborting, tokenising, detokenising logprob tokens,
reading stats) must come from one place. Concurrent HTTP requests land in the same
`engine.step()` calls: continuous batching comes from the engine's scheduler, this file
only feeds it. The engine's `RequestOutput` holds live lists that the next step mutates,
so only frozen `ChoiceDelta`s leave the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llmfast.engine import LLMEngine
from llmfast.executor import ExecutorError
from llmfast.outputs import RequestOutput
from llmfast.sampling_params import SamplingParams
from llmfast.serve.stream import (  # noqa: F401 - re-exported: the serve API's names
    ChatPrompt,
    ChoiceDelta,
    ContextLengthExceeded,
    DetokenizeQuery,
    EngineUnavailable,
    Limits,
    PreparedPrompt,
    PromptInput,
    Query,
    RequestStream,
    StreamError,
    check_open,
    TokenizeQuery,
    TokenLogprob,
)

logger = logging.getLogger(__name__)

# How often an idle engine loop checks that its workers are alive (a no-op in process).
IDLE_HEALTH_CHECK_S = 1.0


@dataclass(slots=True)
class _Route:
    stream: Any  # where this choice's outputs go: the carrier's handle of one HTTP request
    index: int
    num_logprobs: int | None  # top-k asked for, None: no logprobs
    num_prompt_logprobs: int | None = None  # the same for the prompt's tokens
    logprobs_sent: int = 0
    prompt_sent: bool = False


@dataclass(frozen=True, slots=True)
class _Add:
    stream: Any  # the carrier's handle of the HTTP request; has `.engine_ids`
    prompts: tuple[PromptInput, ...]
    params: tuple[SamplingParams, ...]  # one per choice, prompt-major
    done: Any  # how the carrier answers this add (a future, an id)
    with_text: bool  # decode token-id prompts for the response
    # The client gave max_tokens: a prompt + max_tokens past max-model-len is refused
    # (vLLM, OpenAI). Otherwise (a default max_tokens) generation stops at the context's end.
    check_length: bool = False


@dataclass(frozen=True, slots=True)
class _Query:
    """Tokenizer work for /tokenize and /detokenize: done here, with the engine's tokenizer
    (an API process has none, and loads none)."""

    query: Query
    done: Any  # as `_Add.done`


@dataclass(frozen=True, slots=True)
class _Abort:
    engine_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Stop:
    message: str


def engine_limits(engine: LLMEngine) -> Limits:
    scheduler = engine.config.scheduler
    tokenizer = engine.tokenizer
    return Limits(max_n=scheduler.max_num_seqs, max_model_len=scheduler.max_model_len,
                  sampling_defaults=engine.config.sampling_defaults,
                  vocab_size=engine.config.model.vocab_size,
                  max_prompt_chars=None if tokenizer is None
                  else tokenizer.prompt_chars_bound(scheduler.max_model_len))


class EngineLoop:
    """The loop and its bookkeeping; a carrier supplies `_next_command`, `_wait_for_work`,
    `_emit` (a step's outputs) and `_answer` (an add's or a query's result)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine  # touched only by the loop once started
        self._routes: dict[str, _Route] = {}  # engine request id -> where its outputs go
        # Why the engine stopped for good (a worker died or failed); None while it serves.
        self.failure: str | None = None
        self.stats = engine.stats()  # replaced whole after each step, never mutated
        self.num_steps = 0  # engine steps taken
        self._token_texts: dict[int, str] = {}  # token id -> its text (_token_text)

    # ------------------------------------------------------------------ carrier hooks

    def _next_command(self) -> _Add | _Abort | _Stop | None:
        raise NotImplementedError

    def _wait_for_work(self, timeout: float) -> bool:
        """Block until a command may be waiting; False on timeout."""
        raise NotImplementedError

    def _emit(self, batch: list[tuple[Any, ChoiceDelta | StreamError]]) -> None:
        raise NotImplementedError

    def _answer(self, command: _Add | _Query, result: Any, error: BaseException | None
                ) -> None:
        """Hand an add's prepared prompts (or a query's result), or its error, back."""
        raise NotImplementedError

    def _stats_changed(self) -> None:
        """`self.stats` / `self.num_steps` were replaced (a carrier may forward them)."""

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """Until a `_Stop` command. After the engine fails for good, every add is
        answered with the failure until then (an add sent just as the engine failed must
        not wait forever)."""
        while True:
            try:
                if not self._drain_commands():
                    return
                self._step_or_wait()
            except ExecutorError as e:  # a worker is gone: no step can run any more
                if not self._stop_for_good(str(e)):
                    self._refuse_until_stopped(f"the engine stopped: {e}")
                return
            except Exception:  # a bug must not take the server down
                logger.exception("engine step failed; aborting the requests in flight")
                self._fail_all(StreamError("internal error in the engine step", 500))

    def _step_or_wait(self) -> None:
        engine = self.engine
        if not engine.has_unfinished():
            self.stats = engine.stats()
            self._stats_changed()
            if not self._wait_for_work(IDLE_HEALTH_CHECK_S):
                # Idle: notice a dead worker now, not at the next request.
                engine.check_health()
            return
        outputs = engine.step()
        self.num_steps += 1
        batch = [item for out in outputs if (item := self._route(out)) is not None]
        self.stats = engine.stats()
        if batch:
            self._emit(batch)
        self._stats_changed()

    def _drain_commands(self) -> bool:
        """Apply queued commands; False once told to stop."""
        while (command := self._next_command()) is not None:
            if isinstance(command, _Add):
                self._apply_add(command)
            elif isinstance(command, _Query):
                self._apply_query(command)
            elif isinstance(command, _Abort):
                for req_id in command.engine_ids:
                    if self._routes.pop(req_id, None) is not None:
                        self.engine.abort(req_id)
            else:
                self._fail_all(StreamError(command.message, 503))
                self._fail_pending_adds(command.message)
                return False
        return True

    def _apply_add(self, command: _Add) -> None:
        engine = self.engine
        stream = command.stream
        added: list[str] = []
        try:
            prepared = [self._prepare(p) for p in command.prompts]
            per_prompt = len(command.params) // len(prepared)
            if command.check_length:  # every prompt before any is added
                for i, params in enumerate(command.params):
                    self._check_length(command.prompts[i // per_prompt],
                                       prepared[i // per_prompt], params.max_tokens)
            for i, (req_id, params) in enumerate(zip(stream.engine_ids, command.params)):
                prompt = prepared[i // per_prompt]
                engine.add_request({"prompt": prompt.text, "prompt_token_ids": prompt.token_ids},
                                   params, request_id=req_id)
                added.append(req_id)
                self._routes[req_id] = _Route(stream, i, params.logprobs,
                                              params.prompt_logprobs)
        except Exception as e:  # noqa: BLE001 - handed to the HTTP handler as a 400 or 500
            for req_id in added:
                self._routes.pop(req_id, None)
                engine.abort(req_id)
            self._answer(command, None, e)
            return
        if command.with_text:
            prepared = [self._with_text(p) for p in prepared]
        self._answer(command, prepared, None)

    def _check_length(self, prompt: PromptInput, prepared: PreparedPrompt, max_tokens: int
                      ) -> None:
        """vLLM's refusal, word for word but for "prompt" where the prompt is not chat."""
        max_len = self.engine.config.scheduler.max_model_len
        num_prompt = len(prepared.token_ids)
        if num_prompt + max_tokens <= max_len:
            return
        what = "messages" if isinstance(prompt, ChatPrompt) else "prompt"
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the {what}, "
            f"{max_tokens} in the completion). Please reduce the length of the {what} or "
            "completion.")

    def _apply_query(self, command: _Query) -> None:
        try:
            result = self._run_query(command.query)
        except Exception as e:  # noqa: BLE001 - handed to the HTTP handler as a 400 or 500
            self._answer(command, None, e)
            return
        self._answer(command, result, None)

    def _run_query(self, query: Query) -> list[int] | str:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"{self.engine.no_tokenizer_reason()}; the server cannot "
                             "tokenize or detokenize")
        if isinstance(query, DetokenizeQuery):
            vocab = tokenizer.vocab_size
            bad = next((t for t in query.token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is not in the tokenizer's vocabulary "
                                 f"[0, {vocab})")
            # Special tokens kept: the text of exactly these ids (vLLM does the same).
            return tokenizer.decode(query.token_ids, skip_special_tokens=False)
        if not isinstance(query, TokenizeQuery):
            raise TypeError(f"unknown query {type(query).__name__}")
        prompt = query.prompt
        if isinstance(prompt, ChatPrompt):
            messages = list(prompt.messages)
            kwargs = dict(prompt.template_kwargs)
            if query.add_special_tokens is None:  # as the chat endpoint tokenizes
                return tokenizer.apply_chat_template(messages, query.add_generation_prompt,
                                                     template_kwargs=kwargs)
            text = tokenizer.render_chat(messages, query.add_generation_prompt,
                                         template_kwargs=kwargs)
            return tokenizer.encode(text, add_special_tokens=query.add_special_tokens)
        if query.add_special_tokens is None:  # as a completion's prompt is tokenized
            return self.engine.tokenize_prompt(prompt)[1]
        return tokenizer.encode(prompt, add_special_tokens=query.add_special_tokens)

    def _prepare(self, prompt: PromptInput) -> PreparedPrompt:
        if isinstance(prompt, ChatPrompt):
            tokenizer = self.engine.tokenizer
            if tokenizer is None:
                raise ValueError(f"model {self.engine.source.name} has no tokenizer, so it "
                                 "has no chat template; use /v1/completions with token ids")
            return PreparedPrompt(None, tokenizer.apply_chat_template(
                list(prompt.messages), template_kwargs=dict(prompt.template_kwargs)))
        text, ids = self.engine.tokenize_prompt(prompt)
        return PreparedPrompt(text, ids)

    def _with_text(self, prompt: PreparedPrompt) -> PreparedPrompt:
        tokenizer = self.engine.tokenizer
        if prompt.text is not None or tokenizer is None:
            return prompt
        # Special tokens kept: the echo shows the prompt the model was given.
        return PreparedPrompt(tokenizer.decode(prompt.token_ids, skip_special_tokens=False),
                              prompt.token_ids)

    def _route(self, out: RequestOutput) -> tuple[Any, ChoiceDelta] | None:
        route = self._routes.get(out.request_id)
        if route is None:  # aborted since the step was scheduled
            return None
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
        if out.finished:
            del self._routes[out.request_id]
        return route.stream, ChoiceDelta(
            index=route.index,
            text=completion.delta_text,
            num_new_tokens=len(completion.delta_token_ids),
            num_output_tokens=len(completion.token_ids),
            num_cached_tokens=out.num_cached_tokens,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            prompt_logprobs=prompt_logprobs,
        )

    def _token_logprob(self, entry: dict[int, float], k: int, rank: int | None = None
                       ) -> TokenLogprob:
        # The engine's entry: the sampled (or prompt) token first, then the top-k others.
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
            tokenizer = self.engine.tokenizer
            text = (f"token_id:{token_id}" if tokenizer is None
                    else tokenizer.decode([token_id], skip_special_tokens=False))
            self._token_texts[token_id] = text
        return text

    def _fail_all(self, error: StreamError) -> None:
        streams = {}
        routes, self._routes = self._routes, {}
        for req_id, route in routes.items():
            streams[id(route.stream)] = route.stream
            with contextlib.suppress(Exception):  # after a failed step, free what we can
                self.engine.abort(req_id)
        with contextlib.suppress(Exception):
            self.stats = self.engine.stats()
            self._stats_changed()
        if streams:
            self._emit([(s, error) for s in streams.values()])

    def _stop_for_good(self, reason: str) -> bool:
        """The engine cannot step again: end every live request and every queued add with
        a 503 naming the cause; /health reports it from now on. True if a stop was among
        the queued commands."""
        logger.error("the engine stopped: %s", reason)
        self.failure = reason
        message = f"the engine stopped: {reason}"
        self._fail_all(StreamError(message, 503))
        return self._fail_pending_adds(message)

    def _fail_pending_adds(self, message: str) -> bool:
        """Refuse the queued adds; True if a `_Stop` was queued too (it is consumed here,
        so the caller must stop)."""
        stop = False
        while (command := self._next_command()) is not None:
            if isinstance(command, (_Add, _Query)):
                self._answer(command, None, EngineUnavailable(message))
            elif isinstance(command, _Stop):
                stop = True
        return stop

    def _refuse_until_stopped(self, message: str) -> None:
        while True:
            command = self._next_command()
            if command is None:
                self._wait_for_work(IDLE_HEALTH_CHECK_S)
            elif isinstance(command, (_Add, _Query)):
                self._answer(command, None, EngineUnavailable(message))
            elif isinstance(command, _Stop):
                return


class AsyncEngine(EngineLoop):
    """The loop on a thread of this process, for HTTP handlers on this event loop: they
    send commands through a queue and read their outputs from a `RequestStream` each."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine)
        self.limits = engine_limits(engine)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ event loop side

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self.run, name="llmfast-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self.failure is None)

    async def add(self, stream: RequestStream, prompts: Sequence[PromptInput],
                  params: Sequence[SamplingParams], *, with_text: bool = False,
                  check_length: bool = False) -> list[PreparedPrompt]:
        """Tokenise the prompts and queue `len(params)` engine requests (the choices,
        prompt-major; each prompt has `len(params) // len(prompts)` of them). With
        `with_text`, token-id prompts come back decoded too (for echo). With
        `check_length`, a prompt + max_tokens past max-model-len is refused
        (ContextLengthExceeded) and nothing is added. Raises what the engine raises for a
        bad prompt (RequestRejected, TokenizerError)."""
        check_open(self)
        done = self._loop.create_future()
        self._send(_Add(stream, tuple(prompts), tuple(params), done, with_text, check_length))
        return await done

    async def query(self, query: Query) -> list[int] | str:
        """Token ids for a `TokenizeQuery`, text for a `DetokenizeQuery` (ValueError for a
        bad one), from the engine's tokenizer, between steps."""
        check_open(self)
        done = self._loop.create_future()
        self._send(_Query(query, done))
        return await done


    def abort(self, engine_ids: Sequence[str]) -> None:
        """Abort these engine requests (unknown or finished ids are ignored). Their KV
        blocks are freed before the next step."""
        if engine_ids and self._thread is not None:
            self._send(_Abort(tuple(engine_ids)))

    def stop(self, message: str = "the server is shutting down") -> None:
        """End every live request with a StreamError and stop the engine thread."""
        if self._stopping:
            return
        self._stopping = True
        self._send(_Stop(message))

    def stop_threadsafe(self, message: str = "the server is shutting down") -> None:
        """`stop` from a signal handler or another thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.stop, message)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    @staticmethod
    def _deliver(batch: list[tuple[RequestStream, ChoiceDelta | StreamError]]) -> None:
        for stream, item in batch:
            stream.put(item)

    @staticmethod
    def _resolve(future: asyncio.Future, result=None, error: BaseException | None = None
                 ) -> None:
        if future.done():  # the handler went away meanwhile; its ids get aborted anyway
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    # ------------------------------------------------------------------ carrier hooks

    def _next_command(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _wait_for_work(self, timeout: float) -> bool:
        woken = self._wake.wait(timeout)
        self._wake.clear()
        return woken

    def _emit(self, batch) -> None:
        self._loop.call_soon_threadsafe(self._deliver, batch)

    def _answer(self, command, result, error) -> None:
        self._loop.call_soon_threadsafe(self._resolve, command.done, result, error)
