"""Frozen configuration dataclasses, validated on construction and never mutated.

`ModelConfig` is read from an HF `config.json`; the others come from engine arguments
(CLI flags or `LLM(**kwargs)`) and are passed down to the parts that need them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a dtype is made, so the host side stays light
    import torch

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
# The MLP's gate activations (HF's names): SiLU, and GELU's tanh form (Gemma's GeGLU).
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# --quantization: weights quantized at load (models/quantization/): fp8; gguf (a GGUF's
# blocks kept packed, CPU); none (as loaded, a GGUF dequantized). None: gguf for a
# quantized GGUF on the CPU, else none.
QUANTIZATION_METHODS = ("fp8", "gguf", "none")
# --kv-cache-dtype: auto = the model's dtype; fp8 = float8_e4m3fn with scale 1.0 (vLLM's
# default without calibrated scales). Aliases as vLLM spells them.
KV_CACHE_DTYPES = ("auto", "fp8")
_KV_CACHE_DTYPE_ALIASES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}
# --gemv: which kernel runs a projection of at most 16 token rows (a decode step) on
# CUDA (kernels/gemv/): auto = the Triton GEMV where this GPU's shipped table, or a
# measurement at start-up, found it faster than cuBLAS; triton = always; cublas = never.
GEMV_BACKENDS = ("auto", "triton", "cublas")
# e4m3fn has no inf: anything past its largest finite value converts to NaN (or
# saturates, depending on the torch version), so writes clamp to it first.
FP8_E4M3_MAX = 448.0

_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
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
    import torch

    if isinstance(name, torch.dtype):
        return name
    try:
        return getattr(torch, _DTYPES[str(name).lower().removeprefix("torch.")])
    except KeyError:
        raise ConfigError(
            f"unknown dtype {name!r}; choose one of float32, float16, bfloat16"
        ) from None


def check_quantization(method: object) -> None:
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ConfigError(f"unknown quantization {method!r}; use "
                          + ", ".join(QUANTIZATION_METHODS[:-1]) + " or "
                          + QUANTIZATION_METHODS[-1])


def parse_kv_cache_dtype(name: object) -> str:
    """`--kv-cache-dtype`'s value, aliases resolved ("fp8_e4m3" -> "fp8"); a bad one is a
    one-line usage error."""
    canonical = _KV_CACHE_DTYPE_ALIASES.get(name) if isinstance(name, str) else None
    if canonical is None:
        raise ConfigError(f"unknown kv cache dtype {name!r:.40}; use auto or fp8 "
                          "(fp8_e4m3)")
    return canonical


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache tensors' dtype: the model's for auto, float8_e4m3fn for fp8."""
    import torch

    return torch.float8_e4m3fn if parse_kv_cache_dtype(kv_cache_dtype) == "fp8" \
        else model_dtype


def parse_quantization(text: str) -> str:
    """`--quantization`'s value, checked (a bad one is a usage error, before loading)."""
    check_quantization(text)
    return text


def parse_gemv_backend(name: object) -> str:
    """`--gemv`'s value, checked (a bad one is a one-line usage error)."""
    if name not in GEMV_BACKENDS:
        raise ConfigError(f"unknown gemv backend {name!r:.40}; use "
                          f"{', '.join(GEMV_BACKENDS[:-1])} or {GEMV_BACKENDS[-1]}")
    return name


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: "default", "linear", "llama3" (Llama 3.1) or "yarn" (the
    long-context extension Qwen2.5 and Qwen3 document)."""

    rope_type: str = "default"
    factor: float = 1.0
    # llama3: the band of wavelengths interpolated between scaled and kept frequencies.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: rotation counts bounding the ramp from extrapolated to interpolated
    # dimensions, and the cos/sin scale (None: 0.1 * ln(factor) + 1, as the paper says).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    truncate: bool = True

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
    # What sets the families apart (see models/families.py for which family has what):
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    o_bias: bool = False  # a bias on the attention output projection (Llama attention_bias)
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
    # Attention over the last `sliding_window` tokens only (Mistral v0.1, Qwen2 with
    # use_sliding_window, Gemma 3's local layers), in the layers `layer_types` marks
    # "sliding_attention" (the others "full_attention"); no `layer_types`: every layer.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    # Gemma 3 (models/sandwich_layer.py): RMSNorm scaling by (1 + weight) in float32;
    # norms after attention and after the MLP too; embeddings times sqrt(hidden_size);
    # attention scaled by query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); the
    # sliding layers' own RoPE base (None: rope_theta); logits soft-capped by tanh.
    hidden_act: str = "silu"
    norm_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    query_pre_attn_scalar: float | None = None
    rope_local_theta: float | None = None
    final_logit_softcapping: float | None = None
    # Mixture of experts (Qwen3-MoE, Mixtral; 0 experts: a dense model). A sparse layer's
    # MLP is `num_experts` SwiGLU experts of `moe_intermediate_size` columns, of which a
    # router picks `num_experts_per_tok` per token; `norm_topk_prob`: the picked
    # probabilities renormalised to sum to 1. `dense_layers`: layers that keep a dense MLP
    # of `intermediate_size` (Qwen3-MoE's mlp_only_layers and decoder_sparse_step).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()

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
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(unsupported_architecture_message(self.architecture))
        self._check_experts()
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window <= 0
        ):
            raise ConfigError(
                f"model config: sliding_window must be a positive integer, got "
                f"{self.sliding_window!r}"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"unsupported activation hidden_act={self.hidden_act!r}; "
                              "llmfast runs " + ", ".join(SUPPORTED_ACTIVATIONS))
        if self.layer_types and (
            len(self.layer_types) != self.num_hidden_layers
            or not set(self.layer_types) <= {"sliding_attention", "full_attention"}
        ):
            raise ConfigError(
                f"model config: layer_types must name sliding_attention or full_attention "
                f"for each of the {self.num_hidden_layers} layers"
            )

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def kv_sliding_window(self) -> int | None:
        """The window if every layer slides (the KV-cache manager then frees the blocks
        that leave it); None when any layer attends globally, as all share block ids."""
        if self.sliding_window is None or "full_attention" in self.layer_types:
            return None
        return self.sliding_window

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer `layer`, or None for a global layer."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    def _check_experts(self) -> None:
        if self.num_experts == 0:
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"model config: num_experts_per_tok ({self.num_experts_per_tok}) "
                              f"exceeds num_experts ({self.num_experts})")

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer`'s MLP is the mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def resolve_max_model_len(self, requested: int | None, default_cap: int) -> int:
        """The max-model-len to run with: `requested`, or the model's positions capped at
        `default_cap`. (Sliding-window layers run at any length: their attention keeps to
        the window.)"""
        limit = self.max_position_embeddings
        if requested is None:
            return min(limit, default_cap)
        if requested > limit:
            raise ConfigError(f"max-model-len {requested} exceeds the model's {limit} positions")
        return requested

    def check_tensor_parallel(self, world_size: int) -> None:
        """Refuse a tensor-parallel size that does not split this model evenly: query
        heads and MLP columns divide by it; KV heads divide by it, or (fewer KV heads
        than ranks) it is a multiple of them, each KV head then replicated."""
        if world_size == 1:
            return
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        size = f"tensor-parallel size {world_size}"
        if heads % world_size:
            raise ConfigError(f"{size} does not divide the model's {heads} attention heads")
        if kv >= world_size and kv % world_size:
            raise ConfigError(f"{size} does not divide the model's {kv} KV heads")
        if kv < world_size and world_size % kv:
            raise ConfigError(f"{size} is not a multiple of the model's {kv} KV heads (with "
                              "fewer KV heads than ranks, each is replicated)")
        if self.intermediate_size % world_size:
            raise ConfigError(f"{size} does not divide the model's intermediate size "
                              f"{self.intermediate_size}")
        if self.num_experts and self.moe_intermediate_size % world_size:
            raise ConfigError(f"{size} does not divide the experts' intermediate size "
                              f"{self.moe_intermediate_size}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim


def unsupported_architecture_message(found: str) -> str:
    return f"unsupported architecture {found}; llmfast runs " + ", ".join(SUPPORTED_ARCHITECTURES)


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
    # "auto" (the model dtype) or "fp8" (float8_e4m3fn, scale 1.0): see KV_CACHE_DTYPES.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                              f"got {self.kv_cache_dtype!r:.40}")
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
    # One step in flight: schedule and prepare step N+1 while the device runs step N.
    async_scheduling: bool = False

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
    # Piecewise graphs (steps with prefill tokens) at these sizes instead of
    # cuda_graph_sizes: fewer of them capture faster, and below a few hundred tokens a
    # step padded further costs the GEMMs about nothing. None: cuda_graph_sizes.
    piecewise_graph_sizes: tuple[int, ...] | None = None
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
        for name in ("cuda_graph_sizes", "piecewise_graph_sizes"):
            sizes = getattr(self, name)
            if sizes is None:
                continue
            if any(s <= 0 for s in sizes):
                raise ConfigError(f"{name.replace('_', '-')} must be positive")
            if tuple(sorted(set(sizes))) != sizes:
                object.__setattr__(self, name, tuple(sorted(set(sizes))))


@dataclass(frozen=True)
class SkinnyLinearConfig:
    """How the projections of decode-sized steps (at most 16 token rows) run on CUDA
    (kernels/gemv/, worker/startup/gemv_routing.py). `backend` (--gemv): one of GEMV_BACKENDS;
    `fused_layers` (--gemv-fuse): Llama-shaped decoder layers as four fused GEMV
    launches and attention (models/fused_layer.py). The CPU ignores both."""

    backend: str = "auto"
    fused_layers: bool = False

    def __post_init__(self) -> None:
        parse_gemv_backend(self.backend)
        if self.fused_layers and self.backend == "cublas":
            raise ConfigError("--gemv-fuse runs the fused layers on the Triton GEMV, which "
                              "--gemv cublas turns off; drop one of the two")


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices: tensor parallelism over
    `tensor_parallel_size` ranks, run by the executor backend named here ("uni": one
    device in this process; "mp": one worker process per rank on this node; "ray": Ray
    actors, on the cluster at `ray_address` or a local one)."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError("the tensor-parallel size must be at least 1")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ConfigError(
                f"unknown executor backend {self.distributed_executor_backend!r}; choose "
                f"one of {', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}")
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ConfigError("the uni executor runs one rank; use --distributed-executor-"
                              "backend mp or ray for --tensor-parallel-size above 1")
        if self.ray_address is not None and self.distributed_executor_backend != "ray":
            # Would be ignored: the user meant to run on that cluster.
            raise ConfigError(f"--ray-address is for the ray backend; add --distributed-"
                              f"executor-backend ray (the backend is "
                              f"{self.distributed_executor_backend})")


SPECULATIVE_METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each decode step verifies up to `num_speculative_tokens`
    (K) proposed tokens as one (1 + K)-token query (worker/spec_decode/). "ngram":
    prompt lookup in the request's own tokens, suffixes of `prompt_lookup_min` to
    `prompt_lookup_max` tokens; "draft": a smaller model of the same tokenizer
    (`draft_model`, a path or spec as --model takes)."""

    method: str
    num_speculative_tokens: int
    draft_model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past its scheduled tokens each drafting request gets: a draft model
        writes its K drafts' KV there (worker/spec_decode/proposer.py)."""
        return self.num_speculative_tokens if self.method == "draft" else 0

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"unknown speculative method {self.method!r:.40}; choose "
                              f"{' or '.join(SPECULATIVE_METHODS)}")
        if self.num_speculative_tokens < 1:
            raise ConfigError("--num-speculative-tokens must be at least 1")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ConfigError("--speculative-model goes with --speculative-method draft "
                              "(and draft needs one)")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"n-gram sizes must satisfy 1 <= --ngram-prompt-lookup-min <= "
                              f"--ngram-prompt-lookup-max, got {self.prompt_lookup_min} and "
                              f"{self.prompt_lookup_max}")


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
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    chat_template: str | None = None  # replaces the tokenizer's own
    # (SamplingParams field, value) pairs a request gets for fields it leaves unset: the
    # model's generation_config.json (`--generation-config`).
    sampling_defaults: tuple[tuple[str, Any], ...] = ()
    # Weights quantized after loading, e.g. "fp8" (models/quantization/); None: as loaded.
    quantization: str | None = None
    # Speculative decoding (None: off).
    speculative: SpeculativeConfig | None = None
    # The decode-sized projections' kernels (--gemv, --gemv-fuse).
    gemv: SkinnyLinearConfig = field(default_factory=SkinnyLinearConfig)

    def __post_init__(self) -> None:
        check_quantization(self.quantization)
        self.model.check_tensor_parallel(self.parallel.tensor_parallel_size)

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)
