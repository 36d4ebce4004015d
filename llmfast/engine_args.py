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
    EngineConfig,
    SchedulerConfig,
    dtype_name,
    parse_dtype,
)
from llmfast.models.loader import ModelSource, resolve_model

Progress = Callable[[str, float | None], None]

DEFAULT_MAX_MODEL_LEN = 8192


@dataclass(frozen=True)
class EngineArgs:
    model: str | None = None  # None: the default model
    dtype: str = "auto"  # float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # cuda if available, else cpu
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's, capped at 8192
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes (CPU)
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no compile, no CUDA graphs
    compile: bool | None = None  # None: on for CUDA, off for CPU
    cuda_graphs: bool = True
    cuda_graph_sizes: tuple[int, ...] | None = None

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
        use_compile = (device.type == "cuda") if self.compile is None else self.compile
        enforce_eager = self.enforce_eager or not use_compile
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
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
            compile=CompileConfig(
                enforce_eager=enforce_eager,
                use_cuda_graphs=self.cuda_graphs and device.type == "cuda" and not enforce_eager,
                cuda_graph_sizes=tuple(
                    s for s in (self.cuda_graph_sizes or DEFAULT_CUDA_GRAPH_SIZES)
                    if s <= self.max_num_batched_tokens
                ),
            ),
            device=str(device),
            dtype=dtype_name(dtype),
            seed=self.seed,
        )
        return config, source


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
