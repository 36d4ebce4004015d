"""Engine arguments: the CLI's engine flags with underscores, resolved into an EngineConfig."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from llmfast.config import (
    DEFAULT_CUDA_GRAPH_SIZES,
    CacheConfig,
    CompileConfig,
    ConfigError,
    CudaGraphMode,
    EngineConfig,
    SchedulerConfig,
    dtype_name,
    parse_cuda_graph_mode,
    parse_dtype,
)
from llmfast.models.loader import ModelSource, resolve_model
from llmfast.value_checks import describe, is_int, is_number

Progress = Callable[[str, float | None], None]

DEFAULT_MAX_MODEL_LEN = 8192

# Step limits when the user sets none: (max_num_seqs, max_num_batched_tokens) by device.
# CPU: what a 2-core machine gets through in one step without stalling interactive use.
# CUDA: room for a large decode batch *and* its prefill in one budget. On the H100 a
# 2048-token budget forced chunked prefill into the decode steps at batch >= 256
# (7.1 ms vs 6.1 ms per step with a 64k budget, GPU-RESULTS.md); 8192 tokens / 512
# sequences keeps a 1B-8B model's steps large enough to fill the GPU while the profiled
# activation peak stays small (~1 GiB for 8B). To be confirmed by measurement on the
# H100 (scripts/gpu_check.sh step `defaults`).
DEFAULT_STEP_LIMITS = {"cpu": (256, 2048), "cuda": (512, 8192)}


def default_step_limits(device: torch.device) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) for a device kind, when the user sets none."""
    return DEFAULT_STEP_LIMITS.get(device.type, DEFAULT_STEP_LIMITS["cpu"])


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None  # None: the default model
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # cuda if available, else cpu
    seed: int = 0
    max_num_seqs: int | None = None  # None: 256 on CPU, 512 on CUDA
    max_num_batched_tokens: int | None = None  # None: 2048 on CPU, 8192 on CUDA
    max_model_len: int | None = None  # None: the model's, capped at 8192
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes (CPU)
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no compile, no CUDA graphs
    compile: bool | None = None  # None: on for CUDA, off for CPU
    cuda_graphs: bool = True  # False: cuda_graph_mode "none" (--no-cuda-graphs)
    # none, piecewise, full_decode or full_and_piecewise (graphs/dispatch.py).
    # None: full_and_piecewise on CUDA; graphs are always off on CPU and when eager.
    cuda_graph_mode: str | None = None
    cuda_graph_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_engine_args(self)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineArgs:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def create_engine_config(
        self, progress: Progress | None = None
    ) -> tuple[EngineConfig, ModelSource]:
        device = resolve_device(self.device)
        dtype = (torch.bfloat16 if device.type == "cuda" else torch.float32) \
            if self.dtype == "auto" else parse_dtype(self.dtype)
        if device.type == "cpu" and dtype == torch.float16:
            raise ConfigError("float16 is not supported on CPU; use float32 or bfloat16")
        if device.type == "cuda" and self.block_size not in (16, 32, 64):
            raise ConfigError(f"on CUDA the block size must be 16, 32 or 64; got {self.block_size}")
        source = resolve_model(self.model, progress=progress)
        model_max = source.config.max_position_embeddings
        max_model_len = self.max_model_len or min(model_max, DEFAULT_MAX_MODEL_LEN)
        if max_model_len > model_max:
            raise ConfigError(
                f"max-model-len {max_model_len} exceeds the model's {model_max} positions"
            )
        default_seqs, default_tokens = default_step_limits(device)
        max_num_seqs = default_seqs if self.max_num_seqs is None else self.max_num_seqs
        max_num_batched_tokens = (default_tokens if self.max_num_batched_tokens is None
                                  else self.max_num_batched_tokens)
        use_compile = (device.type == "cuda") if self.compile is None else self.compile
        enforce_eager = self.enforce_eager or not use_compile
        graph_mode = parse_cuda_graph_mode(self.cuda_graph_mode or "full_and_piecewise")
        if not self.cuda_graphs or device.type != "cuda" or enforce_eager:
            graph_mode = CudaGraphMode.NONE
        config = EngineConfig(
            model_path=str(source.path) if source.path else source.spec,
            model=source.config,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory=self.kv_cache_memory,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
            compile=CompileConfig(
                enforce_eager=enforce_eager,
                cuda_graph_mode=graph_mode,
                cuda_graph_sizes=tuple(
                    s for s in (self.cuda_graph_sizes or DEFAULT_CUDA_GRAPH_SIZES)
                    if s <= max_num_batched_tokens
                ),
            ),
            device=str(device),
            dtype=dtype_name(dtype),
            seed=self.seed,
        )
        return config, source


# name -> smallest value; None allowed where the field's default is None.
_INT_ARGS = {"seed": 0, "max_num_seqs": 1, "max_num_batched_tokens": 1, "max_model_len": 1,
             "block_size": 1, "kv_cache_memory": 1, "num_gpu_blocks_override": 2}
_BOOL_ARGS = ("enable_prefix_caching", "enforce_eager", "compile", "cuda_graphs")


def check_engine_args(args: EngineArgs) -> None:
    """Types and lower bounds, before anything is resolved or loaded: `LLM(seed=-1)` and
    `LLM(max_model_len=0)` fail as `--seed -1` and `--max-model-len 0` do."""
    for name, low in _INT_ARGS.items():
        value = getattr(args, name)
        if value is None and getattr(EngineArgs, name) is None:
            continue
        if not is_int(value) or value < low:
            kind = {0: "a non-negative integer", 1: "a positive integer"}.get(
                low, f"an integer >= {low}")
            raise ConfigError(f"{_flag(name)} must be {kind}, got {describe(value)}")
    for name in _BOOL_ARGS:
        value = getattr(args, name)
        optional = value is None and getattr(EngineArgs, name) is None
        if not isinstance(value, bool) and not optional:
            raise ConfigError(f"{_flag(name)} must be True or False, got {describe(value)}")
    if not is_number(args.gpu_memory_utilization):
        raise ConfigError(f"gpu-memory-utilization must be a number, got "
                          f"{describe(args.gpu_memory_utilization)}")
    for name in ("dtype", "device"):
        value = getattr(args, name)
        if not isinstance(value, str) and not (name == "dtype" and isinstance(value, torch.dtype)):
            raise ConfigError(f"{name} must be a string, got {describe(value)}")
    if args.model is not None and not isinstance(args.model, str):
        raise ConfigError(f"model must be a path or name (a string), got {describe(args.model)}")
    if args.cuda_graph_mode is not None:
        parse_cuda_graph_mode(args.cuda_graph_mode)  # an unknown name fails here, early
    sizes = args.cuda_graph_sizes
    if sizes is not None and (isinstance(sizes, (str, bytes)) or not all(
            is_int(s) and s > 0 for s in sizes)):
        raise ConfigError(f"cuda-graph-sizes must be positive integers, got {sizes!r:.60}")


def _flag(name: str) -> str:
    return name.replace("_", "-")


_DEVICE_RE = re.compile(r"^(cpu|cuda)(:\d+)?$")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not _DEVICE_RE.match(name):
        raise ConfigError(f"unknown device {name!r}; use auto, cpu or cuda[:N]")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name} requested but no CUDA GPU is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name} does not exist ({torch.cuda.device_count()} GPUs)")
    return device
