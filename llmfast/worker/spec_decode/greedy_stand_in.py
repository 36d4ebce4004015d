"""A greedy-only stand-in for rejection_sampler.py's `rejection_sample`, same signature,
until that module is merged (then the runner imports it instead and this file goes).

Rows without drafts are sampled by the regular `Sampler` (every sampling feature); rows
with drafts must be greedy: a draft is accepted while it equals the target's argmax, and
the step emits the accepted drafts then the argmax at the first rejected position (or
the bonus position).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmfast.worker.sampling.sampler import LogprobsTensors, Sampler, SamplingMetadata


@dataclass
class RejectionOutput:
    # [num_reqs, max_K + 1] int64: accepted drafts then the recovered or bonus token,
    # padded with -1.
    output_token_ids: torch.Tensor
    num_emitted: torch.Tensor  # [num_reqs] int64
    logprobs: LogprobsTensors | None = None


_sampler = Sampler()


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                     cu_num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     md: SamplingMetadata) -> RejectionOutput:
    device = target_logits.device
    cu = cu_num_draft_tokens.to(torch.int64)
    num_reqs = cu.shape[0] - 1
    num_drafts = cu[1:] - cu[:-1]  # [num_reqs]
    max_k = int(num_drafts.max()) if num_reqs else 0
    # Each request's rows in target_logits start at cu[i] + i; its last (bonus) row is
    # cu[i + 1] + i.
    first_row = cu[:-1] + torch.arange(num_reqs, device=device)
    last_row = cu[1:] + torch.arange(num_reqs, device=device)
    plain = _sampler(target_logits[last_row], md)  # [num_reqs]: rows without drafts
    argmax = target_logits.argmax(dim=-1)  # [num_rows]
    j = torch.arange(max_k + 1, device=device)
    in_row = j[None, :] <= num_drafts[:, None]  # [num_reqs, max_k + 1]
    rows = torch.where(in_row, first_row[:, None] + j[None, :], 0)
    target = torch.where(in_row, argmax[rows], -1)  # argmax per position
    drafts = torch.full((num_reqs, max_k + 1), -2, dtype=torch.int64, device=device)
    is_draft = j[None, :max_k] < num_drafts[:, None]  # [num_reqs, max_k]
    if max_k:
        flat = torch.where(is_draft, cu[:-1, None] + j[None, :max_k], 0)
        drafts[:, :max_k] = torch.where(is_draft, draft_token_ids[flat], -2)
    accepted = (drafts == target).to(torch.int64).cumprod(dim=1).sum(dim=1)  # [num_reqs]
    num_emitted = accepted + 1
    out = torch.where(j[None, :] < num_emitted[:, None], target, -1)
    # Rows without drafts take the regular sampler's token.
    out[:, 0] = torch.where(num_drafts > 0, out[:, 0], plain.sampled_token_ids)
    return RejectionOutput(out, num_emitted, plain.logprobs)
