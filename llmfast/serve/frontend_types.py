"""The frontend's types: what the HTTP handlers and the frontend (frontend.py) pass each
other, both in the API process (the server's one, or each of `--api-servers N`):
prompts in, per-choice deltas out, the queue each HTTP request reads them from
(`DeltaQueue`), and the interface the handlers see (`EngineFront`). What crosses to the
engine core's process is engine/messages.py's.

Plain data only (picklable, no torch).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from llmfast.core.scheduler_stats import SchedulerStats
    from llmfast.sampling_params import SamplingParams


@dataclass(frozen=True)
class Limits:
    """The engine's limits the HTTP side checks requests against."""

    max_n: int  # most choices per prompt: what can run in one step (max-num-seqs)
    max_model_len: int
    # What a request gets for the sampling fields it leaves unset, as (SamplingParams
    # field, value) pairs: the model's generation_config.json (EngineConfig's).
    sampling_defaults: tuple[tuple[str, Any], ...] = ()
    vocab_size: int | None = None  # the model's: logit_bias / allowed_token_ids ids below it
    # Text longer than this cannot fit max-model-len tokens whatever it says (a bound from
    # the tokenizer's longest token, `prompt_chars_bound`): refused before the engine
    # spends seconds tokenizing it. None: no tokenizer, no bound.
    max_prompt_chars: int | None = None
    # How chat's tool_choice "auto" reads calls from the output (serve/api/tool_parsers.py).
    tool_call_parser: str | None = None


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """Messages to render with the tokenizer's chat template (on the engine's side)."""

    messages: tuple[dict[str, str], ...]
    # More variables for the template (vLLM's chat_template_kwargs), as (name, value).
    template_kwargs: tuple[tuple[str, Any], ...] = ()
    tools: tuple[dict, ...] | None = None  # OpenAI's tools, for the template


PromptInput = str | list[int] | ChatPrompt


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    text: str | None
    # A tuple: the HTTP side keeps it for the request's life (usage, echo), and the
    # collector stops tracking a tuple of ints (a list's elements it walks every full
    # collection: core/request.py's module doc).
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    token_id: int
    logprob: float | None  # None: a prompt's first token (nothing precedes it)
    top: tuple[tuple[str, int, float], ...]  # the top-k (token, id, logprob), best first
    rank: int | None = None  # prompt tokens: the token's rank (1 = the most likely)


class ChoiceDelta(NamedTuple):
    """What one step did for one choice of an HTTP request.

    A named tuple rather than a frozen dataclass: the engine thread makes one per
    streaming request and step (0.3 µs from positional arguments against 1.3 µs), and
    it goes to the HTTP processes as the plain tuple it is."""

    index: int  # choice index in the response (prompt_index * n + sample_index)
    text: str  # new visible text
    num_new_tokens: int
    num_output_tokens: int  # so far
    num_cached_tokens: int  # prompt tokens found in the prefix cache
    logprobs: tuple[TokenLogprob, ...] | None
    finish_reason: str | None
    stop_reason: str | int | None
    # Every prompt token's, once, with the choice's first delta (when asked for).
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


def merge_deltas(first: ChoiceDelta, later: ChoiceDelta) -> ChoiceDelta:
    """One delta for two consecutive ones of the same choice: what both together did
    (their text and logprobs joined, the later's counts and finish). A client reading a
    lagging stream gets one chunk of several tokens instead of one per token, as vLLM
    merges the outputs its API side has not taken yet."""
    logprobs = None
    if first.logprobs is not None or later.logprobs is not None:
        logprobs = (first.logprobs or ()) + (later.logprobs or ())
    return ChoiceDelta(
        index=later.index,
        text=first.text + later.text,
        num_new_tokens=first.num_new_tokens + later.num_new_tokens,
        num_output_tokens=later.num_output_tokens,
        num_cached_tokens=later.num_cached_tokens,
        logprobs=logprobs,
        finish_reason=later.finish_reason,
        stop_reason=later.stop_reason,
        prompt_logprobs=(first.prompt_logprobs if first.prompt_logprobs is not None
                         else later.prompt_logprobs),
    )


def merged_in_order(items: list[ChoiceDelta | StreamError], with_logprobs: bool = True
                    ) -> list[ChoiceDelta | StreamError]:
    """`items` with the deltas of each choice merged into its first one's place (each
    choice's own order kept; a choice's finished delta takes no more; an error keeps its
    place, and nothing before it merges with anything after it). `with_logprobs=False`:
    deltas that carry logprobs are not merged (a completion's logprobs give each token's
    text offset, which only the delta-by-delta text gives right).

    E.g. [c0 "a", c1 "x", c0 "b", error, c0 "c"] -> [c0 "ab", c1 "x", error, c0 "c"]."""
    out: list[ChoiceDelta | StreamError] = []
    open_at: dict[int, int] = {}  # choice index -> its delta's place in `out`
    for item in items:
        if isinstance(item, StreamError):
            open_at.clear()
            out.append(item)
            continue
        at = open_at.get(item.index)
        if at is not None and (with_logprobs or (out[at].logprobs is None
                                                 and item.logprobs is None)):
            out[at] = merge_deltas(out[at], item)
        else:
            open_at[item.index] = len(out)
            out.append(item)
        if out[open_at[item.index]].finish_reason is not None:
            del open_at[item.index]
    return out


@dataclass(frozen=True, slots=True)
class StreamError:
    """The engine cannot finish this request (shutdown, an internal failure)."""

    message: str
    status: int


class EngineUnavailable(RuntimeError):
    """The front is stopping or stopped; no new requests."""


class ContextLengthExceeded(ValueError):
    """A prompt plus the max_tokens its client asked for is past max-model-len (a 400 with
    OpenAI's code "context_length_exceeded")."""


@dataclass(frozen=True, slots=True)
class TokenizeQuery:
    """/tokenize: a prompt's token ids, as a request with this prompt would get them."""

    prompt: str | ChatPrompt
    add_special_tokens: bool | None  # None: what a request does (the template's own, for chat)
    add_generation_prompt: bool = True  # chat only


@dataclass(frozen=True, slots=True)
class DetokenizeQuery:
    """/detokenize: the text of token ids, special tokens kept."""

    token_ids: tuple[int, ...]


Query = TokenizeQuery | DetokenizeQuery


class DeltaQueue:
    """The outputs of one HTTP request: `ChoiceDelta`s, then possibly a `StreamError`."""

    def __init__(self, request_id: str, num_choices: int) -> None:
        self.request_id = request_id
        self.num_choices = num_choices
        self.engine_ids = [f"{request_id}-{i}" for i in range(num_choices)]
        self._queue: asyncio.Queue[ChoiceDelta | StreamError] = asyncio.Queue()

    def put(self, item: ChoiceDelta | StreamError) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> ChoiceDelta | StreamError:
        return await self._queue.get()

    def get_nowait(self) -> ChoiceDelta | StreamError | None:
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    async def get_ready(self) -> list[ChoiceDelta | StreamError]:
        """The next item (waiting for it), and every item queued behind it now."""
        items = [await self._queue.get()]
        while (item := self.get_nowait()) is not None:
            items.append(item)
        return items


def check_open(front: EngineFront) -> None:
    """EngineUnavailable unless `front` takes new work (an add or a query)."""
    if front.failure is not None:
        raise EngineUnavailable(f"the engine stopped: {front.failure}")
    if not front.running:
        raise EngineUnavailable("the server is shutting down")


class EngineFront(Protocol):
    """What the HTTP side uses of the engine: `frontend.Frontend` is one (over the
    engine core's process); a test's stand-in can be another."""

    limits: Limits
    failure: str | None  # why the engine stopped for good; None while it serves
    stats: SchedulerStats  # the latest snapshot
    num_steps: int

    @property
    def running(self) -> bool: ...

    def start(self) -> None: ...

    async def add(self, stream: DeltaQueue, prompts: Sequence[PromptInput],
                  params: Sequence[SamplingParams], *, with_text: bool = False,
                  check_length: bool = False) -> list[PreparedPrompt]: ...

    async def query(self, query: Query) -> list[int] | str: ...

    def abort(self, engine_ids: Sequence[str]) -> None: ...

    def stop(self, message: str = ...) -> None: ...

    def stop_threadsafe(self, message: str = ...) -> None: ...

    def join(self, timeout: float | None = None) -> None: ...
