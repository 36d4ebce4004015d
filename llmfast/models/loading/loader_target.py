"""Where a checkpoint tensor goes in the model: its (possibly fused) parameter, and the
rows of that parameter it fills."""

from __future__ import annotations

import re

import torch

from llmfast.models.decoder import DecoderForCausalLM

# A mixture of experts' tensors, as Qwen3-MoE and Mixtral checkpoints name them.
_EXPERT = re.compile(r"^(model\.layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_MIXTRAL_ROUTER = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.gate\.weight$")


def target(
    model: DecoderForCausalLM, name: str, params: dict[str, torch.nn.Parameter] | None = None
) -> tuple[torch.Tensor, slice | None] | None:
    """Where an HF tensor goes: (parameter, row slice within it) or None to skip.
    `params`: `model.named_parameters(remove_duplicate=False)` as a dict, built once by a
    caller that looks up many names.

    q/k/v rows (weights and biases alike) stack into qkv_proj as
    [q_size | kv_size | kv_size]; gate/up rows into gate_up_proj as [intermediate | intermediate].
    Sizes are the model's rank's (`rank_config`): on a tensor-parallel rank, the rows of
    its slices (models/sharding.py). Experts' tensors: see `_expert_target`.
    """
    cfg = model.rank_config
    if params is None:
        params = dict(model.named_parameters(remove_duplicate=False))
    if name in params:
        return params[name], None
    if name.endswith("rotary_emb.inv_freq"):
        return None
    if ".experts." in name or ".block_sparse_moe." in name:
        return _expert_target(cfg, name, params)
    parts = name.rsplit(".", 2)  # e.g. "model.layers.3.self_attn", "q_proj", "weight"
    if len(parts) != 3:
        return None
    prefix, proj, kind = parts  # kind: "weight" or "bias" (Qwen2's q/k/v)
    q, kv, inter = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    fused = {
        "q_proj": ("qkv_proj", slice(0, q)),
        "k_proj": ("qkv_proj", slice(q, q + kv)),
        "v_proj": ("qkv_proj", slice(q + kv, q + 2 * kv)),
        "gate_proj": ("gate_up_proj", slice(0, inter)),
        "up_proj": ("gate_up_proj", slice(inter, 2 * inter)),
    }
    if proj not in fused:
        return None
    fused_name, rows = fused[proj]
    param = params.get(f"{prefix}.{fused_name}.{kind}")
    return (param, rows) if param is not None else None


def _expert_target(cfg, name: str, params: dict[str, torch.nn.Parameter]
                   ) -> tuple[torch.Tensor, slice | None] | None:
    """Expert e's gate (Mixtral: w1) and up (w3) weights fill rows [e * 2I, e * 2I + I)
    and [e * 2I + I, (e + 1) * 2I) of its layer's `experts.gate_up_weight`; its down
    weight (w2) rows [e * H, (e + 1) * H) of `experts.down_weight` (models/sparse_moe.py).
    Mixtral's router `block_sparse_moe.gate` is `mlp.gate`. An expert past the config's
    count, or in a dense layer, fills nothing (the checks call it unexpected)."""
    router = _MIXTRAL_ROUTER.match(name)
    if router:
        param = params.get(f"{router[1]}.mlp.gate.weight")
        return None if param is None else (param, None)
    match = _EXPERT.match(name)
    if match is None:
        return None
    layer, expert, proj = match[1], int(match[2]), match[3]
    if expert >= cfg.num_experts:
        return None
    inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
    if proj in ("down_proj", "w2"):
        param, start, size = params.get(f"{layer}.mlp.experts.down_weight"), expert * hidden, hidden
    else:
        start = expert * 2 * inter + (inter if proj in ("up_proj", "w3") else 0)
        param, size = params.get(f"{layer}.mlp.experts.gate_up_weight"), inter
    return None if param is None else (param, slice(start, start + size))
