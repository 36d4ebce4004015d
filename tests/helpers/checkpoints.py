"""Tiny random checkpoints of each family, written by transformers itself (the oracle's
format)."""

from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


# model_type -> what its tiny config sets beyond TINY. Qwen3's default head_dim is 128,
# not hidden / heads, so every family names it.
FAMILIES = {
    "llama": {"head_dim": 16},
    "mistral": {"head_dim": 16, "sliding_window": 4096},
    "qwen2": {"head_dim": 16},
    "qwen3": {"head_dim": 16},
    # Three layers, the middle one global; a 16-token window; a local RoPE base and an
    # attention scale of their own, and soft-capped logits, so that a missed one shows.
    "gemma3_text": {"head_dim": 16, "num_hidden_layers": 3, "sliding_window": 16,
                    "layer_types": ["sliding_attention", "full_attention",
                                    "sliding_attention"],
                    "rope_theta": 10000.0, "rope_local_base_freq": 100.0,
                    "query_pre_attn_scalar": 24, "final_logit_softcapping": 3.0},
    # Mixtures of experts: 4 experts, 2 per token; Qwen3-MoE's layer 1 keeps a dense MLP.
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1],
                  "num_hidden_layers": 3},
    "mixtral": {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                "intermediate_size": 48},
}


def make_hf_checkpoint(
    path: Path,
    *,
    family: str = "llama",
    tie: bool = False,
    sharded: bool = False,
    rope_scaling: dict | None = None,
    seed: int = 0,
    **overrides,
) -> Path:
    """Write a random model of `family` (an HF model_type) with transformers'
    `save_pretrained` (safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**TINY, **FAMILIES[family], **overrides, "tie_word_embeddings": tie}
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
        kwargs["rope_theta"] = rope_scaling.get("rope_theta", 500000.0)
    config = AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    # transformers initialises norms to 1; randomise them so a missed norm weight shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "10GB")
    return path


def load_hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
