"""The offline API: `LLM(model=..., **engine_args).generate(prompts, sampling_params)`,
`.chat(messages, sampling_params)` and `.stream(prompt, sampling_params)`.

One engine, many callers. `LLMEngine.step()` advances every live request at once, so
with several callers on one engine (a `generate` call, open `stream`s, other threads)
the one that steps serves the others: each request is added with its own queue, and the
output processor appends every output to its request's queue (engine/processing/output_processor.py)
whoever stepped. Every engine call runs under one lock; a caller that finds its queue
empty takes the lock and steps, unless another caller's step filled the queue while it
waited. Outputs of requests added on `llm.engine` directly come back from that step
unread, and are dropped.

A caller that goes away (a stream closed or garbage-collected) is aborted at once when
it can be, else at the next engine call: a finaliser can run in the middle of an engine
call, on any thread, so it never touches the engine itself.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Self

from llmfast.engine.args import EngineArgs
from llmfast.engine.processing.input_processor import Prompt
from llmfast.engine.llm_engine import LLMEngine
from llmfast.outputs import GenerationInterrupted, RequestOutput
from llmfast.sampling_params import SamplingParams
from llmfast.utils.progress import CountProgress
from llmfast.utils.value_checks import describe


class LLM:
    """An engine with a batch API. The keywords are the fields of `EngineArgs` (the CLI's
    engine flags with underscores: dtype, device, seed, max_num_seqs, kv_cache_memory,
    enforce_eager, ...); a string for a size or byte field reads as its flag would
    (`kv_cache_memory="2GiB"`, `cuda_graph_sizes="1..64"`).

    One `LLM` serves any number of callers: `generate` calls and open `stream`s, from one
    thread or several, all batch together in the same engine. Engine steps are serialised
    by a lock (whichever caller needs outputs steps the engine for everyone) and every
    request's outputs go to its own caller. Closing or dropping a stream before it ends
    aborts its request and frees its KV blocks. Do not drive `llm.engine` directly while
    such calls are open."""

    def __init__(self, model: str | None = None, *, progress=None, **engine_args) -> None:
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        self.engine = LLMEngine.from_engine_args(args, progress=progress)
        # Reentrant so that a finaliser running inside an engine call on this thread can
        # take it and see `_busy` (and defer), instead of deadlocking.
        self._lock = threading.RLock()
        self._busy = False  # an engine call is in progress (under the lock)
        # The requests this LLM's callers wait on, each with the queue the output
        # processor fills; removed once read to the end, released or abandoned.
        self._queues: dict[str, deque[RequestOutput]] = {}
        self._abandoned: deque[str] = deque()  # appended from anywhere, drained under the lock

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate`, `chat` and `stream` use when given no sampling parameters:
        SamplingParams' defaults, overridden by the model's generation_config.json
        (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) unless
        the engine argument `generation_config="vllm"` says not to."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: CountProgress | bool | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion, batched; outputs come back in input order.

        `progress=True` shows a progress bar on stderr; a callable receives
        (finished, total) after every step instead. Ctrl-C (KeyboardInterrupt) raises
        GenerationInterrupted, whose `outputs` hold the prompts that had finished."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        if not isinstance(prompts, Iterable):
            raise TypeError("prompts must be a str, a list of token ids, a dict with "
                            "'prompt_token_ids', or a list of these; got "
                            f"{describe(prompts)}")
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            # (A dict would iterate as its keys, a str as its letters.)
            bad = ([sampling_params] if isinstance(sampling_params, (dict, str, bytes))
                   or not isinstance(sampling_params, Iterable) else
                   [p for p in sampling_params if not isinstance(p, SamplingParams)])
            if bad:
                raise TypeError("sampling_params must be a SamplingParams or a list of them, "
                                f"one per prompt; got {describe(bad[0])}")
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"{len(params)} sampling params for {len(prompts)} prompts; pass one or one each"
                )
        ids = self._add(prompts, params, stream=False)
        callback, close = _progress_callback(progress, len(ids))
        try:
            return self._collect(ids, callback)
        except BaseException:
            self._release(ids)
            raise
        finally:
            close()

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        progress: CountProgress | bool | None = None,
    ) -> list[RequestOutput]:
        """`generate` for conversations: one (a list of {"role": ..., "content": ...}
        messages) or several (a list of such lists), each rendered by the chat template:
        `chat_template` (a Jinja template) for this call, else the engine's (the model's,
        or the `chat_template` engine argument), with `chat_template_kwargs` as more
        template variables (e.g. Qwen3's `{"enable_thinking": False}`). Outputs in input
        order; each output's `prompt` is the rendered text."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError(f"{self.engine.no_tokenizer_reason()}; chat needs a tokenizer")
        if chat_template is not None:
            tokenizer = tokenizer.with_chat_template(chat_template)
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts, "
                             "or a list of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conversation in conversations:
            conversation = [_text_content(m) for m in conversation]
            text, ids = tokenizer.chat_prompt(conversation, add_generation_prompt,
                                              template_kwargs=chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, progress=progress)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None
               ) -> RequestStream:
        """An iterator of RequestOutputs for one request, one per step that produced
        any (`outputs[0].delta_text` is the new text). The request is queued now; closing
        the iterator (or dropping it) before it ends aborts the request."""
        (req_id,) = self._add([prompt], [sampling_params], stream=True)
        return RequestStream(self, req_id)


    # ------------------------------------------------------------------ one engine, many callers

    @contextlib.contextmanager
    def _engine_call(self) -> Iterator[LLMEngine]:
        with self._lock:
            if self._busy:
                raise RuntimeError("re-entrant engine call (from a finaliser or callback)")
            self._busy = True
            try:
                self._abort_abandoned()
                yield self.engine
                self._abort_abandoned()
            finally:
                self._busy = False

    def _add(self, prompts: Sequence, params: Sequence, stream: bool) -> list[str]:
        """Add requests, each with its own queue; all or none (a rejected one aborts
        those added before it)."""
        ids: list[str] = []
        with self._engine_call() as engine:
            try:
                for prompt, p in zip(prompts, params):
                    queue: deque[RequestOutput] = deque()
                    req_id = engine.add_request(prompt, p, stream=stream, queue=queue)
                    self._queues[req_id] = queue
                    ids.append(req_id)
            except BaseException:
                for req_id in ids:
                    self._abort(req_id)
                raise
        return ids

    def _release(self, req_ids: Sequence[str]) -> None:
        """The caller is done with these requests: abort the unfinished ones now."""
        with self._engine_call():
            for req_id in req_ids:
                self._abort(req_id)

    def _abandon(self, req_id: str, blocking: bool) -> None:
        """Abort a request whose caller went away, now if the engine is free (waiting
        for it when `blocking`), else at the next engine call. Safe from finalisers."""
        self._abandoned.append(req_id)
        if not self._lock.acquire(blocking=blocking):
            return  # another thread is stepping; it aborts ours when its call ends
        try:
            if not self._busy:  # else: we interrupted our own thread's engine call
                self._busy = True
                try:
                    self._abort_abandoned()
                finally:
                    self._busy = False
        finally:
            self._lock.release()

    def _abort_abandoned(self) -> None:
        while self._abandoned:
            self._abort(self._abandoned.popleft())

    def _abort(self, req_id: str) -> None:
        if self._queues.pop(req_id, None) is not None:
            self.engine.abort(req_id)  # a finished request is unknown to it: a no-op

    def _next_output(self, req_id: str) -> RequestOutput:
        """The request's next output, stepping the engine until there is one."""
        queue = self._queues[req_id]
        while not queue:
            if self._queues.get(req_id) is not queue:
                raise StopIteration  # closed from another thread meanwhile
            self._step_unless(lambda: bool(queue), (req_id,))
        out = queue.popleft()
        if out.finished:
            with self._lock:
                self._queues.pop(req_id, None)
        return out

    def _collect(self, req_ids: Sequence[str],
                 on_step: CountProgress | None = None) -> list[RequestOutput]:
        """Run the requests to completion; their final outputs, in order."""
        final: dict[str, RequestOutput] = {}
        try:
            return self._collect_into(final, req_ids, on_step)
        except GenerationInterrupted:
            raise
        except KeyboardInterrupt:
            for req_id in req_ids:  # also what a step queued just before the interrupt
                for out in self._queues.get(req_id, ()):
                    if out.finished:
                        final[req_id] = out
            raise GenerationInterrupted([final.get(i) for i in req_ids]) from None

    def _collect_into(self, final: dict[str, RequestOutput], req_ids: Sequence[str],
                      on_step: CountProgress | None) -> list[RequestOutput]:
        pending = list(req_ids)
        while True:
            still = []
            for req_id in pending:
                queue = self._queues[req_id]
                while queue:
                    out = queue.popleft()
                    if out.finished:
                        final[req_id] = out
                if req_id not in final:
                    still.append(req_id)
            pending = still
            if not pending:
                break
            queues = [self._queues[i] for i in pending]
            self._step_unless(lambda queues=queues: any(queues), pending)
            if on_step is not None:
                on_step(len(final), len(req_ids))
        with self._lock:
            for req_id in req_ids:
                self._queues.pop(req_id, None)
        return [final[i] for i in req_ids]

    def _step_unless(self, ready: Callable[[], bool], waiting_for: Sequence[str]) -> None:
        """Step the engine once (the output processor fills every caller's queue),
        unless `ready()` turned true while this thread waited for the lock (another
        caller's step served it)."""
        with self._engine_call() as engine:
            if ready():
                return
            if not engine.has_unfinished():
                raise RuntimeError(
                    f"request {waiting_for[0]!r} is no longer in the engine (aborted directly "
                    "on LLM.engine?)")
            engine.step()  # only requests added on the engine directly come back here


class RequestStream(Iterator[RequestOutput]):
    """The outputs of one request, one per engine step that produced any.

    Closing it (or dropping the last reference to it) before the request finishes aborts
    the request and frees its KV blocks. While the request runs, `outputs[0].token_ids`
    of an output is the request's live list (it may already hold later tokens when the
    output was queued behind others); `delta_token_ids` and `delta_text` are the step's own.
    """

    def __init__(self, llm: LLM, request_id: str) -> None:
        self._llm = llm
        self.request_id = request_id
        self._done = False

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> RequestOutput:
        if self._done:
            raise StopIteration
        try:
            out = self._llm._next_output(self.request_id)
        except BaseException:
            self.close()
            raise
        if out.finished:
            self._done = True
        return out

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._llm._abandon(self.request_id, blocking=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            self._done = True
            with contextlib.suppress(Exception):  # e.g. at interpreter shutdown
                self._llm._abandon(self.request_id, blocking=False)

def _text_content(message):
    """OpenAI's content parts (`[{"type": "text", "text": ...}, ...]`) joined into the
    string a chat template takes, as the server does; anything else as it is (the
    tokenizer checks messages)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return {**message, "content": "".join(p["text"] for p in content)}
    return message


def _progress_callback(progress, total: int):
    if progress is True:
        if total < 2:
            return None, lambda: None
        from rich.console import Console
        from rich.progress import Progress

        bar = Progress(console=Console(stderr=True), transient=True)
        task = bar.add_task("generating", total=total)
        bar.start()
        return (lambda done, _: bar.update(task, completed=done)), bar.stop
    return (progress or None), (lambda: None)
