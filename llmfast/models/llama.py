"""Llama in plain torch: fused qkv and gate_up projections, GQA, RoPE, RMSNorm.

Inputs are flat over the step's tokens (no batch dimension): requests are told apart
only by the attention metadata. Attention goes through `torch.ops.llmfast.unified_attention`,
which also writes the new tokens' keys and values into the paged KV cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmfast.kernels.cpu_linear import MAX_SPLIT_TOKENS_LM_HEAD, Linear
from llmfast.kernels.ops import unified_attention_impl  # also registers torch.ops.llmfast.*
from llmfast.attention_metadata import AttentionMetadata
from llmfast.config import ModelConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the input dtype (as HF does); one fused op
        # instead of five keeps the per-layer op count, and so eager overhead, down.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
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
        inv_freq = torch.where(
            wavelen > low_wavelen,
            inv_freq / scaling.factor,
            torch.where(wavelen < high_wavelen, inv_freq, interpolated),
        )
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE (HF's rotate_half layout) from a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # [max_positions, head_dim]: cos of both halves, then sin of both halves.
        self.register_buffer(
            "cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False
        )
        self.head_dim = head_dim

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [num_tokens, heads, head_dim] by each token's position. The caller
        passes queries and keys together (one pass instead of two)."""
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # [num_tokens, head_dim / 2]
        cos, sin = cos[:, None, :], sin[:, None, :]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary = rotary
        # Set by `LlamaForCausalLM.bind_kv_caches`; views into the runner's cache tensor.
        # [num_blocks, block_size, num_kv_heads, head_dim]
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [num_tokens, q_size + 2 * kv_size]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # Queries and keys are adjacent columns: rotate them as one [T, heads + kv_heads, d].
        qk = self.rotary(positions, qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim))
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(q)
        # Compiled graphs record the custom op (the backend splits there); eager calls
        # skip its dispatcher, which costs more than the CPU attention itself at batch 1.
        attention = (
            torch.ops.llmfast.unified_attention
            if torch.compiler.is_compiling()
            else unified_attention_impl
        )
        attention(
            q,
            k,
            v,
            self.k_cache,
            self.v_cache,
            attn_metadata.slot_mapping,
            attn_metadata.block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            self.scale,
            out,
        )
        return self.o_proj(out.view(-1, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(
            config.head_dim, max_positions, config.rope_theta, config.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        for layer in self.layers:
            hidden = layer(positions, hidden, attn_metadata)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_positions or config.max_position_embeddings)
        self.lm_head = Linear(
            config.hidden_size, config.vocab_size, bias=False,
            max_split_tokens=MAX_SPLIT_TOKENS_LM_HEAD,
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """[num_tokens] ids and positions -> [num_tokens, hidden_size] final hidden states."""
        return self.model(input_ids, positions, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] selected hidden states -> [n, vocab_size] float32 logits."""
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def bind_kv_caches(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Give each attention layer its (k_cache, v_cache), once, before compiling."""
        layers = self.attention_layers()
        if len(kv_caches) != len(layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(layers)} layers")
        for layer, (k_cache, v_cache) in zip(layers, kv_caches):
            layer.k_cache, layer.v_cache = k_cache, v_cache
