"""The reference SamplingMetadata builder: from SamplingParams objects with plain Python
lists, as the sampler tests need it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from llmfast.sampling_params import SamplingParams
from llmfast.sampling_params import seed_to_int64
from llmfast.worker.sampling.sampling_metadata import LogitRules, SamplingMetadata


def metadata_from_params(
    params: Sequence[SamplingParams],
    *,
    vocab_size: int,
    steps: Sequence[int] | None = None,
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    output_token_ids: Sequence[Sequence[int]] | None = None,
    eos_token_id: int | None = None,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """Build metadata from request objects: the reference for how the input batch fills
    it (`build_sampling_metadata`). Slow (Python lists); the engine's batch keeps these
    arrays persistently instead."""
    n = len(params)
    steps = list(steps) if steps is not None else [0] * n
    prompts = [list(p) for p in prompt_token_ids] if prompt_token_ids else [[]] * n
    outputs = [list(o) for o in output_token_ids] if output_token_ids else [[]] * n

    def f32(vals: list) -> torch.Tensor:
        return torch.tensor(vals, dtype=torch.float32, device=device)

    def i64(vals: list) -> torch.Tensor:
        return torch.tensor(vals, dtype=torch.int64, device=device)

    def padded(rows: list[list[int]]) -> torch.Tensor:
        width = max((len(r) for r in rows), default=0)
        return i64([r + [vocab_size] * (width - len(r)) for r in rows]).view(n, width)

    stops = [
        list(p.stop_token_ids) + ([eos_token_id] if eos_token_id is not None and
                                  not p.ignore_eos else [])
        for p in params
    ]
    no_penalties = all(
        p.repetition_penalty == 1.0 and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0 for p in params
    )
    no_min_tokens = all(s >= p.min_tokens or not st for p, s, st in zip(params, steps, stops))
    logprobs = [p.logprobs for p in params if p.logprobs is not None]
    no_logit_rules = not any(p.has_logit_rules for p in params)
    rules = None
    if not no_logit_rules:
        biases = [dict(p.logit_bias or {}) for p in params]
        allowed = [list(p.allowed_token_ids or [0]) for p in params]
        width = max(1, max(map(len, biases)))
        # Pads: token 0 with bias 0, and the row's first allowed id again.
        rules = LogitRules(
            bias_ids=i64([list(b) + [0] * (width - len(b)) for b in biases]).view(n, width),
            bias_values=f32([list(b.values()) + [0.0] * (width - len(b))
                             for b in biases]).view(n, width),
            allowed_ids=i64([a + a[:1] * (max(map(len, allowed)) - len(a))
                             for a in allowed]),
            has_allowed=torch.tensor([p.allowed_token_ids is not None for p in params],
                                     device=device))
    return SamplingMetadata(
        temperature=f32([p.temperature for p in params]),
        top_k=torch.tensor([p.top_k for p in params], dtype=torch.int32, device=device),
        top_p=f32([p.top_p for p in params]),
        min_p=f32([p.min_p for p in params]),
        repetition_penalty=f32([p.repetition_penalty for p in params]),
        presence_penalty=f32([p.presence_penalty for p in params]),
        frequency_penalty=f32([p.frequency_penalty for p in params]),
        seeds=i64([seed_to_int64(p.seed or 0) for p in params]),
        has_seed=torch.tensor([p.seed is not None for p in params], device=device),
        step=i64(steps),
        min_tokens=i64([p.min_tokens for p in params]),
        prompt_token_ids=None if no_penalties else padded(prompts),
        output_token_ids=None if no_penalties else padded(outputs),
        stop_token_ids=None if no_min_tokens else padded(stops),
        logit_rules=rules,
        all_greedy=all(p.greedy for p in params),
        all_random=not any(p.greedy for p in params),
        no_penalties=no_penalties,
        no_top_k=all(p.top_k == 0 for p in params),
        no_top_p=all(p.top_p == 1.0 for p in params),
        no_min_p=all(p.min_p == 0.0 for p in params),
        no_min_tokens=no_min_tokens,
        no_logit_rules=no_logit_rules,
        no_seeds=all(p.seed is None for p in params),
        max_top_k=max((p.top_k for p in params), default=0),
        max_num_logprobs=max(logprobs) if logprobs else None,
    )
