"""Frozen configuration dataclasses, validated on construction and never mutated.

`ModelConfig` is read from an HF `config.json`; the others come from engine arguments
(CLI flags or `LLM(**kwargs)`) and are passed down to the parts that need them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


class ConfigError(ValueError):
    """A configuration that llmfast cannot run; the message is one user-facing line."""


class CudaGraphMode(str, Enum):
    """Which CUDA graphs a step may replay (vLLM's names).

    none: compiled (or eager) forwards only. piecewise: the compiled pieces between the
    attention calls, attention eager. full_decode: one graph of the whole forward for
    uniform-decode steps, nothing for the others. full_and_piecewise: full graphs for
    uniform decode, piecewise for steps with prefill tokens.
    """

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL_DECODE = "full_decode"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @property
    def has_full(self) -> bool:
        return self in (CudaGraphMode.FULL_DECODE, CudaGraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise(self) -> bool:
        return self in (CudaGraphMode.PIECEWISE, CudaGraphMode.FULL_AND_PIECEWISE)


def parse_cuda_graph_mode(name: str | CudaGraphMode) -> CudaGraphMode:
    try:
        return CudaGraphMode(name)
    except ValueError:
        choices = ", ".join(m.value for m in CudaGraphMode)
        raise ConfigError(f"unknown cuda graph mode {name!r}; use one of {choices}") from None


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower().removeprefix("torch.")]
    except KeyError:
        raise ConfigError(
            f"unknown dtype {name!r}; choose one of float32, float16, bfloat16"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is "default", "linear" or "llama3"."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope type {self.rope_type!r}; llmfast supports "
                + ", ".join(SUPPORTED_ROPE_TYPES)
            )
        if self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"  # the checkpoint's dtype, as written in config.json

    def __post_init__(self) -> None:
        positive = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model config: num_attention_heads ({self.num_attention_heads}) is not a "
                f"multiple of num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from the dict of an HF `config.json` (transformers 4.x or 5.x)."""
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        if model_type != "llama" and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            found = ", ".join(archs) or model_type or "nothing"
            raise ConfigError(
                f"unsupported architecture {found}; llmfast runs Llama-family models "
                "(LlamaForCausalLM)"
            )
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if key not in cfg:
                raise ConfigError(f"config.json lacks {key!r}")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        # transformers 5 writes rope settings as `rope_parameters` (theta included);
        # transformers 4 as `rope_theta` plus an optional `rope_scaling` dict.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = RopeScaling(
            rope_type=rope_type,
            factor=float(rope.get("factor", 1.0)),
            low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                rope.get("original_max_position_embeddings", 8192)
            ),
        )
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise ConfigError("Llama variants with attention or MLP biases are not supported")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=cfg.get("intermediate_size", 4 * hidden),
            vocab_size=cfg["vocab_size"],
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"{path} does not hold a JSON object")
        return cls.from_hf_dict(cfg)

    def to_hf_dict(self) -> dict[str, Any]:
        """An HF-style `config.json` dict (transformers 4 and 5 both read it)."""
        rope: dict[str, Any] | None = None
        if self.rope_scaling.rope_type != "default":
            rope = {
                "rope_type": self.rope_scaling.rope_type,
                "factor": self.rope_scaling.factor,
                "low_freq_factor": self.rope_scaling.low_freq_factor,
                "high_freq_factor": self.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": (
                    self.rope_scaling.original_max_position_embeddings
                ),
            }
        eos: int | list[int] | None
        eos = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": self.torch_dtype,
        }


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # CPU: bytes for the KV cache (None: a default from the model size and free RAM).
    kv_cache_memory: int | None = None
    # CUDA: fraction of the device memory llmfast may use in all.
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # Overrides the memory-derived block count (tests, tight-memory experiments).
    num_gpu_blocks_override: int | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 128 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block size must be a power of two up to 128; got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu memory utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv cache memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError("the KV cache needs at least 2 blocks (block 0 is reserved)")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name.replace('_', '-')} must be a positive integer, got {value!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                "without chunked prefill, max-num-batched-tokens must be >= max-model-len"
            )


DEFAULT_CUDA_GRAPH_SIZES: tuple[int, ...] = (
    (1, 2, 4) + tuple(range(8, 256, 8)) + tuple(range(256, 513, 16))
)


@dataclass(frozen=True)
class CompileConfig:
    # "eager": plain PyTorch; "compile": torch.compile with the piecewise backend.
    enforce_eager: bool = False
    # Ignored under enforce_eager; the engine turns it to NONE off CUDA.
    cuda_graph_mode: CudaGraphMode = CudaGraphMode.FULL_AND_PIECEWISE
    cuda_graph_sizes: tuple[int, ...] = DEFAULT_CUDA_GRAPH_SIZES
    splitting_ops: tuple[str, ...] = ("llmfast::unified_attention",)
    use_compile_cache: bool = True
    # Debug mode: assert that CUDA-graph inputs never move.
    check_static_addresses: bool = False
    # Tests: a CPU stand-in with CUDA-graph semantics (capture, static addresses,
    # padding, dispatch) instead of real graphs; no speed-up.
    emulate_cuda_graphs: bool = False

    @property
    def use_cuda_graphs(self) -> bool:
        return not self.enforce_eager and self.cuda_graph_mode != CudaGraphMode.NONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "cuda_graph_mode", parse_cuda_graph_mode(self.cuda_graph_mode))
        if any(s <= 0 for s in self.cuda_graph_sizes):
            raise ConfigError("cuda graph sizes must be positive")
        if tuple(sorted(set(self.cuda_graph_sizes))) != self.cuda_graph_sizes:
            object.__setattr__(self, "cuda_graph_sizes", tuple(sorted(set(self.cuda_graph_sizes))))


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, resolved: the model path is a local directory."""

    model_path: str
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    compile: CompileConfig
    device: str
    dtype: str
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)
