"""Which part of each weight one tensor-parallel rank holds (Megatron's split).

- column-parallel (output rows split): q/k/v and gate/up projections; rank r holds query
  heads [r * H/W, (r + 1) * H/W), the KV heads those query heads read, and MLP columns
  [r * I/W, (r + 1) * I/W); qkv biases split with their rows;
- row-parallel (input columns split): o_proj and down_proj, the same head / MLP ranges
  as columns; their outputs are partial sums (one all-reduce each); o_proj's bias is
  added once, by rank 0 (the other ranks have none);
- vocab-parallel: embedding and lm_head rows [r * V_r, (r + 1) * V_r), V_r = ceil(V / W);
  the last rank's rows past V are zero padding;
- replicated: norms (Qwen3's per-head q/k norms too: one weight shared by every head),
  and a mixture of experts' router;
- experts (models/sparse_moe.py): every rank holds every expert, with the slice
  [r * I_e/W, (r + 1) * I_e/W) of its intermediate columns (I_e: moe_intermediate_size),
  split as the dense MLP's (gate/up rows, down columns; Mixtral's w1/w3 rows, w2 columns).

KV heads: with K >= W KV heads, rank r holds [r * K/W, (r + 1) * K/W); with fewer
(W a multiple of K), rank r holds the one KV head r * K // W, replicated on W/K ranks.
Worked example, H = 8, K = 2, W = 4: ranks 0..3 hold query heads {0,1} {2,3} {4,5} {6,7}
and KV heads 0 0 1 1 (query head i reads KV head i // 4).

A checkpoint tensor keeps its full shape on disk; `checkpoint_slice` names the part a
rank reads, and the rank's model is built from `rank_model_config` (per-rank heads and
intermediate size, everything else the model's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from llmfast.config import ModelConfig
from llmfast.distributed import TensorParallelGroup


@dataclass(frozen=True)
class ShardSlice:
    """`size` indices from `start` along `dim` of a full tensor (0: rows, 1: columns)."""

    dim: int
    start: int
    size: int


def rank_model_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The per-rank view of `config`: this rank's query heads, KV heads and MLP columns
    (the vocabulary stays whole: see `vocab_shard`). World size 1: `config` itself."""
    if world_size == 1:
        return config
    config.check_tensor_parallel(world_size)
    return dataclasses.replace(
        config,
        num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=max(config.num_key_value_heads // world_size, 1),
        intermediate_size=config.intermediate_size // world_size,
        moe_intermediate_size=config.moe_intermediate_size // world_size,
    )


def kv_head_start(config: ModelConfig, tp: TensorParallelGroup) -> int:
    """The first KV head rank `tp.rank` holds (see the module docstring)."""
    kv, world = config.num_key_value_heads, tp.world_size
    if kv >= world:
        return tp.rank * (kv // world)
    return tp.rank * kv // world


def vocab_shard(vocab_size: int, tp: TensorParallelGroup) -> tuple[int, int, int]:
    """(first row, rows held, rows allocated) of the embedding and lm_head on this rank.
    Every rank allocates ceil(V / W) rows, so the gathered logits are [n, W * that].
    Worked example, V = 10, W = 4: 3 rows each; rank 3 holds row 9 only (and 2 padding
    rows), ranks 0..2 hold rows 0-2, 3-5, 6-8."""
    per_rank = -(-vocab_size // tp.world_size)
    start = tp.rank * per_rank
    held = max(min(per_rank, vocab_size - start), 0)
    return start, held, per_rank


# Checkpoint projection -> (dim it splits, which range: "q" heads, "kv" heads, "mlp").
_SPLITS = {
    "q_proj": (0, "q"), "k_proj": (0, "kv"), "v_proj": (0, "kv"),
    "gate_proj": (0, "mlp"), "up_proj": (0, "mlp"),
    "o_proj": (1, "q"), "down_proj": (1, "mlp"),
    "w1": (0, "mlp"), "w3": (0, "mlp"), "w2": (1, "mlp"),  # Mixtral's experts
}


def checkpoint_slice(name: str, config: ModelConfig,
                     tp: TensorParallelGroup) -> ShardSlice | None:
    """The part of checkpoint tensor `name` (full shape, HF naming) this rank holds;
    None: all of it (replicated, or a world of one)."""
    if tp.world_size == 1:
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        start, held, _ = vocab_shard(config.vocab_size, tp)
        return ShardSlice(0, start, held)
    parts = name.rsplit(".", 2)  # e.g. "model.layers.3.self_attn", "q_proj", "weight"
    if len(parts) != 3 or parts[1] not in _SPLITS:
        return None
    dim, kind = _SPLITS[parts[1]]
    if dim == 1 and parts[2] == "bias":
        return None  # o_proj's bias: whole, on rank 0 (`RowParallelLinear`)
    local = rank_model_config(config, tp.world_size)
    if kind == "q":
        size = local.q_size
        return ShardSlice(dim, tp.rank * size, size)
    if kind == "kv":
        return ShardSlice(dim, kv_head_start(config, tp) * config.head_dim, local.kv_size)
    is_expert = ".experts." in parts[0] + "."
    size = local.moe_intermediate_size if is_expert else local.intermediate_size
    return ShardSlice(dim, tp.rank * size, size)


def checkpoint_names(param_name: str, config: ModelConfig) -> tuple[str, ...]:
    """The checkpoint tensors a parameter is made of, in its row order:
    "...qkv_proj.weight" -> the q, k, v projections' weights; "...experts.gate_up_weight"
    -> expert 0's gate and up weights, expert 1's, ...; others: itself."""
    prefix, _, rest = param_name.rpartition(".experts.")
    if prefix and rest in ("gate_up_weight", "down_weight"):
        projs = ("gate_proj", "up_proj") if rest == "gate_up_weight" else ("down_proj",)
        return tuple(f"{prefix}.experts.{e}.{p}.weight"
                     for e in range(config.num_experts) for p in projs)
    prefix, _, rest = param_name.rpartition(".qkv_proj.")
    if prefix:
        return tuple(f"{prefix}.{p}.{rest}" for p in ("q_proj", "k_proj", "v_proj"))
    prefix, _, rest = param_name.rpartition(".gate_up_proj.")
    if prefix:
        return tuple(f"{prefix}.{p}.{rest}" for p in ("gate_proj", "up_proj"))
    return (param_name,)
