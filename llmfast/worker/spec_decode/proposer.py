"""The proposer interface: what makes a step's draft tokens, and what it is given.

After a step's emitted tokens are known (the verify step's accepted drafts and its bonus
or recovered token, or a plain decode's one token), the runner asks its proposer for
up to K draft tokens per batch row that wants them. The scheduler sends the drafts back
with the next step (`SchedulerOutput.scheduled_spec_decode_tokens`), the runner feeds
each row's last known token and its drafts as one (1 + K)-token query, and the rejection
sampler (rejection_sampler.py) keeps the longest prefix the target agrees with.

Two proposers implement it: n-gram prompt lookup (ngram_proposer.py: no model, on the
host) and a draft model (draft_proposer.py: a smaller model of the same tokenizer with
its own KV cache laid out like the target's, same block ids and slot mapping). A
proposer that writes KV for positions past the scheduled tokens (a draft model runs K
steps ahead) says so in `num_lookahead_slots`; the scheduler then allocates that many
more slots per drafting request, so the draft's writes land in blocks the request owns.

Worked example of the verify step this feeds, K = 3, one request with 10 known tokens
(9 computed) and drafts [d1 d2 d3]: the query is [t9 d1 d2 d3] at positions 9..12; the
target's logits at those four positions check d1, d2, d3 and give the bonus token. If
d1, d2 are accepted and d3 rejected, the step emits [d1 d2 r] (r from the target's
distribution at position 11) and 12 tokens are computed: position 12's KV (written for
d3) is stale and is overwritten next step, where the request's num_computed_tokens
restarts from 12.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ProposalInputs:
    """What a proposer may read after a step, one entry per batch row 0..n-1 (the rows
    as they were at the step's launch; nothing changes them before `propose` returns).

    Host side (every proposer):
    """

    req_ids: list[str]  # [n] the rows' requests
    # [max_num_reqs, max_model_len] int32: each row's prompt then output tokens, this
    # step's emitted tokens included (the runner writes them before proposing).
    token_ids: np.ndarray
    num_tokens: np.ndarray  # [n] int32: known tokens per row, emitted ones included
    # [n] int32: how many drafts each row may get (0: none, e.g. a prefill chunk short of
    # its prompt's end, or a request using a feature speculation does not support);
    # at most the configured K.
    max_num_drafts: np.ndarray
    # Device side (a model proposer; the n-gram proposer ignores it): the step that just
    # ran, see `StepTensors`. None when the step ran nothing a model proposer could use.
    step: StepTensors | None = None


@dataclass
class StepTensors:
    """The target step that just ran, on the device: what a draft model needs to catch
    its own KV cache up with the target's (same positions, same slots) and to start
    proposing from the emitted tokens. Views of the runner's persistent buffers, valid
    until the next step's inputs are prepared."""

    input_ids: torch.Tensor  # [num_tokens] int64: the step's query tokens
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64 (-1: padding)
    query_start_loc: torch.Tensor  # [n + 1] int32
    seq_lens: torch.Tensor  # [n] int32: context length after the step
    block_table: torch.Tensor  # [n, max_blocks_per_req] int32
    # [n, max_K + 1] int64: per row, the emitted tokens (accepted drafts then the bonus
    # or recovered token), padded with -1; [n, 1] after a plain step.
    output_token_ids: torch.Tensor
    num_emitted: torch.Tensor  # [n] int32 (0: the row sampled nothing this step)


@dataclass
class Drafts:
    """A proposer's answer, per row 0..n-1."""

    token_ids: np.ndarray  # [n, K] int64, the drafts left-aligned, padded with -1
    num_drafts: np.ndarray  # [n] int32: how many of the row's entries are drafts
    # [n, K, vocab] float32: the distribution each draft was drawn from (a draft model
    # sampling with temperature), on the device; None for point masses (n-gram, greedy
    # drafting), which the rejection sampler treats as probability 1 on the draft.
    probs: torch.Tensor | None = None

    def as_lists(self) -> list[list[int]]:
        """Per row, its drafts as a plain list (what crosses to the scheduler)."""
        ids, counts = self.token_ids, self.num_drafts
        if not counts.any():
            return [[] for _ in range(len(counts))]
        return [row[:c].tolist() if c else [] for row, c in zip(ids, counts.tolist())]


class Proposer(ABC):
    """Draft tokens for the next step. One instance per runner."""

    # KV slots past a request's scheduled tokens that `propose` writes (see the module
    # doc): the scheduler allocates them; 0 for a proposer without a KV cache.
    num_lookahead_slots: int = 0
    # A draft model the proposer runs (None: none): the runner routes its projections to
    # the GEMV as the target's (worker/startup/gemv_routing.py).
    model: torch.nn.Module | None = None

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens  # K

    def kv_block_bytes(self, block_size: int) -> int:
        """Bytes one block of the proposer's own KV cache takes (0: none): the target's
        KV-cache sizing counts them in every block."""
        return 0

    def initialize(self, num_blocks: int, block_size: int) -> None:
        """Called once the target's KV cache is sized (a draft model allocates its own
        cache of the same blocks here). Nothing to do by default."""

    @abstractmethod
    def propose(self, inputs: ProposalInputs) -> Drafts:
        """Up to `inputs.max_num_drafts[r]` drafts for each row r."""
