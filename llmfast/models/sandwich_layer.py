"""Gemma's decoder layer shape: RMSNorms that scale by (1 + weight) in float32, and a norm
on both sides of attention and of the MLP ("sandwich" norms):

    h = x + post_attention_norm(attention(input_norm(x)))
    out = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))

The layer keeps the decoder's convention (models/decoder.py): it returns (its last
output, the residual stream before it) and the next norm adds the two.
"""

from __future__ import annotations

import torch
from torch import nn


class OffsetRMSNorm(nn.Module):
    """(1 + weight) * rms_norm(x), computed in float32 and rounded to x's dtype once (HF
    Gemma's numerics: the weight is stored as an offset from 1). With `residual`: the
    norm of x + residual (added in x's dtype), and that sum."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (out * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, x)


class SandwichDecoderLayer(nn.Module):
    """A layer with norms before and after attention and the MLP (`self_attn` and `mlp`
    built by the decoder: models/decoder.py)."""

    def __init__(self, hidden_size: int, eps: float, self_attn: nn.Module,
                 mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = OffsetRMSNorm(hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(hidden_size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = OffsetRMSNorm(hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None, attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: the (scaled) embeddings are the residual
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, attn_metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual
