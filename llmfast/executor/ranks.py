"""Where the ranks of one node run: a device each, a share of the CPU cores, and a free
port for torch.distributed's rendezvous."""

from __future__ import annotations

import socket

import torch

from llmfast.config import ConfigError


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


def cpu_threads_per_rank(device: str, world_size: int) -> int | None:
    """CPU ranks split the cores torch would use in one process (more would oversubscribe
    them: each rank waits for the slowest in every all-reduce)."""
    if torch.device(device).type != "cpu":
        return None
    return max(1, torch.get_num_threads() // world_size)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on `host` (the OS picks it; the rendezvous binds it a moment
    later, so another process could take it in between: unlikely, and then the start
    fails loudly rather than hangs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
