"""Prompt logprobs (vLLM's `prompt_logprobs`): for the requests that ask, each prompt
token's logprob given the tokens before it, with the top-n alternatives.

The logits at position p score token p + 1, so a step that computes positions
[c, c + k) of a prompt of L tokens scores prompt tokens c + 1 .. min(c + k, L - 1);
position L - 1's logits score the first generated token and are the sampler's. Across
chunked-prefill steps the chunks follow each other; the engine joins them.

Three parts, none with a per-token Python loop or a host sync:
- `plan_prompt_logprobs` (host, numpy): which of the step's token rows to score and
  against which prompt token; None, after one vectorised test, when no row asks.
- `compute_prompt_logprobs` (device): log-softmax in float32 of those rows' logits, in
  slices of rows so the [rows, vocab] temporaries stay the sampler's size; packed into
  one float64 tensor (ids and ranks are exact in it) so one copy brings it to the host.
- `unpack_prompt_logprobs` (host): the copied tensor split per request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmfast.core.scheduler_output import PromptLogprobsChunk
from llmfast.worker.buffers import StagingBuffer

if TYPE_CHECKING:
    from llmfast.worker.input_batch import InputBatch

# Columns of the packed result before the top-n ids and logprobs.
_LOGPROB, _RANK, _TOP = 0, 1, 2


@dataclass(frozen=True)
class PromptSpan:
    """One request's rows in the packed result."""

    req_id: str
    first_index: int  # the prompt token its first row scores
    start: int  # its first row in the packed result
    count: int
    num_top: int


@dataclass
class PromptLogprobsPlan:
    token_rows: torch.Tensor  # [m] int64, device: rows of the step's tokens to score
    target_ids: torch.Tensor  # [m] int64, device: the prompt token each row scores
    max_num_top: int  # the most top-n any of the step's requests asked for
    spans: list[PromptSpan]


class PromptLogprobsStaging:
    """The staging buffers a plan's index tensors go to the device through."""

    def __init__(self, device: torch.device) -> None:
        self.token_rows = StagingBuffer(torch.int64, device)
        self.target_ids = StagingBuffer(torch.int64, device)


def plan_prompt_logprobs(batch: InputBatch, num_sched: np.ndarray,
                         staging: PromptLogprobsStaging) -> PromptLogprobsPlan | None:
    """Call after `StepInputs.prepare` (the batch's computed counts include this step).

    Worked example, num_scheduled [4, 3, 2], computed before [0, 0, 6], num_prompt
    [9, 3, 8], rows 0 and 2 asking: row 0 scores tokens 1..4 from step rows 0..3; row 2
    computes positions 6, 7 and scores token 7 only (7's logits are the sampler's):
        token_rows = [0 1 2 3 7], target_ids = prompt[0][1:5] + [prompt[2][7]]
    """
    n = len(num_sched)
    want = batch.num_prompt_logprobs[:n]
    if want.max(initial=-1) < 0:
        return None
    computed = batch.num_computed_tokens[:n] - num_sched  # before this step
    end = np.minimum(computed + num_sched, batch.num_prompt_tokens[:n] - 1)
    counts = np.where(want >= 0, np.maximum(end - computed, 0), 0)
    rows = np.flatnonzero(counts)
    if not len(rows):
        return None
    counts = counts[rows]
    run_starts = np.cumsum(counts) - counts  # each request's first row in the result
    within = np.arange(int(counts.sum())) - np.repeat(run_starts, counts)
    step_starts = (np.cumsum(num_sched) - num_sched)[rows]
    positions = np.repeat(computed[rows], counts) + within
    token_rows = np.repeat(step_starts, counts) + within
    target_ids = batch.token_ids[np.repeat(rows, counts), positions + 1].astype(np.int64)
    num_top = want[rows]
    spans = [PromptSpan(batch.req_ids[r], c + 1, s, k, t) for r, c, s, k, t in zip(
        rows.tolist(), computed[rows].tolist(), run_starts.tolist(), counts.tolist(),
        num_top.tolist())]
    return PromptLogprobsPlan(staging.token_rows.stage(token_rows),
                              staging.target_ids.stage(target_ids),
                              int(num_top.max()), spans)


def compute_prompt_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor],
                            plan: PromptLogprobsPlan, rows_per_slice: int) -> torch.Tensor:
    """[m, 2 + 2 * max_num_top] float64: per scored row its target's logprob and rank,
    then the top-n ids, then their logprobs. `logits_of(token_rows)` gives those rows'
    logits (computed here, slice by slice: a long prompt chunk's full [m, vocab] logits
    could take gigabytes)."""
    m, k = plan.token_rows.shape[0], plan.max_num_top
    out = torch.empty((m, _TOP + 2 * k), dtype=torch.float64, device=plan.token_rows.device)
    for s in range(0, m, rows_per_slice):
        e = min(m, s + rows_per_slice)
        logprobs = logits_of(plan.token_rows[s:e]).float().log_softmax(dim=-1)
        target = logprobs.gather(1, plan.target_ids[s:e, None])  # [rows, 1]
        out[s:e, _LOGPROB] = target[:, 0]
        # As vLLM counts it: the tokens at least as likely, the target included.
        out[s:e, _RANK] = (logprobs >= target).sum(dim=-1)
        if k:
            top_logprobs, top_ids = logprobs.topk(k, dim=-1)
            out[s:e, _TOP:_TOP + k] = top_ids
            out[s:e, _TOP + k:] = top_logprobs
    return out


def unpack_prompt_logprobs(packed: np.ndarray, spans: list[PromptSpan]
                           ) -> dict[str, PromptLogprobsChunk]:
    """The host copy of `compute_prompt_logprobs`' result, per request."""
    k = (packed.shape[1] - _TOP) // 2
    chunks = {}
    for span in spans:
        block = packed[span.start:span.start + span.count]
        top = slice(_TOP, _TOP + span.num_top)
        top_lp = slice(_TOP + k, _TOP + k + span.num_top)
        chunks[span.req_id] = PromptLogprobsChunk(
            first_index=span.first_index,
            logprobs=block[:, _LOGPROB].tolist(),
            ranks=block[:, _RANK].astype(np.int64).tolist(),
            top_ids=block[:, top].astype(np.int64).tolist(),
            top_logprobs=block[:, top_lp].tolist())
    return chunks
