"""Where the ranks of one node run: a device each, a share of the CPU cores (and of the
host memory for the KV cache), and a free port for torch.distributed's rendezvous."""

from __future__ import annotations

import dataclasses

import torch

from llmfast.config import ConfigError, EngineConfig
from llmfast.worker.startup.kv_cache_sizing import cpu_rank_cache


def rank_devices(device: str, world_size: int) -> list[str]:
    """One device per rank: CUDA ranks take consecutive GPUs from the one named
    (`cuda` = `cuda:0`); CPU ranks all run on the CPU (gloo)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return [str(dev)] * world_size
    first = dev.index or 0
    available = torch.cuda.device_count()
    if first + world_size > available:
        raise ConfigError(
            f"--tensor-parallel-size {world_size} needs {world_size} GPUs from cuda:{first}; "
            f"this node has {available}")
    return [f"cuda:{first + rank}" for rank in range(world_size)]


def rank_config(config: EngineConfig, device: str, world_size: int) -> EngineConfig:
    """One rank's engine config: its own device; on CPU, where every rank's KV cache comes
    out of the same host memory, a share of the default KV budget (so N ranks together
    take what one process would)."""
    cache = config.cache
    if torch.device(device).type == "cpu":
        cache = cpu_rank_cache(cache, world_size)
    return dataclasses.replace(config, device=device, cache=cache)


def cpu_threads_per_rank(device: str, world_size: int) -> int | None:
    """CPU ranks split the cores torch would use in one process (more would oversubscribe
    them: each rank waits for the slowest in every all-reduce)."""
    if torch.device(device).type != "cpu":
        return None
    return max(1, torch.get_num_threads() // world_size)
