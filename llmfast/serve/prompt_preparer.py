"""Tokenising off the frontend's event loop: the prompts of each add, /tokenize, /detokenize.

The frontend's event loop streams every running request's tokens. Tokenising a long
prompt or rendering a chat template there holds every stream up for as long (a
100k-character prompt takes ~0.1-1 s). `PromptPreparer` does that work on threads of its
own, each with its own copy of the frontend's tokenizer: the loop keeps the original to
detokenize, and no tokenizer object is used by two threads (the Rust tokenizer
borrow-checks at run time, and transformers may reconfigure it per call). The Rust encode
lets go of the GIL while it runs (`encode_batch`, which transformers' fast tokenizers and
the presets' call), so the loop streams meanwhile.

Two lanes, a worker each: jobs with more than LARGE_JOB_CHARS of prompt go to the large
lane, the rest to the small one, so a request of megabytes of text (seconds to tokenise)
does not hold up the admission of every short one behind it. Within a lane jobs run in
order; results are handed back as they finish (`take_query`, `take_add`), and `on_ready`,
called from a worker after each, wakes a loop that waits for work. An add whose client
went away (`is_cancelled`) or a closed preparer stops a job between its prompts.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, NamedTuple

from llmfast.core.request import check_prompt_length
from llmfast.engine.processing.input_processor import tokenize_prompt
from llmfast.serve.preparer_commands import AddCommand, QueryCommand
from llmfast.serve.frontend_types import (
    ChatPrompt,
    ContextLengthExceeded,
    DetokenizeQuery,
    EngineUnavailable,
    PreparedPrompt,
    PromptInput,
    Query,
    TokenizeQuery,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmfast.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# A job with more prompt than this (characters of text, token ids, message contents)
# goes to the large lane: ~20-100 ms of tokenising and more.
LARGE_JOB_CHARS = 65_536
_CLOSE = object()  # a worker's last job


class Prepared(NamedTuple):
    command: AddCommand | QueryCommand
    result: Any  # an add's list[PreparedPrompt]; a query's token ids or text
    error: BaseException | None


class _Stopped(EngineUnavailable):
    """A job given up between its prompts: its client went away, or the server stops."""


def job_chars(command: AddCommand | QueryCommand) -> int:
    """How much prompt a job holds, for its lane."""
    if isinstance(command, AddCommand):
        prompts = command.prompts
    elif isinstance(command.query, TokenizeQuery):
        prompts = (command.query.prompt,)
    else:
        return len(command.query.token_ids)
    return sum(sum(len(m.get("content") or "") for m in p.messages)
               if isinstance(p, ChatPrompt) else len(p) for p in prompts)


class PromptPreparer:
    """See the module docstring. `start()` starts the workers, `submit(command)` queues an
    add or a query, `take_query()` / `take_add()` return the next finished one of each
    kind (or None), `close()` stops the workers and returns the submitted commands not
    handed back. Every method but the workers' is called by the loop's thread."""

    def __init__(self, tokenizer: Tokenizer | None, no_tokenizer_reason: str, model_name: str,
                 max_model_len: int, on_ready: Callable[[], None],
                 is_cancelled: Callable[[AddCommand], bool] = lambda command: False,
                 large_job_chars: int | None = None) -> None:
        def rules() -> PromptRules:
            return PromptRules(tokenizer, no_tokenizer_reason, model_name, max_model_len)

        self._on_ready = on_ready
        self._is_cancelled = is_cancelled
        self.large_job_chars = LARGE_JOB_CHARS if large_job_chars is None else large_job_chars
        self._closed = False
        # Submitted and not handed back yet, by id (dict: in submission order).
        self._outstanding: dict[int, AddCommand | QueryCommand] = {}
        self._ready_queries: collections.deque[Prepared] = collections.deque()
        self._ready_adds: collections.deque[Prepared] = collections.deque()
        # Each lane's rules hold a tokenizer copy of their own, made by its worker as it
        # starts: a copy holds the GIL for ~0.2 s per 50k-token vocabulary (~8 MiB
        # each), which must not fall on a running request's step.
        self._lanes = [_Lane("llmfast-tokenize", rules()),
                       _Lane("llmfast-tokenize-large", rules())]

    # ------------------------------------------------------------------ the loop's side

    def start(self) -> None:
        for lane in self._lanes:
            lane.thread = threading.Thread(target=self._work, args=(lane,), name=lane.name,
                                           daemon=True)
            lane.thread.start()

    def submit(self, command: AddCommand | QueryCommand) -> None:
        self._outstanding[id(command)] = command
        large = job_chars(command) > self.large_job_chars
        self._lanes[1 if large else 0].jobs.put(command)

    def take_query(self) -> Prepared | None:
        return self._take(self._ready_queries)

    def take_add(self) -> Prepared | None:
        return self._take(self._ready_adds)

    def has_ready(self) -> bool:
        return bool(self._ready_queries or self._ready_adds)

    def close(self, timeout: float = 0.5) -> list[AddCommand | QueryCommand]:
        """Stop the workers: a job in progress ends at its next prompt and its result is
        dropped, the queued ones do not start. Returns every submitted command not handed
        back yet, in submission order (the caller answers them); waits at most `timeout`
        in all for the workers. Idempotent."""
        if not self._closed:
            self._closed = True
            for lane in self._lanes:
                lane.jobs.put(_CLOSE)
            deadline = time.monotonic() + timeout
            for lane in self._lanes:
                if lane.thread is not None:  # daemons: one in a long encode ends later
                    lane.thread.join(max(0.0, deadline - time.monotonic()))
        left = list(self._outstanding.values())
        self._outstanding.clear()
        self._ready_queries.clear()
        self._ready_adds.clear()
        return left

    def _take(self, ready: collections.deque[Prepared]) -> Prepared | None:
        while ready:
            prepared = ready.popleft()
            if self._outstanding.pop(id(prepared.command), None) is not None:
                return prepared
        return None

    # ------------------------------------------------------------------ the workers

    def _work(self, lane: _Lane) -> None:
        lane.rules.tokenizer  # noqa: B018 - makes this thread's copy now, not at a job
        while (command := lane.jobs.get()) is not _CLOSE:
            if self._closed:
                return
            try:
                if isinstance(command, AddCommand):
                    result = lane.rules.prepare_add(command, self._should_stop)
                else:
                    result = lane.rules.run_query(command.query)
            except Exception as e:  # noqa: BLE001 - the loop answers it (a 400, or a 500)
                prepared = Prepared(command, None, e)
            else:
                prepared = Prepared(command, result, None)
            if self._closed:  # close() has answered for it: drop what it made
                return
            ready = self._ready_adds if isinstance(command, AddCommand) else self._ready_queries
            ready.append(prepared)
            self._on_ready()

    def _should_stop(self, command: AddCommand) -> bool:
        return self._closed or self._is_cancelled(command)


@dataclasses.dataclass
class _Lane:
    name: str
    rules: PromptRules
    jobs: queue.SimpleQueue = dataclasses.field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None


class PromptRules:
    """How a server request's prompts become token ids, as the engine would make them,
    with a tokenizer copy of their own (made at its first use, by the thread that uses
    it), or with `own_copy=False` the given tokenizer itself (for the thread that owns
    it: the frontend's event loop prepares small jobs inline)."""

    def __init__(self, tokenizer: Tokenizer | None, no_tokenizer_reason: str,
                 model_name: str, max_model_len: int, own_copy: bool = True) -> None:
        self._source_tokenizer = tokenizer if own_copy else None
        self._own: Tokenizer | None = None if own_copy else tokenizer
        self._no_tokenizer_reason = no_tokenizer_reason
        self._model_name = model_name
        self._max_model_len = max_model_len

    @property
    def tokenizer(self) -> Tokenizer | None:
        if self._own is None and self._source_tokenizer is not None:
            self._own = _own_copy(self._source_tokenizer)
            self._source_tokenizer = None
        return self._own

    def prepare_add(self, command: AddCommand,
                    should_stop: Callable[[AddCommand], bool] = lambda command: False
                    ) -> list[PreparedPrompt]:
        """Each prompt's token ids (and, `with_text`, the text of token-id prompts). With
        `check_length`, ContextLengthExceeded if any prompt + its max_tokens is past
        max-model-len; RequestRejected for a prompt the engine would refuse for its length
        (here, not on the engine's thread after it was copied there). Either way nothing
        of the add is applied. Asks `should_stop` before each prompt (a 503 if so; the
        checks after the last prompt, and queries, run to their end)."""
        prepared = []
        for prompt in command.prompts:
            if should_stop(command):
                raise _Stopped("the request was stopped while its prompts were tokenized")
            prepared.append(self._prepare(prompt))
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
                                                     template_kwargs=kwargs,
                                                     tools=prompt.tools)
            text = tokenizer.render_chat(messages, query.add_generation_prompt,
                                         template_kwargs=kwargs, tools=prompt.tools)
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
            return PreparedPrompt(None, tuple(self.tokenizer.apply_chat_template(
                list(prompt.messages), template_kwargs=dict(prompt.template_kwargs),
                tools=prompt.tools)))
        text, ids = self._tokenize(prompt)
        return PreparedPrompt(text, tuple(ids))

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
