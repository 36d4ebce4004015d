"""One generation request as the scheduler sees it: token ids, progress and status.

`num_computed_tokens` catches up to `num_tokens` (prompt plus generated tokens); there is no
prefill or decode phase. The scheduler advances it when it schedules tokens, so between
`schedule()` and `update()` it already counts the tokens in flight.

A step that reaches the end of a request's tokens samples one more, whose value the host
learns only when that step's output is collected. Until then it is a *placeholder*
(`num_output_placeholders`): with async scheduling the next step is scheduled before the
value arrives, and a decode in it computes the placeholder's position (the runner fills
the value in on the device). `all_token_ids` only ever holds known values.

The prompt is a tuple and `all_token_ids` an `array('q')`: the cyclic garbage collector
does not walk either (CPython stops tracking a tuple of ints at its first collection; an
array holds no Python objects). A list would be walked element by element on every full
collection: with 10 000 waiting requests of 1000-token prompts, a full collection took
149 ms on the CPU VM with two such lists each, 16 ms now
(profiles/serving.md).
"""

from __future__ import annotations

import enum
import functools
import time
from array import array
from collections.abc import Sequence

from llmfast.sampling_params import SamplingParams


class RequestRejected(ValueError):
    """A request that can never run (e.g. its prompt cannot fit); the message is one line."""


def check_prompt_length(num_tokens: int, max_model_len: int) -> None:
    """Reject a prompt that can never run: an empty one, or one that leaves no room for a
    generated token (num_tokens + 1 must be <= max_model_len). The engine and the
    scheduler both ask here, so a bad prompt reads the same wherever it is caught."""
    if num_tokens == 0:
        raise RequestRejected("the prompt is empty")
    if num_tokens >= max_model_len:
        raise RequestRejected(
            f"the prompt has {num_tokens} tokens; max-model-len {max_model_len} leaves no "
            "room to generate (raise --max-model-len or shorten the prompt)"
        )


def check_blocks_fit(num_tokens: int, block_size: int, num_usable_blocks: int) -> None:
    """Reject a prompt whose KV blocks (with room for one more token) the cache cannot
    hold at all: the scheduler asks here, and a frontend before a request leaves it."""
    if (num_tokens + 1 + block_size - 1) // block_size > num_usable_blocks:
        raise RequestRejected(
            f"the prompt has {num_tokens} tokens; with room for one more it needs "
            f"{(num_tokens + block_size) // block_size} KV-cache blocks of {block_size} "
            f"tokens, the cache has {num_usable_blocks}"
        )


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after PREEMPTED is a finished state (see `is_finished`).
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """Mutable per-request state, owned by the scheduler once added.

    Plain slots instead of a dataclass: the scheduler touches a few of these fields for
    every running request every step, and the derived fields (`stop_token_set`, the
    cached `max_tokens`/`min_tokens`) keep that hot path to attribute reads.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "eos_token_ids",
        "first_step",
        "max_tokens",
        "min_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "num_prompt_tokens",
        "output_token_ids",
        "prompt_token_ids",
        "request_id",
        "sampling_params",
        "spec_token_ids",
        "status",
        "stop_token_set",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: tuple[int, ...] = tuple(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.output_token_ids: list[int] = []
        # Prompt followed by outputs; appended in step with output_token_ids so that
        # block hashing and num_tokens never have to concatenate. (An array of int64:
        # the module doc says why not a list.)
        self.all_token_ids = array("q", self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        # Prefix-cache hashes of this request's full blocks, in order (block i covers
        # tokens [i * block_size, (i + 1) * block_size)). Kept across preemption so a
        # resumed request does not re-hash; filled by the KV cache manager.
        self.block_hashes: list = []
        # Tokens that end the request once more than min_tokens have been generated.
        self.stop_token_set = _stop_token_set(
            tuple(sampling_params.stop_token_ids),
            () if sampling_params.ignore_eos else self.eos_token_ids)
        self.max_tokens = sampling_params.max_tokens
        self.min_tokens = sampling_params.min_tokens
        # Sampled tokens scheduled but not yet known (see the module doc): 0 or 1 in the
        # synchronous loop, up to 2 with one step in flight.
        self.num_output_placeholders = 0
        # Index of the first scheduler step that may hold this request (set by the
        # scheduler on add): an output of an earlier step for the same id belongs to an
        # earlier request that used the id, and is dropped.
        self.first_step = 0
        # Speculative decoding: drafts proposed after the last step, verified in the next
        # one the request decodes in (empty: a plain decode). Never part of all_token_ids.
        self.spec_token_ids: list[int] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self.status)

    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )


@functools.lru_cache(maxsize=64)
def _stop_token_set(stop_token_ids: tuple[int, ...], eos_token_ids: tuple[int, ...]
                    ) -> frozenset[int]:
    """One frozenset per distinct (stop ids, EOS ids), shared by the requests that ask
    for it (most ask for the same): an object fewer per request for the collector."""
    return frozenset(stop_token_ids) | frozenset(eos_token_ids)
