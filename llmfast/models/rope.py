"""Rotary position embeddings: the frequencies of each scaling kind, and the cos/sin table.

Frequencies are computed in float64 and stored in float32, the table once per model.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from llmfast.config import RopeScaling
from llmfast.kernels.layers.rotary import rotary_impl


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """[head_dim / 2] inverse frequencies (float32), scaled as `scaling` says."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif scaling.rope_type == "yarn":
        inv_freq = _yarn(inv_freq, head_dim, theta, scaling)
    return inv_freq.float()


def rope_attention_factor(scaling: RopeScaling) -> float:
    """The scale of cos and sin: YaRN's "mscale", which keeps attention logits' entropy
    as the context grows (1 for the other kinds)."""
    if scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (Llama 3.1's scheme).
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return torch.where(
        wavelen > low_wavelen,
        inv_freq / scaling.factor,
        torch.where(wavelen < high_wavelen, inv_freq, interpolated),
    )


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: frequency pairs that turn more than `beta_fast` times over the original
    context keep their frequency, those turning fewer than `beta_slow` times are divided
    by `factor`, and a linear ramp over the pair index blends the two in between.

    Worked example (head_dim 64, theta 1e4, original context 4096): pair i turns
    4096 * inv_freq[i] / (2 pi) times (652 for i = 0, 36.7 for i = 10, 0.87 for i = 23);
    32 turns falls at i = 10.47 and 1 turn at i = 22.51, rounded outwards to 10 and 23:
    pairs 0-10 keep their frequency, 23-31 are divided by the factor, 11-22 blend.
    """

    def pair_index(turns: float) -> float:  # where a pair turns `turns` times (real-valued)
        return head_dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low, high = pair_index(s.beta_fast), pair_index(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero for a one-point ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / s.factor * ramp + inv_freq * (1 - ramp)


def rope_table(head_dim: int, max_positions: int, theta: float,
               scaling: RopeScaling) -> torch.Tensor:
    """[max_positions, head_dim] float32 on the default device: cos of both halves,
    then sin of both halves, times the attention factor."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * rope_attention_factor(scaling)


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE (HF's rotate_half layout) from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling):
        super().__init__()
        if torch.get_default_device().type == "meta":
            # Shapes only (the loader's checks build the model there). Computing the
            # table on meta runs torch's meta kernels written in Python, and the first
            # of them imports torch._dynamo: 1-6 s an eager engine never needs.
            table = torch.empty(max_positions, head_dim, dtype=torch.float32)
        else:
            table = rope_table(head_dim, max_positions, theta, scaling)
        # [max_positions, head_dim]: cos of both halves, then sin of both halves.
        self.register_buffer("cos_sin", table, persistent=False)
        # [2, 1]: the sign of the swapped half's sine term in each output half.
        self.register_buffer("rotate_sign", torch.tensor([[-1.0], [1.0]]), persistent=False)
        self.head_dim = head_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [num_tokens, heads, head_dim] by each token's position. The caller
        passes queries and keys together (one pass instead of two). One Triton kernel on
        CUDA (kernels/layers/rotary.py); compiled graphs record the op, eager calls skip its
        dispatcher."""
        compiling = torch.compiler.is_compiling()
        rotate = torch.ops.llmfast.rotary_embedding if compiling else rotary_impl
        return rotate(positions, x, self.cos_sin, self.rotate_sign)
