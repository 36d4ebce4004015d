"""The weight bytes one decode step reads on one tensor-parallel rank, counted from the
model's config alone by Megatron's split (the oracle for `RunnerInfo.decode_weight_bytes`
and the sweep's weight_bytes, independent of the model's parameters)."""

from __future__ import annotations

from llmfast.config import ModelConfig


def expected_decode_weight_bytes(config: ModelConfig, world_size: int = 1, rank: int = 0,
                                 element_size: int = 4) -> int:
    """q/k/v, o, gate/up and down projections split W ways (a rank with fewer KV heads
    than ranks keeps one), norms whole, the LM head's ceil(V / W) rows; o_proj's bias on
    rank 0 only. An untied input embedding is not counted (a step reads only its batch's
    rows); a tied one is the LM head. A sparse layer's MLP: its router whole, and the
    top-k experts a batch-1 step picks, each split W ways like the dense MLP."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q = config.num_attention_heads * head_dim // world_size
    kv = max(config.num_key_value_heads // world_size, 1) * head_dim
    inter = config.intermediate_size // world_size
    layer = (q + 2 * kv) * hidden + q * hidden + 2 * hidden
    num_sparse = sum(config.is_sparse_layer(i) for i in range(config.num_hidden_layers))
    sparse_mlp = (config.num_experts * hidden + config.num_experts_per_tok * 3
                  * (config.moe_intermediate_size // world_size) * hidden)
    mlps = num_sparse * sparse_mlp + (config.num_hidden_layers - num_sparse) * 3 * inter * hidden
    if config.qkv_bias:
        layer += q + 2 * kv
    if config.o_bias and rank == 0:
        layer += hidden
    if config.qk_norm:
        layer += 2 * head_dim
    head_rows = -(-config.vocab_size // world_size)
    return element_size * (config.num_hidden_layers * layer + mlps + hidden
                           + head_rows * hidden)
