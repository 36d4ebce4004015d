"""Batched, sync-free sampling: penalties, min_tokens, logprobs, greedy / filtered random.

One `Sampler.forward` call turns the logits of every request in the batch into one token
id each, without a single device→host synchronisation: per-request parameters arrive as
device tensors (`SamplingMetadata`), and only host-known flags (computed by the input
batch when the set of params changes) decide which stages run. Random rows use the
exponential race `argmax(probs / q)`, q ~ Exp(1); seeded rows draw q from a counter-based
hash of (seed, step, token id), so their tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from llmfast.sampling_params import (
    GREEDY_TEMPERATURE,
    SamplingParams,
    SamplingParamsError,
    seed_to_int64,
)
from llmfast.worker.sampling.grammar_bitmask import apply_grammar_bitmask
from llmfast.worker.sampling.sampling_metadata import SamplingMetadata

__all__ = [
    "GREEDY_TEMPERATURE",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingParams",
    "SamplingParamsError",
    "seed_to_int64",
    "seeded_exponential",
]

# Unsigned 64-bit constants as the signed values torch.int64 holds.
_i64 = seed_to_int64

# splitmix64 constants (Steele et al.), as signed int64 so torch accepts them.
_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
# Decorrelates the step counter from the seed before they are combined.
_STEP_SALT = _i64(0xD1B54A32D192ED03)
# Smallest normal float32: clamping q to it keeps probs / q finite (probs <= 1) and
# keeps masked tokens (prob 0) at exactly 0, never NaN.
_TINY = torch.finfo(torch.float32).tiny


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic; masking off the sign-extended bits makes it logical.
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser; int64 multiplication wraps on every torch backend."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def seeded_exponential(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise that depends only on (seed, step, token id). # [num_reqs, vocab_size]

    A row's key mixes its seed and step; token i then takes the i-th element of the
    splitmix64 stream started at that key. Integer ops only, so any device gives the
    same bits; the top 24 bits become a uniform in [0, 1 - 2**-24] exactly in float32.
    """
    row_key = _mix64(_mix64(seeds) ^ (steps * _STEP_SALT))  # [num_reqs]
    idx = torch.arange(1, vocab_size + 1, device=seeds.device, dtype=torch.int64)
    z = _mix64(row_key[:, None] + idx[None, :] * _GOLDEN)  # [num_reqs, vocab_size]
    u = _shr(z, 40).to(torch.float32) * (1.0 / (1 << 24))
    return -torch.log1p(-u)  # 1 - u is exact, so q = 0 only when u = 0


class LogprobsTensors(NamedTuple):
    sampled_logprobs: torch.Tensor  # [n] f32
    topk_ids: torch.Tensor  # [n, max_num_logprobs] int64
    topk_logprobs: torch.Tensor  # [n, max_num_logprobs] f32


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [n] int64, on the logits' device
    logprobs: LogprobsTensors | None


def _token_mask(ids: torch.Tensor, num_rows: int, vocab_size: int) -> torch.Tensor:
    """Bool [n, vocab_size]: True where the row's padded id list holds the token.

    Pads (any id >= vocab_size) land in a spare last column that is sliced off.
    """
    ids = ids.clamp(max=vocab_size)
    mask = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(1, ids, True)[:, :vocab_size]


def apply_logit_rules(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids (every other token -inf), then logit_bias (added). Returns a
    new tensor. # [n, vocab_size]"""
    n, vocab_size = logits.shape
    rules = md.logit_rules
    banned = ~(_token_mask(rules.allowed_ids, n, vocab_size) | ~rules.has_allowed[:, None])
    logits = logits.masked_fill(banned, float("-inf"))
    # Pads add 0.0 to the last token: no change, and no branch on the device.
    return logits.scatter_add_(1, rules.bias_ids, rules.bias_values)


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition (HF/vLLM) over prompt + output tokens, then OpenAI frequency/presence
    over output tokens only. Returns a new tensor. # [n, vocab_size]"""
    n, vocab_size = logits.shape
    out_ids = md.output_token_ids.clamp(max=vocab_size)
    counts = torch.zeros(n, vocab_size + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :vocab_size]  # [n, vocab_size]
    output_seen = counts > 0
    seen = _token_mask(md.prompt_token_ids, n, vocab_size) | output_seen
    rep = torch.where(seen, md.repetition_penalty[:, None], 1.0)
    # Dividing positive and multiplying negative logits both make a seen token less likely.
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - md.frequency_penalty[:, None] * counts
    return logits - md.presence_penalty[:, None] * output_seen


def apply_min_tokens(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Ban EOS / stop ids in rows that have not reached min_tokens yet."""
    n, vocab_size = logits.shape
    active = (md.step < md.min_tokens)[:, None]  # [n, 1]
    ids = torch.where(active, md.stop_token_ids, vocab_size)  # inactive rows: all pads
    return logits.masked_fill(_token_mask(ids, n, vocab_size), float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Mask tokens outside each row's top-k and top-p sets, in place.

    top-k keeps every token >= the k-th largest logit (ties at the threshold are kept)
    on both paths, so a row gets the same set whatever the rest of the batch enables.
    top-p keeps the smallest head of the sorted distribution with mass >= top_p.
    """
    vocab_size = logits.shape[-1]
    neg_inf = float("-inf")
    if md.no_top_p:
        # Sort-free: only the k_max largest values per row are needed for thresholds.
        k_max = min(md.max_top_k, vocab_size)
        top_vals = logits.topk(k_max, dim=-1, sorted=True).values  # [n, k_max]
        kth = (md.top_k.to(torch.int64) - 1).clamp(0, k_max - 1)[:, None]
        threshold = top_vals.gather(1, kth)  # [n, 1]
        threshold = threshold.masked_fill(md.top_k[:, None] <= 0, neg_inf)
        return logits.masked_fill_(logits < threshold, neg_inf)

    # Ascending, so the tail to drop is a prefix; stable so ties order the same in any batch.
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False, stable=True)
    if not md.no_top_k:
        k = md.top_k.to(torch.int64).clamp(0, vocab_size)
        # The k-th largest sits at ascending index V - k; k = 0 rows (off) get -inf.
        kth = (vocab_size - k).clamp(max=vocab_size - 1)[:, None]
        threshold = sorted_logits.gather(1, kth)
        threshold = threshold.masked_fill(k[:, None] <= 0, neg_inf)
        sorted_logits.masked_fill_(sorted_logits < threshold, neg_inf)
    cum = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)  # [n, vocab_size]
    drop = cum <= (1.0 - md.top_p)[:, None]
    drop[:, -1] = False  # the most likely token always survives
    sorted_logits.masked_fill_(drop, neg_inf)
    return logits.scatter_(1, sorted_idx, sorted_logits)


def apply_min_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Drop tokens with prob < min_p * max prob, in place. In logit space that is
    logit < max_logit + log(min_p): no softmax, and min_p = 0 gives -inf (off)."""
    threshold = logits.amax(dim=-1, keepdim=True) + md.min_p.log()[:, None]
    return logits.masked_fill_(logits < threshold, float("-inf"))


def compute_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
    sampled_lp = logprobs.gather(1, sampled[:, None]).squeeze(1)  # [n]
    topk_lp, topk_ids = logprobs.topk(k, dim=-1)  # [n, k]; k = 0 gives empty tensors
    return LogprobsTensors(sampled_lp, topk_ids, topk_lp)


def is_plain_greedy(md: SamplingMetadata) -> bool:
    """True when every row takes the argmax of the raw logits: no stage changes them and
    no row wants logprobs (the decode fast path: no float32 copy of the logits)."""
    return (md.all_greedy and md.no_penalties and md.no_min_tokens and md.no_logit_rules
            and md.max_num_logprobs is None and md.grammar_bitmask is None)


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The stages before the greedy / random split: grammar bitmask -> logit rules
    (allowed_token_ids, logit_bias) -> penalties -> min_tokens masking. Returns float32
    logits # [n, vocab_size]; their log_softmax is what logprobs report, their argmax
    what greedy rows take.

    .float() may alias the caller's tensor: every op here is out of place but the grammar
    bitmask (the runner's logits are the sampler's alone), and only tensors created here
    are modified in place afterwards.
    """
    logits = logits.float()  # [n, vocab_size]
    if md.grammar_bitmask is not None:
        # In place, on the caller's tensor where .float() aliased it: the runner's
        # logits rows are the sampler's alone (a copy of [n, vocab] float32 would cost
        # more than the whole mask: page faults of a fresh 12 MB on a CPU).
        apply_grammar_bitmask(logits, md.grammar_bitmask)
    if not md.no_logit_rules:
        logits = apply_logit_rules(logits, md)
    if not md.no_penalties:
        logits = apply_penalties(logits, md)
    if not md.no_min_tokens:
        logits = apply_min_tokens(logits, md)
    return logits


def random_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows sample from: temperature -> top-k -> top-p -> min-p ->
    softmax, over `process_logits`' output (not modified). # [n, vocab_size]"""
    # Greedy rows divide by 1 instead of ~0; their draw is discarded anyway.
    temperature = torch.where(md.temperature < GREEDY_TEMPERATURE, 1.0, md.temperature)
    logits = logits / temperature[:, None]  # new tensor: in place is safe from here
    if not (md.no_top_k and md.no_top_p):
        logits = apply_top_k_top_p(logits, md)
    if not md.no_min_p:
        logits = apply_min_p(logits, md)
    return logits.softmax(dim=-1)


def exponential_noise(md: SamplingMetadata, num_rows: int, width: int,
                      device: torch.device) -> torch.Tensor:
    """Exp(1) noise # [num_rows, width]: seeded rows from `seeded_exponential(seed, step)`
    (a pure function of seed, step and column), the others from the global generator."""
    q = torch.empty(num_rows, width, dtype=torch.float32, device=device).exponential_()
    if md.no_seeds:
        return q
    seeded = seeded_exponential(md.seeds, md.step, width)
    return torch.where(md.has_seed[:, None], seeded, q)


def exponential_race(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """argmax(p_i / q_i) with q_i ~ Exp(1) picks token i with probability p_i / sum(p):
    the rows need not be normalised. Overwrites `probs` and `q`. # [n]"""
    return probs.div_(q.clamp_min_(_TINY)).argmax(dim=-1)


class Sampler(nn.Module):
    """logits [n, vocab_size] + SamplingMetadata -> one token id per row, no host sync.

    Stage order: grammar bitmask (structured outputs) -> logit rules (allowed_token_ids, logit_bias) -> penalties -> min_tokens
    masking -> logprobs (log_softmax here: the
    model's distribution after penalties/bans, before temperature and filters, like
    vLLM's raw logprobs) -> greedy argmax -> temperature -> top-k -> top-p -> min-p ->
    exponential race. Greedy and random rows are merged with torch.where at the end.
    """

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if is_plain_greedy(md):
            # The common decode fast path: one argmax, no float32 copy of the logits.
            return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1), logprobs=None)
        logits = process_logits(logits, md)
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)

        greedy = None
        if not md.all_random:
            greedy = logits.argmax(dim=-1)  # [n]
        if md.all_greedy:
            sampled = greedy
        else:
            sampled = self._sample_random(logits, md)
            if greedy is not None:
                is_greedy = md.temperature < GREEDY_TEMPERATURE
                sampled = torch.where(is_greedy, greedy, sampled)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = compute_logprobs(raw_logprobs, sampled, md.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    @staticmethod
    def _sample_random(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        probs = random_probs(logits, md)  # [n, vocab_size]
        q = exponential_noise(md, probs.shape[0], probs.shape[-1], probs.device)
        return exponential_race(probs, q)
