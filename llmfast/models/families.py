"""The model families llmfast runs, and how an HF `config.json` describes each.

All families share one decoder (models/decoder.py); a family only sets named options on
`ModelConfig`:

    architecture        q/k/v bias       o_proj bias      q/k norm   sliding window
    LlamaForCausalLM    attention_bias   attention_bias   -          -
    MistralForCausalLM  -                -                -          sliding_window
    Qwen2ForCausalLM    always           -                -          use_sliding_window
    Qwen3ForCausalLM    attention_bias   attention_bias   always     use_sliding_window
    Qwen3MoeForCausalLM attention_bias   attention_bias   always     use_sliding_window
    MixtralForCausalLM  -                -                -          sliding_window
    Gemma3ForCausalLM   attention_bias   attention_bias   always     layer_types

Gemma 3 (text) also has (1 + weight) RMSNorms, norms after attention and the MLP as well
as before, embeddings scaled by sqrt(hidden_size), GeGLU (tanh GELU), attention scaled by
`query_pre_attn_scalar`, and a RoPE base of its own for the sliding layers
(`rope_local_base_freq`, or transformers 5's per-layer-type `rope_parameters`).

Rope scaling (linear, llama3, yarn) and tied embeddings are read the same way for all.
The two mixtures of experts name their experts differently in config.json:

    architecture        experts                         expert columns         top-k renormalised
    Qwen3MoeForCausalLM num_experts (num_local_experts) moe_intermediate_size  norm_topk_prob
    MixtralForCausalLM  num_local_experts               intermediate_size      always

Qwen3-MoE may keep dense MLPs (of `intermediate_size`) in some layers: those listed in
`mlp_only_layers`, and all but every `decoder_sparse_step`-th.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmfast.config import ConfigError, ModelConfig, RopeScaling, unsupported_architecture_message


@dataclass(frozen=True)
class Family:
    architecture: str
    model_type: str
    qkv_bias_always: bool = False  # Qwen2: q/k/v biases whatever the config says
    reads_attention_bias: bool = False  # `attention_bias`: biases on q, k, v and o_proj
    qk_norm: bool = False
    reads_sliding_window: bool = False
    # Qwen: `sliding_window` applies only with `use_sliding_window`, and only to the
    # layers from `max_window_layers` on.
    window_needs_flag: bool = False
    default_head_dim: int | None = None  # when config.json has none (else hidden / heads)
    gemma: bool = False  # Gemma's norms and embedding scale (module doc)
    experts: str | None = None  # a mixture of experts: how config.json describes it

    def options(self, attention_bias: bool) -> dict[str, bool]:
        """The ModelConfig options this family implies."""
        bias = self.reads_attention_bias and attention_bias
        options = {"qkv_bias": self.qkv_bias_always or bias, "o_bias": bias,
                   "qk_norm": self.qk_norm}
        if self.gemma:
            options.update(norm_offset=True, sandwich_norms=True, embed_scale=True)
        return options


FAMILIES = (
    Family("LlamaForCausalLM", "llama", reads_attention_bias=True),
    Family("MistralForCausalLM", "mistral", reads_sliding_window=True),
    Family(
        "Qwen2ForCausalLM", "qwen2", qkv_bias_always=True, reads_sliding_window=True,
        window_needs_flag=True,
    ),
    Family(
        "Qwen3ForCausalLM", "qwen3", reads_attention_bias=True, qk_norm=True,
        reads_sliding_window=True, window_needs_flag=True, default_head_dim=128,
    ),
    Family(
        "Gemma3ForCausalLM", "gemma3_text", reads_attention_bias=True, qk_norm=True,
        reads_sliding_window=True, default_head_dim=256, gemma=True,
    ),
    Family(
        "Qwen3MoeForCausalLM", "qwen3_moe", reads_attention_bias=True, qk_norm=True,
        reads_sliding_window=True, window_needs_flag=True, default_head_dim=128,
        experts="qwen3_moe",
    ),
    Family("MixtralForCausalLM", "mixtral", reads_sliding_window=True, experts="mixtral"),
)
BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}


def family_config(architecture: str, *, attention_bias: bool = False, **fields: Any) -> ModelConfig:
    """A ModelConfig with the family's options filled in (the random presets use this)."""
    family = BY_ARCHITECTURE[architecture]
    return ModelConfig(architecture=architecture, **family.options(attention_bias), **fields)


def family_of(cfg: dict[str, Any]) -> Family:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[arch]
    model_type = cfg.get("model_type")
    if model_type in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[model_type]
    raise ConfigError(unsupported_architecture_message(", ".join(archs) or model_type or "none"))


def model_config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from the dict of an HF `config.json` (transformers 4.x or 5.x)."""
    family = family_of(cfg)
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if key not in cfg:
            raise ConfigError(f"config.json lacks {key!r}")
    if cfg.get("mlp_bias"):
        raise ConfigError("models with MLP biases are not supported")
    num_heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    num_layers = cfg["num_hidden_layers"]
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("bidirectional attention (use_bidirectional_attention) is not "
                          "supported")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ConfigError("attention logit soft-capping (attn_logit_softcapping) is not "
                          "supported")
    rope_theta, scaling = _rope(cfg, max_positions)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or family.default_head_dim or hidden // num_heads,
        intermediate_size=cfg.get("intermediate_size", 4 * hidden),
        vocab_size=cfg["vocab_size"],
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=max_positions,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        architecture=family.architecture,
        **_sliding_window(cfg, family, num_layers),
        **_experts(cfg, family, num_layers),
        **family.options(bool(cfg.get("attention_bias"))),
        **_gemma_fields(cfg, family),
    )


def _gemma_fields(cfg: dict[str, Any], family: Family) -> dict[str, Any]:
    """What else a config says that only some families set (the activation for all)."""
    fields: dict[str, Any] = {"hidden_act": _activation(cfg)}
    if not family.gemma:
        return fields
    scalar = cfg.get("query_pre_attn_scalar")
    cap = cfg.get("final_logit_softcapping")
    fields.update(
        query_pre_attn_scalar=None if scalar is None else float(scalar),
        rope_local_theta=_local_rope_theta(cfg),
        final_logit_softcapping=None if cap is None else float(cap),
    )
    return fields


def _activation(cfg: dict[str, Any]) -> str:
    act = cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"
    return "silu" if act == "swish" else act


def _per_layer_type_rope(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 5's rope_parameters keyed by layer type (Gemma 3), or None."""
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict) and rope and set(rope) <= {"full_attention", "sliding_attention"}:
        return rope
    return None


def _local_rope_theta(cfg: dict[str, Any]) -> float:
    """The sliding layers' RoPE base (unscaled, as transformers has it)."""
    per_type = _per_layer_type_rope(cfg)
    local = dict((per_type or {}).get("sliding_attention") or {})
    if local.get("rope_type", "default") != "default":
        raise ConfigError("rope scaling of the sliding layers is not supported")
    return float(local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10000.0)


def _experts(cfg: dict[str, Any], family: Family, num_layers: int) -> dict[str, Any]:
    """The ModelConfig's expert fields (none for a dense family)."""
    if family.experts is None:
        return {}
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    top_k = cfg.get("num_experts_per_tok")
    if num_experts is None or top_k is None:
        raise ConfigError(f"config.json of a {family.architecture} lacks "
                          f"{'num_experts' if num_experts is None else 'num_experts_per_tok'!r}")
    if family.experts == "mixtral":
        return {"num_experts": num_experts, "num_experts_per_tok": top_k,
                "moe_intermediate_size": cfg.get("intermediate_size", 0),
                "norm_topk_prob": True}
    if "moe_intermediate_size" not in cfg:
        raise ConfigError("config.json of a Qwen3MoeForCausalLM lacks 'moe_intermediate_size'")
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step <= 0:
        raise ConfigError(f"decoder_sparse_step must be a positive integer, got {step!r}")
    mlp_only = set(cfg.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(num_layers) if i in mlp_only or (i + 1) % step)
    return {"num_experts": num_experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": cfg["moe_intermediate_size"],
            "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
            "dense_layers": dense}


def _rope(cfg: dict[str, Any], max_positions: int) -> tuple[float, RopeScaling]:
    # transformers 5 writes rope settings as `rope_parameters` (theta included);
    # transformers 4 as `rope_theta` plus an optional `rope_scaling` dict.
    per_type = _per_layer_type_rope(cfg)
    if per_type is not None:  # Gemma 3: the global layers' here, the local ones' apart
        rope = dict(per_type.get("full_attention") or {})
    else:
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise ConfigError("per-layer-type rope parameters are not supported")
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    factor = rope.get("factor")
    if rope_type == "default":
        return theta, RopeScaling()
    if rope_type not in ("llama3", "yarn"):  # linear, or refused by RopeScaling
        return theta, RopeScaling(rope_type, float(factor if factor is not None else 1.0))
    # As transformers does: a top-level value wins, else the rope dict's, else the
    # model's own context length.
    original = int(
        cfg.get("original_max_position_embeddings")
        or rope.get("original_max_position_embeddings")
        or max_positions
    )
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(factor if factor is not None else 1.0),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
        )
    if rope.get("mscale") and rope.get("mscale_all_dim") and "attention_factor" not in rope:
        raise ConfigError("yarn rope scaling with mscale (DeepSeek-style) is not supported")
    attention_factor = rope.get("attention_factor")
    return theta, RopeScaling(
        "yarn",
        float(factor if factor is not None else max_positions / original),
        original_max_position_embeddings=original,
        beta_fast=float(rope.get("beta_fast") or 32.0),
        beta_slow=float(rope.get("beta_slow") or 1.0),
        attention_factor=None if attention_factor is None else float(attention_factor),
        truncate=bool(rope.get("truncate", True)),
    )


def _sliding_window(cfg: dict[str, Any], family: Family, num_layers: int) -> dict[str, Any]:
    """ModelConfig's `sliding_window` and `layer_types`: the window, if any layer uses
    one, and which layers do (as transformers decides it)."""
    window = cfg.get("sliding_window")
    none = {"sliding_window": None, "layer_types": ()}
    if window is None or not family.reads_sliding_window:
        return none
    layer_types = cfg.get("layer_types")
    if layer_types is None and family.window_needs_flag:
        # Qwen: with use_sliding_window, the layers from max_window_layers on.
        if not cfg.get("use_sliding_window"):
            return none
        first = cfg.get("max_window_layers", num_layers)
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(num_layers)]
    if layer_types is None and family.gemma:  # transformers 4: every sixth layer global
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                       for i in range(num_layers)]
    if layer_types is None:  # Mistral: every layer
        return {"sliding_window": window, "layer_types": ()}
    if "sliding_attention" not in layer_types:
        return none
    return {"sliding_window": window, "layer_types": tuple(layer_types)}


def hf_dict_from_model_config(c: ModelConfig) -> dict[str, Any]:
    """An HF-style `config.json` dict (transformers 4 and 5 both read it)."""
    family = BY_ARCHITECTURE[c.architecture]
    implied = family.options(c.o_bias)
    if any(getattr(c, name) != value for name, value in implied.items()) or (
            not family.gemma and (c.norm_offset or c.sandwich_norms or c.embed_scale)):
        raise ConfigError(f"{c.architecture} cannot express these options in config.json")
    eos: int | list[int] | None
    eos = list(c.eos_token_ids) if len(c.eos_token_ids) != 1 else c.eos_token_ids[0]
    out: dict[str, Any] = {
        "architectures": [c.architecture],
        "model_type": family.model_type,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": _rope_dict(c.rope_scaling),
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos,
        "hidden_act": c.hidden_act,
        "torch_dtype": c.torch_dtype,
    }
    if family.gemma:
        scalar = c.query_pre_attn_scalar  # (an int to transformers, when it is one)
        if scalar is not None and float(scalar).is_integer():
            scalar = int(scalar)
        out.update(hidden_activation=c.hidden_act, query_pre_attn_scalar=scalar,
                   rope_local_base_freq=c.rope_local_theta,
                   final_logit_softcapping=c.final_logit_softcapping)
    if family.reads_attention_bias:
        out["attention_bias"] = c.o_bias
    if family.model_type == "llama":
        out["mlp_bias"] = False
    if family.experts == "mixtral":
        if c.moe_intermediate_size != c.intermediate_size or not c.norm_topk_prob:
            raise ConfigError("MixtralForCausalLM cannot express these experts in config.json")
        out.update(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok)
    elif family.experts == "qwen3_moe":
        out.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                   moe_intermediate_size=c.moe_intermediate_size,
                   norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=1,
                   mlp_only_layers=list(c.dense_layers))
    if family.reads_sliding_window:
        out["sliding_window"] = c.sliding_window
        if c.layer_types:
            out["layer_types"] = list(c.layer_types)
        if family.window_needs_flag:
            out["use_sliding_window"] = c.sliding_window is not None
            out["max_window_layers"] = 0 if c.sliding_window is not None else c.num_hidden_layers
    return out


def _rope_dict(s: RopeScaling) -> dict[str, Any] | None:
    if s.rope_type == "default":
        return None
    out: dict[str, Any] = {"rope_type": s.rope_type, "factor": s.factor}
    if s.rope_type in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = s.original_max_position_embeddings
    if s.rope_type == "llama3":
        out.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    if s.rope_type == "yarn":
        out.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
        if s.attention_factor is not None:
            out["attention_factor"] = s.attention_factor
    return out


def model_config_from_json(path: str | Path) -> ModelConfig:
    """Read an HF `config.json` file into a ModelConfig."""
    path = Path(path)
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return model_config_from_hf(cfg)
