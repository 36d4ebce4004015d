"""Rejection sampling: verify a step's draft tokens against the target model's logits,
keeping the target's distribution exactly (speculative sampling, Leviathan et al. 2023;
Chen et al. 2023).

Per request with drafts x_1..x_K drawn from q, at each draft position j (in order) the
target's distribution p_j (after the request's penalties, temperature, top-k, top-p and
min-p, exactly as the plain `Sampler` computes it) accepts x_j with probability
min(1, p_j(x_j) / q_j(x_j)); the first rejection emits a token drawn from
normalize(max(p_j - q_j, 0)) and ends the request's step; if all K are accepted, the
bonus position adds a token drawn from p_{K+1}. Each emitted token then has the target's
distribution given the tokens before it. A point-mass draft (n-gram lookup, greedy
drafting: `draft_probs=None`) is q = one-hot(x): accept with probability p(x), else draw
from p with x removed. Greedy rows keep the drafts that equal the argmax, then emit the
argmax at the first mismatch (or the bonus position).

Everything is vectorised over the rows of `target_logits` (one per draft position plus
one bonus row per request), no host sync: the per-request decisions meet only in a
[num_reqs, max_K + 1] table at the end.

Randomness. Each row draws Exp(1) noise of width vocab + 1: columns 0..vocab-1 drive the
exponential race that samples the recovered / bonus token, the last column gives the
uniform of the accept test (u = 1 - exp(-e)). A seeded request's row at output position
`step + j` takes `seeded_exponential(seed, step + j, vocab + 1)`, whose first vocab
columns are exactly what the plain sampler draws at that position: the noise depends only
on seed and position, so a seeded request emits the same tokens in any batch, and a row
without drafts samples exactly what the plain sampler samples. A draft model that samples
with the same seed must salt it (its noise has to be independent of the verifier's).

Worked example, 2 requests with drafts [3, 0] (cu_num_draft_tokens = [0, 3, 3]):
    target_logits rows  = [r0.d1 r0.d2 r0.d3 r0.bonus | r1.bonus]
    first_row = [0, 4], row_req = [0 0 0 0 1], row_pos = [0 1 2 3 0]
    if r0 accepts d1 and d2 and rejects d3 (recovered token t):
    output_token_ids = [[d1 d2 t -1], [b -1 -1 -1]], num_emitted = [3, 1]
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from llmfast.sampling_params import GREEDY_TEMPERATURE
from llmfast.worker.sampling.sampler import (
    LogprobsTensors,
    exponential_noise,
    exponential_race,
    is_plain_greedy,
    process_logits,
    random_probs,
)
from llmfast.worker.sampling.sampling_metadata import LogitRules, SamplingMetadata

__all__ = ["RejectionOutput", "expand_metadata", "rejection_sample"]

# Per-request fields the rows take as they are (indexed by the row's request).
_ROW_COPIED = ("grammar_bitmask", "step", "output_token_ids", "logit_rules")


@dataclass
class RejectionOutput:
    # [num_reqs, max_K + 1] int64: accepted drafts then the recovered or bonus token,
    # padded with -1.
    output_token_ids: torch.Tensor
    num_emitted: torch.Tensor  # [num_reqs] int64, 1..K_i + 1
    # Laid out like output_token_ids: sampled_logprobs [num_reqs, max_K + 1], topk_ids and
    # topk_logprobs [num_reqs, max_K + 1, max_num_logprobs]; entries past num_emitted are
    # padding. None when no request wants logprobs.
    logprobs: LogprobsTensors | None = None


def expand_metadata(md: SamplingMetadata, row_req: torch.Tensor, row_pos: torch.Tensor,
                    drafts_before: torch.Tensor | None) -> SamplingMetadata:
    """Per-request metadata -> per-row metadata for the verify step's logits rows.

    A row at position j of its request samples output token number step + j, after the
    request's drafts 1..j were accepted: its step is step + j (seeds, min_tokens) and its
    penalties count those drafts as output tokens (`drafts_before` [num_rows, max_K],
    row r's drafts before its position, padded with an id >= vocab_size; None when
    no_penalties). The host flags hold for the rows as for their requests.
    """
    def rows(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, row_req)

    fields = {f.name: rows(getattr(md, f.name)) for f in dataclasses.fields(md)
              if f.name not in _ROW_COPIED and isinstance(getattr(md, f.name), torch.Tensor)}
    fields["step"] = md.step.index_select(0, row_req) + row_pos
    if md.output_token_ids is not None and drafts_before is not None:
        fields["output_token_ids"] = torch.cat(
            [rows(md.output_token_ids), drafts_before], dim=1)
    if md.logit_rules is not None:
        fields["logit_rules"] = LogitRules(
            **{f.name: rows(getattr(md.logit_rules, f.name))
               for f in dataclasses.fields(md.logit_rules)})
    return dataclasses.replace(md, **fields)


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: torch.Tensor,
                     cu_num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     md: SamplingMetadata,
                     max_num_draft_tokens: int | None = None) -> RejectionOutput:
    """Verify each request's drafts; see the module doc.

    target_logits: [num_reqs + num_drafts, vocab_size], per request in batch order its
        K_i draft positions then its bonus position (K_i = 0: a plain decode row).
    draft_token_ids: [num_drafts] int64; cu_num_draft_tokens: [num_reqs + 1] (cu[0] = 0).
    draft_probs: [num_drafts, vocab_size] float32, the distribution each draft was drawn
        from, or None for point masses on the drafts.
    md: the step's per-request SamplingMetadata. Its grammar_bitmask, if any, must have
        one row per target_logits row (the grammar advanced through each draft prefix).
    max_num_draft_tokens: max K_i (a host int, sizes the output). Pass it: without it,
        it is read from cu_num_draft_tokens, a host sync when that lives on a GPU.
    """
    device = target_logits.device
    num_rows, vocab_size = target_logits.shape
    num_reqs = cu_num_draft_tokens.shape[0] - 1
    num_drafts = draft_token_ids.shape[0]
    if num_rows != num_reqs + num_drafts:
        raise ValueError(f"target_logits has {num_rows} rows; {num_reqs} requests with "
                         f"{num_drafts} drafts need {num_reqs + num_drafts}")
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts, vocab_size):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}; "
                         f"expected ({num_drafts}, {vocab_size})")
    if md.grammar_bitmask is not None and md.grammar_bitmask.shape[0] != num_rows:
        raise ValueError("a grammar bitmask for speculative decoding needs one row per "
                         f"target_logits row ({num_rows}), got {md.grammar_bitmask.shape[0]}")
    cu = cu_num_draft_tokens.to(torch.int64)
    if max_num_draft_tokens is None:
        max_num_draft_tokens = int((cu[1:] - cu[:-1]).max()) if num_reqs else 0
    max_k = max_num_draft_tokens

    # ---- row layout (module doc's example)
    num_drafts_per_req = cu[1:] - cu[:-1]  # [num_reqs]
    first_row = cu[:-1] + torch.arange(num_reqs, device=device)  # [num_reqs]
    row_ids = torch.arange(num_rows, device=device)
    row_req = torch.searchsorted(first_row, row_ids, right=True) - 1  # [num_rows]
    row_pos = row_ids - first_row[row_req]  # [num_rows] 0..K_i
    is_draft_row = row_pos < num_drafts_per_req[row_req]  # [num_rows]
    if num_drafts:
        flat = (cu[:-1][row_req] + row_pos).clamp_(max=num_drafts - 1)
        row_draft = torch.where(is_draft_row, draft_token_ids[flat], -1)  # [num_rows]
    else:
        row_draft = torch.full((num_rows,), -1, dtype=torch.int64, device=device)

    # [num_reqs, max_K + 1]: the table positions 0..K_i of each request map to its rows.
    pos = torch.arange(max_k + 1, device=device)
    in_req = pos[None, :] <= num_drafts_per_req[:, None]
    table_rows = torch.where(in_req, first_row[:, None] + pos[None, :], first_row[:, None])
    table_drafts = row_draft[table_rows]  # [num_reqs, max_K + 1], -1 past the drafts

    # ---- the target's token (greedy: argmax; random: recovered / bonus) and accept test
    # per row; each stage as the plain Sampler runs it, on the expanded rows.
    if is_plain_greedy(md):
        token_at_row = target_logits.argmax(dim=-1)
        accept = token_at_row == row_draft
        raw_logprobs = None
    else:
        drafts_before = None
        if not md.no_penalties:
            # Row r's drafts before its position: table_drafts of its request, masked.
            drafts_before = table_drafts[:, :max_k][row_req]  # [num_rows, max_K]
            drafts_before = torch.where(pos[None, :max_k] < row_pos[:, None],
                                        drafts_before, vocab_size)
        row_md = expand_metadata(md, row_req, row_pos, drafts_before)
        logits = process_logits(target_logits, row_md)
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)
        greedy_token = None if md.all_random else logits.argmax(dim=-1)
        if md.all_greedy:
            token_at_row = greedy_token
            accept = greedy_token == row_draft
        else:
            token_at_row, accept = _random_rows(logits, row_md, row_draft, is_draft_row,
                                                cu, row_req, draft_probs)
            if greedy_token is not None:
                is_greedy = row_md.temperature < GREEDY_TEMPERATURE
                token_at_row = torch.where(is_greedy, greedy_token, token_at_row)
                accept = torch.where(is_greedy, greedy_token == row_draft, accept)

    # ---- per request: the accepted prefix, then the row's own token
    accepted = (accept[table_rows] & (pos[None, :] < num_drafts_per_req[:, None]))
    num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [num_reqs]
    num_emitted = num_accepted + 1
    out = torch.where(pos[None, :] < num_accepted[:, None], table_drafts,
                      token_at_row[table_rows])
    out = torch.where(pos[None, :] < num_emitted[:, None], out, -1)

    logprobs = None
    if raw_logprobs is not None:
        # Gathered per row, never as a [num_reqs, max_K + 1, vocab_size] copy.
        sampled_lp = raw_logprobs[table_rows, out.clamp(min=0)]  # [num_reqs, max_K + 1]
        topk_lp, topk_ids = raw_logprobs.topk(md.max_num_logprobs, dim=-1)  # [num_rows, k]
        logprobs = LogprobsTensors(sampled_lp, topk_ids[table_rows], topk_lp[table_rows])
    return RejectionOutput(out, num_emitted, logprobs)


def _random_rows(logits: torch.Tensor, row_md: SamplingMetadata, row_draft: torch.Tensor,
                 is_draft_row: torch.Tensor, cu: torch.Tensor, row_req: torch.Tensor,
                 draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random rows: (the token each row emits if it is the request's first rejection or
    its bonus row, whether each draft row accepts its draft), both [num_rows]."""
    num_rows, vocab_size = logits.shape
    probs = random_probs(logits, row_md)  # [num_rows, vocab_size] p
    noise = exponential_noise(row_md, num_rows, vocab_size + 1, logits.device)
    uniform = -torch.expm1(-noise[:, vocab_size])  # [num_rows] in [0, 1)
    draft_col = row_draft.clamp(min=0)[:, None]  # bonus rows read column 0, unused
    p_draft = probs.gather(1, draft_col).squeeze(1)  # [num_rows] p(x)
    if draft_probs is None:
        # q = one-hot(x): accept with probability p(x); the residual is p without x.
        accept = uniform < p_draft
        residual = probs.scatter_(1, draft_col, torch.where(is_draft_row, 0.0, p_draft)[:, None])
    else:
        # The draft rows' q, placed at their rows; bonus rows keep q = 0 (residual = p).
        num_drafts = draft_probs.shape[0]
        draft_ids = torch.arange(num_drafts, device=logits.device)
        draft_rows = draft_ids + torch.searchsorted(cu[1:], draft_ids, right=True)
        q = torch.zeros_like(probs).index_copy_(0, draft_rows, draft_probs.float())
        q_draft = q.gather(1, draft_col).squeeze(1)
        accept = uniform * q_draft < p_draft  # u < p(x) / q(x) without dividing by 0
        residual = (probs - q).clamp_min_(0.0)
        # p == q (to rounding) leaves no residual; rejection then has probability ~0,
        # and p keeps the token a valid one.
        residual = torch.where(residual.amax(dim=-1, keepdim=True) > 0, residual, probs)
    # The race needs no normalisation: argmax(r_i / e_i) picks i with prob r_i / sum(r).
    token = exponential_race(residual, noise[:, :vocab_size])
    return token, accept & is_draft_row
