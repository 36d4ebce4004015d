"""Tokenising off the engine's thread: the prompts of each add, /tokenize, /detokenize.

The engine loop owns the engine and steps it. Tokenising a long prompt or rendering a
chat template there holds every running request up for as long (a 100k-character prompt
takes ~0.1-1 s). `PromptPreparer` does that work on a thread of its own, with its own
copy of the engine's tokenizer: the engine's thread keeps the original to detokenize,
and no tokenizer object is used by two threads (the Rust tokenizer borrow-checks at run
time, and transformers may reconfigure it per call). The Rust encode lets go of the GIL
while it runs (`encode_batch`, which transformers' fast tokenizers and the presets' call),
so the loop steps meanwhile.

One worker, so results come back in the order the commands were submitted: the loop
takes them between steps (`take`); `on_ready`, called from the worker after each result,
wakes a loop that waits for work.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, NamedTuple

from llmfast.core.request import check_prompt_length
from llmfast.engine import tokenize_prompt
from llmfast.serve.loop_commands import AddCommand, QueryCommand
from llmfast.serve.stream import (
    ChatPrompt,
    ContextLengthExceeded,
    DetokenizeQuery,
    PreparedPrompt,
    PromptInput,
    Query,
    TokenizeQuery,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmfast.engine import LLMEngine
    from llmfast.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_CLOSE = object()  # the worker's last job


class Prepared(NamedTuple):
    command: AddCommand | QueryCommand
    result: Any  # an add's list[PreparedPrompt]; a query's token ids or text
    error: BaseException | None


class PromptPreparer:
    """See the module docstring. `start()` starts the worker, `submit(command)` queues an
    add or a query, `take()` returns the next finished one (or None), `close()` stops
    the worker and returns the commands it did not hand back."""

    def __init__(self, engine: LLMEngine, on_ready: Callable[[], None]) -> None:
        self._engine_tokenizer = engine.tokenizer  # copied by the worker, before its first job
        self.tokenizer: Tokenizer | None = None
        self._no_tokenizer_reason = engine.no_tokenizer_reason()
        self._model_name = engine.source.name
        self._max_model_len = engine.config.scheduler.max_model_len
        self._on_ready = on_ready
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: collections.deque[Prepared] = collections.deque()
        self._thread: threading.Thread | None = None
        self._current: AddCommand | QueryCommand | None = None  # the worker's job now

    # ------------------------------------------------------------------ the loop's side

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="llmfast-tokenize",
                                        daemon=True)
        self._thread.start()

    def submit(self, command: AddCommand | QueryCommand) -> None:
        self._jobs.put(command)

    def take(self) -> Prepared | None:
        return self._ready.popleft() if self._ready else None

    def has_ready(self) -> bool:
        return bool(self._ready)

    def close(self, timeout: float = 60.0) -> list[AddCommand | QueryCommand]:
        """Stop the worker once its current job is done (the queued ones are not
        started); the commands not handed back, finished or not. Idempotent; called by
        the loop's thread, the only one that submits."""
        queued = []
        while True:
            try:
                queued.append(self._jobs.get_nowait())
            except queue.Empty:
                break
        thread, self._thread = self._thread, None
        current = None
        if thread is not None:
            self._jobs.put(_CLOSE)
            thread.join(timeout)
            if thread.is_alive():  # its result, if it ever comes, is not read
                logger.error("the tokenizer thread did not finish its job in %.0f s", timeout)
                current = self._current
        left = []
        while self._ready:
            command = self._ready.popleft().command
            if command is not current:  # (finished just now: answered as `current`)
                left.append(command)
        if current is not None:
            left.append(current)
        return left + [job for job in queued if job is not _CLOSE]

    # ------------------------------------------------------------------ the worker

    def _work(self) -> None:
        self.tokenizer = _own_copy(self._engine_tokenizer)
        self._engine_tokenizer = None
        while (command := self._jobs.get()) is not _CLOSE:
            self._current = command
            try:
                if isinstance(command, AddCommand):
                    result = self.prepare_add(command)
                else:
                    result = self.run_query(command.query)
            except Exception as e:  # noqa: BLE001 - the loop answers it (a 400, or a 500)
                self._ready.append(Prepared(command, None, e))
            else:
                self._ready.append(Prepared(command, result, None))
            self._current = None
            self._on_ready()

    def prepare_add(self, command: AddCommand) -> list[PreparedPrompt]:
        """Each prompt's token ids (and, `with_text`, the text of token-id prompts). With
        `check_length`, ContextLengthExceeded if any prompt + its max_tokens is past
        max-model-len; RequestRejected for a prompt the engine would refuse for its length
        (here, not on the engine's thread after it was copied there). Either way nothing
        of the add is applied."""
        prepared = [self._prepare(p) for p in command.prompts]
        per_prompt = len(command.params) // len(prepared)
        if command.check_length:
            for i, params in enumerate(command.params):
                self._check_length(command.prompts[i // per_prompt], prepared[i // per_prompt],
                                   params.max_tokens)
        for prompt in prepared:
            check_prompt_length(len(prompt.token_ids), self._max_model_len)
        if command.with_text:
            prepared = [self._with_text(p) for p in prepared]
        return prepared

    def run_query(self, query: Query) -> list[int] | str:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise ValueError(f"{self._no_tokenizer_reason}; the server cannot tokenize or "
                             "detokenize")
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
            return self._tokenize(prompt)[1]
        return tokenizer.encode(prompt, add_special_tokens=query.add_special_tokens)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        return tokenize_prompt(prompt, self.tokenizer, lambda: self._no_tokenizer_reason)

    def _prepare(self, prompt: PromptInput) -> PreparedPrompt:
        if isinstance(prompt, ChatPrompt):
            if self.tokenizer is None:
                raise ValueError(f"model {self._model_name} has no tokenizer, so it has no "
                                 "chat template; use /v1/completions with token ids")
            return PreparedPrompt(None, self.tokenizer.apply_chat_template(
                list(prompt.messages), template_kwargs=dict(prompt.template_kwargs)))
        text, ids = self._tokenize(prompt)
        return PreparedPrompt(text, ids)

    def _check_length(self, prompt: PromptInput, prepared: PreparedPrompt, max_tokens: int
                      ) -> None:
        """vLLM's refusal, word for word but for "prompt" where the prompt is not chat."""
        max_len = self._max_model_len
        num_prompt = len(prepared.token_ids)
        if num_prompt + max_tokens <= max_len:
            return
        what = "messages" if isinstance(prompt, ChatPrompt) else "prompt"
        raise ContextLengthExceeded(
            f"This model's maximum context length is {max_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the {what}, "
            f"{max_tokens} in the completion). Please reduce the length of the {what} or "
            "completion.")

    def _with_text(self, prompt: PreparedPrompt) -> PreparedPrompt:
        if prompt.text is not None or self.tokenizer is None:
            return prompt
        # Special tokens kept: the echo shows the prompt the model was given.
        return PreparedPrompt(self.tokenizer.decode(prompt.token_ids, skip_special_tokens=False),
                              prompt.token_ids)


def _own_copy(tokenizer: Tokenizer | None) -> Tokenizer | None:
    """A copy of `tokenizer` for this thread alone (its Rust tokenizer too); the tokenizer
    itself where it cannot be copied (logged: two threads then share it)."""
    if tokenizer is None:
        return None
    try:
        # A new Tokenizer, not a deep copy of this one: its cached properties hold bound
        # methods of the Rust tokenizer, which deepcopy shares rather than copies.
        return dataclasses.replace(tokenizer, hf=copy.deepcopy(tokenizer.hf))
    except Exception as e:  # noqa: BLE001 - a tokenizer class that does not deep-copy
        logger.warning("the tokenizer could not be copied for the tokenizing thread (%s); "
                       "it shares the engine's", e)
        return tokenizer
