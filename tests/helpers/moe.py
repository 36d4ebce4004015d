"""The mixture-of-experts oracle: each token's k experts, one at a time, in float64."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights, topk_ids [T, k] -> [T, H]
    float64: sum_j weight[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, j]."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w13[e] @ x[t]
            act = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(topk_weights[t, j]) * (w2[e] @ act)
    return out


def random_moe_inputs(num_tokens: int, num_experts: int, top_k: int, hidden: int,
                      inter: int, dtype: torch.dtype, seed: int = 0,
                      one_expert: bool = False):
    """(x, w13, w2, topk_weights, topk_ids): random routing of distinct experts per token
    (or every token on expert 0 first, `one_expert`), weights summing to 1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    scores = torch.rand(num_tokens, num_experts, generator=gen)
    if one_expert:
        scores[:, 0] = 2.0
    weights, ids = torch.topk(scores, top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(dtype)
    return x, w13, w2, weights, ids.to(torch.int32)
