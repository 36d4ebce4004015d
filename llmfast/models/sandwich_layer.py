"""Gemma's decoder layer shape: a norm on both sides of attention and of the MLP
("sandwich" norms; Gemma's norms scale by 1 + weight: models/decoder.py's RMSNorm with
`offset`):

    h = x + post_attention_norm(attention(input_norm(x)))
    out = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))

The layer keeps the decoder's convention (models/decoder.py): it returns (its last
output, the residual stream before it) and the next norm adds the two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class SandwichDecoderLayer(nn.Module):
    """A layer with norms before and after attention and the MLP (`self_attn`, `mlp`
    and the norms, from `make_norm`, built by the decoder)."""

    def __init__(self, make_norm: Callable[[], nn.Module], self_attn: nn.Module,
                 mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = make_norm()
        self.self_attn = self_attn
        self.post_attention_layernorm = make_norm()
        self.pre_feedforward_layernorm = make_norm()
        self.mlp = mlp
        self.post_feedforward_layernorm = make_norm()

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
