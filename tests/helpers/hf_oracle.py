"""HF transformers as the engine tests' oracle: greedy continuations of a prompt by the
HF model on the same weights, with its own KV cache, eos ignored."""

from __future__ import annotations

import torch


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by HF with its own KV cache; eos ignored."""
    ids = torch.tensor([prompt])
    out = []
    past = None
    with torch.inference_mode():
        for _ in range(n):
            res = hf(ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
            past = res.past_key_values
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def greedy_oracle(hf):
    """(prompt, n) -> HF's greedy continuation, each computed once."""
    cache = {}

    def expected(prompt, n):
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(hf, prompt, n)
        return cache[key]

    return expected
