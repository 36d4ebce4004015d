"""What the scheduler hands the model runner each step, and what comes back.

The scheduler never sends tensors; the runner never sees `Request` objects. A request's
full state crosses once (`NewRequestData`); afterwards only increments do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llmfast.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (its runner
    state was dropped when it was preempted, so it is sent whole again)."""

    req_id: str
    prompt_token_ids: list[int]
    # Tokens already generated (non-empty only for a request resumed after preemption).
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # before this step


@dataclass
class CachedRequestData:
    """Requests that ran last step and run again: only what changed."""

    req_ids: list[str] = field(default_factory=list)
    # Appended to the row; an empty tuple (shared) when a request got no new block.
    new_block_ids: list[Sequence[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens to compute this step
    total_num_scheduled_tokens: int
    # Ids whose runner state must go: finished or aborted since the last step.
    finished_req_ids: set[str]
    # Ids preempted this step (their runner state goes too; they come back as new).
    preempted_req_ids: set[str] = field(default_factory=set)
    # Which schedule() call made this (0, 1, ...): tells a late output's request apart
    # from a later one that reuses its id.
    step_index: int = 0
    # Speculative decoding: per request with drafts this step, its draft token ids (the
    # last num_scheduled_tokens - 1 of its scheduled tokens are these drafts).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class PromptLogprobsChunk:
    """One step's prompt logprobs for one request: prompt tokens `first_index`,
    `first_index + 1`, ... (each scored by the logits of the position before it), plain
    lists so that they pickle cheaply between processes."""

    first_index: int  # >= 1: the first prompt token has no logprob
    logprobs: list[float]  # per token: its logprob
    ranks: list[int]  # per token: its rank in the distribution (1 = the most likely)
    top_ids: list[list[int]]  # per token: the top-n ids, most likely first
    top_logprobs: list[list[float]]  # per token: their logprobs


@dataclass
class ModelRunnerOutput:
    """Per scheduled request, in `req_ids` order: the sampled token ids (empty for a
    prefill chunk that does not reach the end of the prompt; with speculative decoding
    the accepted drafts then the bonus or recovered token)."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request, per sampled token: (logprob of the sampled token, {token: logprob} top-n).
    logprobs: list[list[tuple[float, dict[int, float]]]] | None = None
    # Requests that asked for prompt logprobs and scored prompt tokens this step.
    prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None
    # Speculative decoding: per request (req_ids order), the drafts proposed for its next
    # step ([] for none); None when speculation is off.
    spec_token_ids: list[list[int]] | None = None
