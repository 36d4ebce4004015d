"""Where a checkpoint tensor goes in the model: its (possibly fused) parameter, and the
rows of that parameter it fills."""

from __future__ import annotations

import torch

from llmfast.models.decoder import DecoderForCausalLM


def target(
    model: DecoderForCausalLM, name: str, params: dict[str, torch.nn.Parameter] | None = None
) -> tuple[torch.Tensor, slice | None] | None:
    """Where an HF tensor goes: (parameter, row slice within it) or None to skip.
    `params`: `model.named_parameters(remove_duplicate=False)` as a dict, built once by a
    caller that looks up many names.

    q/k/v rows (weights and biases alike) stack into qkv_proj as
    [q_size | kv_size | kv_size]; gate/up rows into gate_up_proj as [intermediate | intermediate].
    Sizes are the model's rank's (`rank_config`): on a tensor-parallel rank, the rows of
    its slices (models/sharding.py).
    """
    cfg = model.rank_config
    if params is None:
        params = dict(model.named_parameters(remove_duplicate=False))
    if name in params:
        return params[name], None
    if name.endswith("rotary_emb.inv_freq"):
        return None
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
