"""Config and checkpoint agreement, checked before anything is allocated.

Three checks, in the order loading meets them:
- `check_hf_config`: settings in config.json that the decoder would otherwise ignore
  (an activation other than SiLU or tanh-GELU, a partial rotary embedding, rope parameters that are
  missing or out of range) are refused, not run as something else;
- `check_model_size`: every dimension within what real models use, and the weights within
  the memory there is, before a layer is built or a byte allocated (a config saying 10^9
  layers fails at once instead of hanging);
- `check_checkpoint`: each checkpoint tensor maps to a parameter of the model built on
  the meta device, with the same shape; every parameter row is covered; no tensor is left
  over (e.g. the weights of a layer that config.json does not have).

The mapping from checkpoint names to parameters is the loader's own (passed in), so the
check follows every model family and option the loader knows about.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmfast.config import ConfigError, ModelConfig

# Activations that are SiLU under another name (transformers' ACT2FN maps both to SiLU).
SILU_NAMES = ("silu", "swish")

# Limits well above every released model (Llama 3.1 405B: 126 layers, hidden 16384, FFN
# 53248; the largest vocabularies ~262k), far below what would hang or exhaust memory.
SIZE_LIMITS: dict[str, int] = {
    "num_hidden_layers": 1024,
    "hidden_size": 65536,
    "intermediate_size": 262144,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 26,
    "num_experts": 4096,  # DeepSeek-V3: 256, Qwen3-MoE: 128
    "moe_intermediate_size": 262144,
}

# Checkpoint tensors that carry nothing the model needs: rotary tables are recomputed.
_IGNORABLE = re.compile(r"(^|\.)rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")

# (parameter, rows within it) that a checkpoint tensor fills, or None if it fills none.
Target = Callable[[str], "tuple[torch.Tensor, slice | None] | None"]


def check_hf_config(cfg: Mapping[str, Any]) -> None:
    """Refuse config.json settings that the decoder does not implement."""
    act = hf_activation(cfg)
    if act not in SILU_NAMES + ("gelu_pytorch_tanh",):
        raise ConfigError(f"unsupported activation hidden_act={act!r}; llmfast runs SiLU and "
                          "tanh-GELU (Gemma) models")
    partial = cfg.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rope, Mapping):
        raise ConfigError(f"rope settings must be an object, got {rope!r:.60}")
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if not _positive_number(theta):
        raise ConfigError(f"rope_theta must be a positive number, got {theta!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    required = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                           "original_max_position_embeddings")}.get(kind, ())
    for key in required:
        if not _positive_number(rope.get(key)):
            raise ConfigError(f"{kind} rope scaling needs a positive {key}, got {rope.get(key)!r}")
    if kind == "llama3" and not rope["low_freq_factor"] < rope["high_freq_factor"]:
        raise ConfigError("llama3 rope scaling needs low_freq_factor < high_freq_factor")


def hf_activation(cfg: Mapping[str, Any]) -> str:
    """The MLP activation's HF name (Gemma calls the key `hidden_activation`)."""
    return cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"


def _positive_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def check_model_size(config: ModelConfig) -> None:
    """Dimensions within `SIZE_LIMITS` (cheap arithmetic; nothing is built)."""
    for name, limit in SIZE_LIMITS.items():
        value = getattr(config, name)
        if value > limit:
            raise ConfigError(f"model config: {name}={value} is implausibly large (limit {limit})")


def check_weights_fit(model: nn.Module, dtype: torch.dtype, device: torch.device,
                      available: int | None) -> None:
    """The weights of `model` (built on the meta device) in `dtype` within `available`
    bytes of `device` (None: unknown, not checked)."""
    numel = sum(p.numel() for p in model.parameters())
    num_bytes = numel * dtype.itemsize
    if available is None or num_bytes <= available:
        return
    half = numel * 2
    if dtype.itemsize > 2 and half <= available:  # the flag that fixes it
        fix = f"--dtype bfloat16 halves them ({half / 2**30:.1f} GiB)"
    elif device.type == "cuda":
        fix = "split them over GPUs with --tensor-parallel-size, or use a smaller model"
    else:
        fix = "free memory or use a smaller model"
    raise ConfigError(
        f"the weights need {num_bytes / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}"
        f", only {available / 2**30:.1f} GiB is available on {device}; {fix}")


def check_checkpoint(model: nn.Module, shapes: Mapping[str, tuple[int, ...]],
                     target: Target) -> None:
    """Checkpoint tensors (name -> shape) against `model`'s parameters (built on meta,
    weights not tied yet). `target` is the loader's name -> (parameter, rows) mapping."""
    config: ModelConfig = model.config
    params = dict(model.named_parameters())
    if config.tie_word_embeddings:
        params.pop("lm_head.weight", None)  # the embedding's rows
    name_of = {id(p): n for n, p in params.items()}
    covered = {n: torch.zeros(p.shape[0], dtype=torch.bool) for n, p in params.items()}
    for name, shape in shapes.items():
        if is_ignorable(name, config):
            continue
        hit = target(name)
        param_name = None if hit is None else name_of.get(id(hit[0]))
        if param_name is None:
            raise ConfigError(_unexpected(name, shape, config))
        param, rows = hit
        expected = tuple(param.shape if rows is None else param[rows].shape)
        if tuple(shape) != expected:
            raise ConfigError(
                f"checkpoint tensor {name} has shape {tuple(shape)}, config.json implies "
                f"{expected}")
        covered[param_name][rows if rows is not None else slice(None)] = True
    missing = [n for n, rows in covered.items() if not bool(rows.all())]
    expert = next((n for n in missing if ".experts." in n), None)
    if expert is not None:  # stacked rows, one block per expert (models/sparse_moe.py)
        rows = covered[expert]
        first = int((~rows).nonzero()[0])
        raise ConfigError(
            f"the checkpoint lacks the weights of expert {first * config.num_experts // len(rows)}"
            f" for {expert} (config.json says {config.num_experts} experts)")
    if missing:
        raise ConfigError(
            f"the checkpoint lacks weights for {len(missing)} parameter(s) that config.json "
            f"implies, e.g. {missing[0]}")


def is_ignorable(name: str, config: ModelConfig) -> bool:
    """A checkpoint tensor the model has no use for and may safely skip."""
    if _IGNORABLE.search(name):
        return True
    # Some tied checkpoints still store the head: a copy of the embedding.
    return config.tie_word_embeddings and name == "lm_head.weight"


def _unexpected(name: str, shape: tuple[int, ...], config: ModelConfig) -> str:
    layer = _LAYER.match(name)
    if layer and int(layer[1]) >= config.num_hidden_layers:
        return (f"the checkpoint has weights for layer {layer[1]} ({name}) but config.json "
                f"says num_hidden_layers={config.num_hidden_layers}")
    expert = _EXPERT.search(name)
    if expert and config.num_experts and int(expert[1]) >= config.num_experts:
        return (f"the checkpoint has weights for expert {expert[1]} ({name}) but config.json "
                f"says the model has {config.num_experts} experts")
    return f"unexpected checkpoint tensor {name} {tuple(shape)}: config.json does not describe it"


def safetensors_shapes(files: Iterable[Path]) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor in `files`, from their headers (no data is read)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if name in shapes:
                    raise ConfigError(f"tensor {name} is stored twice (again in {file.name})")
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes
