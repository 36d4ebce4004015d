"""A mixture of experts in a GGUF file: Qwen3-MoE (`general.architecture` qwen3moe) and
Mixtral (llama with `llama.expert_count`, as llama.cpp's converter writes it).

Metadata: `{arch}.expert_count`, `{arch}.expert_used_count` (top-k),
`{arch}.expert_feed_forward_length` (qwen3moe's expert columns; Mixtral's are
`feed_forward_length`), `{arch}.expert_weights_norm` (the top-k weights renormalised:
llama.cpp does so for both unless it says otherwise), `{arch}.expert_gating_func`
(softmax only). Tensors per layer: the router `ffn_gate_inp` [E, H], and the experts
stacked, `ffn_gate_exps` / `ffn_up_exps` [E, I, H] and `ffn_down_exps` [E, H, I] (torch
order); each stack is split into the family's per-expert HF tensors. Files of the older
per-expert layout (`blk.N.ffn_gate.E.weight`) are refused as unknown tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from llmfast.config import ConfigError, ModelConfig

_STACKED = re.compile(r"^blk\.(\d+)\.(ffn_gate_inp|ffn_gate_exps|ffn_up_exps|ffn_down_exps)"
                      r"\.weight$")
# llama.cpp's gating function enum: 1 softmax, 2 sigmoid.
_SOFTMAX = 1
# GGUF stack -> (Qwen3-MoE's projection, Mixtral's).
_PROJECTIONS = {"ffn_gate_exps": ("gate_proj", "w1"), "ffn_up_exps": ("up_proj", "w3"),
                "ffn_down_exps": ("down_proj", "w2")}


def expert_fields(read: Callable[[str], Any], arch: str, num_experts: int,
                  name: str) -> dict[str, Any]:
    """The ModelConfig fields of the experts (`read`: a metadata key -> value or None)."""
    top_k = read(f"{arch}.expert_used_count")
    if top_k is None:
        raise ConfigError(f"{name} lacks the metadata {arch}.expert_used_count")
    gating = read(f"{arch}.expert_gating_func")
    if gating is not None and int(gating) != _SOFTMAX:
        raise ConfigError(f"{name}: expert gating function {gating} is not supported "
                          "(softmax only)")
    inter = read(f"{arch}.expert_feed_forward_length" if arch != "llama"
                 else f"{arch}.feed_forward_length")
    if inter is None:
        raise ConfigError(f"{name} lacks the experts' feed-forward length")
    norm = read(f"{arch}.expert_weights_norm")
    return {"num_experts": num_experts, "num_experts_per_tok": int(top_k),
            "moe_intermediate_size": int(inter),
            "norm_topk_prob": True if norm is None else bool(norm)}


def _prefix(config: ModelConfig, layer: int) -> str:
    mixtral = config.architecture == "MixtralForCausalLM"
    return f"model.layers.{layer}.{'block_sparse_moe' if mixtral else 'mlp'}"


def stacked_name(gguf_name: str, config: ModelConfig) -> str | None:
    """The name a GGUF expert tensor plans under (its stack's HF names with `*` for the
    expert; the router's own), or None for another tensor."""
    match = _STACKED.match(gguf_name)
    if match is None or int(match[1]) >= config.num_hidden_layers:
        return None
    prefix = _prefix(config, int(match[1]))
    if match[2] == "ffn_gate_inp":
        return f"{prefix}.gate.weight"
    proj = _PROJECTIONS[match[2]][config.architecture == "MixtralForCausalLM"]
    return f"{prefix}.experts.*.{proj}.weight"


def expected_expert_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """A sparse layer's router and stacks, under `stacked_name`'s names."""
    e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
    mixtral = config.architecture == "MixtralForCausalLM"
    prefix = _prefix(config, layer)
    gate, up, down = (p[mixtral] for p in _PROJECTIONS.values())
    return {f"{prefix}.gate.weight": (e, h), f"{prefix}.experts.*.{gate}.weight": (e, i, h),
            f"{prefix}.experts.*.{up}.weight": (e, i, h),
            f"{prefix}.experts.*.{down}.weight": (e, h, i)}


def split_stack(name: str, weight) -> dict[str, Any]:
    """A stack [E, rows, cols] under `stacked_name`'s name -> each expert's tensor."""
    if ".experts.*." not in name:
        return {name: weight}
    return {name.replace("*", str(e)): weight[e].contiguous() for e in range(weight.shape[0])}
