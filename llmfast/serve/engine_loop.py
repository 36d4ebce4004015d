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
thread-safe, so every touch (adding, aborting, detokenising logprob tokens, reading stats)
must come from one place. Tokenising is the exception: the loop's `PromptPreparer`
(prompt_preparer.py) tokenises adds and answers /tokenize on a thread of its own, with
its own copy of the tokenizer, so a long prompt does not hold the running requests up;
the loop applies what it prepared between steps, in order. An add of many choices is
applied a time slice per step while requests are running, for the same reason.

Concurrent HTTP requests land in the same `engine.step()` calls: continuous batching
comes from the engine's scheduler, this file only feeds it. The engine's `RequestOutput`
holds live lists that the next step mutates, so only frozen `ChoiceDelta`s leave the
loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llmfast.engine import LLMEngine
from llmfast.executor import ExecutorError
from llmfast.outputs import RequestOutput
from llmfast.sampling_params import SamplingParams
from llmfast.serve.loop_commands import AbortCommand, AddCommand, QueryCommand, StopCommand
from llmfast.serve.prompt_preparer import PromptPreparer
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
# While requests are running, the loop adds requests of a large add for at most this
# long, or ADD_SLICE_STEPS of the last step's time if that is longer, before the next
# step (~100-500 engine requests a slice, by the host); the rest follow after it. So a
# running request's next token comes at most ~25 % later (or 5 ms) while thousands of
# choices go in, and the add takes at most ~4x its own time. Idle, an add goes in whole.
ADD_SLICE_S = 0.005
ADD_SLICE_STEPS = 0.25


@dataclass(slots=True)
class _Route:
    stream: Any  # where this choice's outputs go: the carrier's handle of one HTTP request
    index: int
    num_logprobs: int | None  # top-k asked for, None: no logprobs
    num_prompt_logprobs: int | None = None  # the same for the prompt's tokens
    logprobs_sent: int = 0
    prompt_sent: bool = False


@dataclass(slots=True)
class _AddInProgress:
    """An add being applied a slice at a time (`EngineLoop._continue_add`)."""

    command: AddCommand
    prepared: list[PreparedPrompt]
    next_choice: int = 0
    added: list[str] = field(default_factory=list)  # its engine ids added so far


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
    `_wake_up` (any thread: end that wait), `_emit` (a step's outputs) and `_answer` (an
    add's or a query's result)."""

    def __init__(self, engine: LLMEngine, add_slice_s: float = ADD_SLICE_S,
                 add_slice_steps: float = ADD_SLICE_STEPS) -> None:
        self.engine = engine  # touched only by the loop once started
        self._routes: dict[str, _Route] = {}  # engine request id -> where its outputs go
        # Why the engine stopped for good (a worker died or failed); None while it serves.
        self.failure: str | None = None
        self.stats = engine.stats()  # replaced whole after each step, never mutated
        self.num_steps = 0  # engine steps taken
        self._last_step_s = 0.0
        self._token_texts: dict[int, str] = {}  # token id -> its text (_token_text)
        # A slice of a large add: the longer of add_slice_s and this many last steps.
        self.add_slice_s, self.add_slice_steps = add_slice_s, add_slice_steps
        self._preparer = PromptPreparer(engine, self._wake_up, self._add_cancelled)
        self._adding: _AddInProgress | None = None
        # Engine ids of adds submitted but not applied yet (being tokenised, or in a later
        # slice), and those of them aborted meanwhile: skipped when their turn comes.
        self._unapplied: set[str] = set()
        self._cancelled: set[str] = set()

    # ------------------------------------------------------------------ carrier hooks

    def _next_command(self) -> AddCommand | QueryCommand | AbortCommand | StopCommand | None:
        raise NotImplementedError

    def _wait_for_work(self, timeout: float) -> bool:
        """Block until a command may be waiting; False on timeout."""
        raise NotImplementedError

    def _wake_up(self) -> None:
        """End a `_wait_for_work` now; called from the preparer's thread."""
        raise NotImplementedError

    def _emit(self, batch: list[tuple[Any, ChoiceDelta | StreamError]]) -> None:
        raise NotImplementedError

    def _answer(self, command: AddCommand | QueryCommand, result: Any,
                error: BaseException | None) -> None:
        """Hand an add's prepared prompts (or a query's result), or its error, back."""
        raise NotImplementedError

    def _stats_changed(self) -> None:
        """`self.stats` / `self.num_steps` were replaced (a carrier may forward them)."""

    def _stream_alive(self, stream: Any) -> bool:
        """Whether anybody still reads this HTTP request's outputs."""
        return True

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        """Until a `StopCommand`. After the engine fails for good, every add is answered
        with the failure until then (an add sent just as the engine failed must not wait
        forever)."""
        self._preparer.start()
        try:
            self._run()
        finally:
            for command in self._preparer.close():  # only if the loop itself failed
                self._answer(command, None, EngineUnavailable("the engine loop stopped"))

    def _run(self) -> None:
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
            if self._adding is not None or self._preparer.has_ready():
                return  # more to apply now
            if not self._wait_for_work(IDLE_HEALTH_CHECK_S):
                # Idle: notice a dead worker now, not at the next request.
                engine.check_health()
            return
        start = time.perf_counter()
        outputs = engine.step()
        self._last_step_s = time.perf_counter() - start
        self.num_steps += 1
        batch = [item for out in outputs if (item := self._route(out)) is not None]
        self.stats = engine.stats()
        if batch:
            self._emit(batch)
        self._stats_changed()

    def _drain_commands(self) -> bool:
        """Take queued commands (adds and queries go to the preparer), then apply what
        the preparer has finished; False once told to stop."""
        while (command := self._next_command()) is not None:
            if isinstance(command, AddCommand):
                self._unapplied.update(command.stream.engine_ids)
                self._preparer.submit(command)
            elif isinstance(command, QueryCommand):
                self._preparer.submit(command)
            elif isinstance(command, AbortCommand):
                self._abort(command.engine_ids)
            else:
                self._fail_all(StreamError(command.message, 503))
                self._fail_pending_adds(command.message)
                return False
        self._apply_prepared()
        return True

    def _abort(self, engine_ids: Sequence[str]) -> None:
        added = []
        for req_id in engine_ids:
            if self._routes.pop(req_id, None) is not None:
                added.append(req_id)
            elif req_id in self._unapplied:
                self._cancelled.add(req_id)
        if added:  # at once: a request of many choices at the back of a long queue
            self.engine.abort_many(added)

    def _add_cancelled(self, command: AddCommand) -> bool:
        """Whether nobody waits for this add any more (asked by the preparer's threads,
        between prompts: a set lookup and a flag, safe under the GIL)."""
        return (command.stream.engine_ids[0] in self._cancelled
                or not self._stream_alive(command.stream))

    def _apply_prepared(self) -> None:
        """Answer the prepared queries, then apply the prepared adds in the order they
        were prepared. While requests are running, adding stops once a slice is spent
        (`add_slice_s`, or `add_slice_steps` of the last step's time if longer; at least
        one request goes in): the rest follows after the next step, so an add of
        thousands of choices, or a burst of adds, delays the running requests by a slice
        per step, not all at once."""
        while (ready := self._preparer.take_query()) is not None:  # cheap: never waits
            self._answer(ready.command, ready.result, ready.error)
        deadline = math.inf
        if self.engine.has_unfinished():
            deadline = time.perf_counter() + max(self.add_slice_s,
                                                 self.add_slice_steps * self._last_step_s)
        added_any = False
        while True:
            if self._adding is None:
                # Many small adds share the slice too (but the first always goes in).
                if added_any and time.perf_counter() >= deadline:
                    return
                ready = self._preparer.take_add()
                if ready is None:
                    return
                command = ready.command
                error = ready.error or self._refusal(command, ready.result)
                if error is not None:
                    self._forget(command)
                    self._answer(command, None, error)
                    continue
                self._adding = _AddInProgress(command, ready.result)
            added_any = True
            if not self._continue_add(deadline):
                return

    def _refusal(self, command: AddCommand, prepared: list[PreparedPrompt]
                 ) -> Exception | None:
        """What the engine would refuse of this add, found before any of it goes in: a
        later slice must not fail after the first ones have run."""
        try:
            for prompt in prepared:
                self.engine.check_prompt(prompt.token_ids)
            for params in {id(p): p for p in command.params}.values():
                self.engine.check_params(params)
        except Exception as e:  # noqa: BLE001 - handed to the HTTP handler as a 400 or 500
            return e
        return None

    def _continue_add(self, deadline: float) -> bool:
        """Add the in-progress add's next choices until `deadline`; True once it is all
        in (then answered), False if time ran out first."""
        progress = self._adding
        command, engine = progress.command, self.engine
        if not self._stream_alive(command.stream):  # its HTTP process is gone
            self._forget(command)
            self._adding = None
            return True
        ids = command.stream.engine_ids
        per_prompt = len(command.params) // len(progress.prepared)
        try:
            while progress.next_choice < len(command.params):
                i = progress.next_choice
                progress.next_choice += 1
                req_id = ids[i]
                self._unapplied.discard(req_id)
                if req_id in self._cancelled:
                    self._cancelled.discard(req_id)
                    continue
                params, prompt = command.params[i], progress.prepared[i // per_prompt]
                engine.add_request({"prompt": prompt.text, "prompt_token_ids": prompt.token_ids},
                                   params, request_id=req_id)
                progress.added.append(req_id)
                self._routes[req_id] = _Route(command.stream, i, params.logprobs,
                                              params.prompt_logprobs)
                if (time.perf_counter() >= deadline
                        and progress.next_choice < len(command.params)):
                    return False
        except Exception as e:  # noqa: BLE001 - handed to the HTTP handler as a 400 or 500
            self._end_add(progress, e)
            return True
        self._adding = None
        self._answer(command, progress.prepared, None)
        return True

    def _end_add(self, progress: _AddInProgress, error: BaseException) -> None:
        """Take back what an add put in so far and answer it with `error`."""
        self._adding = None
        self._forget(progress.command)
        try:
            for req_id in progress.added:
                self._routes.pop(req_id, None)
                with contextlib.suppress(Exception):  # after a failed step: free what we can
                    self.engine.abort(req_id)
        finally:
            self._answer(progress.command, None, error)

    def _forget(self, command: AddCommand) -> None:
        self._unapplied.difference_update(command.stream.engine_ids)
        self._cancelled.difference_update(command.stream.engine_ids)

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
        # Positional, in the fields' order (index, text, num_new_tokens,
        # num_output_tokens, num_cached_tokens, logprobs, finish_reason, stop_reason,
        # prompt_logprobs): per streaming request and step, ~2x faster than keywords.
        return route.stream, ChoiceDelta(
            route.index, completion.delta_text, len(completion.delta_token_ids),
            len(completion.token_ids), out.num_cached_tokens, logprobs,
            completion.finish_reason, completion.stop_reason, prompt_logprobs)

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
        if self._adding is not None:  # its requests were among those; add no more of it
            with contextlib.suppress(Exception):  # (`_end_add` clears it first, whatever fails)
                self._end_add(self._adding, EngineUnavailable(error.message)
                              if error.status == 503 else RuntimeError(error.message))
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
        """Refuse the queued adds and queries, those with the preparer too (which stops:
        whatever comes later is refused by `_refuse_until_stopped`); True if a
        `StopCommand` was queued too (it is consumed here, so the caller must stop)."""
        stop = False
        for command in self._preparer.close():
            self._answer(command, None, EngineUnavailable(message))
        self._unapplied.clear()
        self._cancelled.clear()
        while (command := self._next_command()) is not None:
            if isinstance(command, (AddCommand, QueryCommand)):
                self._answer(command, None, EngineUnavailable(message))
            elif isinstance(command, StopCommand):
                stop = True
        return stop

    def _refuse_until_stopped(self, message: str) -> None:
        while True:
            command = self._next_command()
            if command is None:
                self._wait_for_work(IDLE_HEALTH_CHECK_S)
            elif isinstance(command, (AddCommand, QueryCommand)):
                self._answer(command, None, EngineUnavailable(message))
            elif isinstance(command, StopCommand):
                return


class AsyncEngine(EngineLoop):
    """The loop on a thread of this process, for HTTP handlers on this event loop: they
    send commands through a queue and read their outputs from a `RequestStream` each."""

    def __init__(self, engine: LLMEngine, add_slice_s: float = ADD_SLICE_S,
                 add_slice_steps: float = ADD_SLICE_STEPS) -> None:
        super().__init__(engine, add_slice_s, add_slice_steps)
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
        self._send(AddCommand(stream, tuple(prompts), tuple(params), done, with_text, check_length))
        return await done

    async def query(self, query: Query) -> list[int] | str:
        """Token ids for a `TokenizeQuery`, text for a `DetokenizeQuery` (ValueError for a
        bad one), from the engine's tokenizer (a copy, on the tokenizing thread)."""
        check_open(self)
        done = self._loop.create_future()
        self._send(QueryCommand(query, done))
        return await done


    def abort(self, engine_ids: Sequence[str]) -> None:
        """Abort these engine requests (unknown or finished ids are ignored). Their KV
        blocks are freed before the next step."""
        if engine_ids and self._thread is not None:
            self._send(AbortCommand(tuple(engine_ids)))

    def stop(self, message: str = "the server is shutting down") -> None:
        """End every live request with a StreamError and stop the engine thread."""
        if self._stopping:
            return
        self._stopping = True
        self._send(StopCommand(message))

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

    def _wake_up(self) -> None:
        self._wake.set()

    def _emit(self, batch) -> None:
        self._loop.call_soon_threadsafe(self._deliver, batch)

    def _answer(self, command, result, error) -> None:
        self._loop.call_soon_threadsafe(self._resolve, command.done, result, error)
