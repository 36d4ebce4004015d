"""The router's choice: each token's top-k experts and their weights, as HF computes
them (Qwen3-MoE, Mixtral): softmax over the experts' logits in float32, the k largest
probabilities, renormalised to sum to 1 when `renormalize` (Qwen3's `norm_topk_prob`;
always for Mixtral, whose softmax over the top-k logits is the same thing), then
rounded to the model's dtype. Plain torch ops: static shapes, so Inductor fuses them
and a CUDA graph captures them."""

from __future__ import annotations

import torch


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (weights [T, top_k] in the logits' dtype, expert ids [T, top_k]
    int32), each row's experts in decreasing weight."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids.to(torch.int32)
