"""`TensorParallelGroup`: this rank's place among the ranks of one model.

One is made per worker process by `init_tensor_parallel` (NCCL on CUDA, gloo on CPU) and
passed to the runner, which passes it to the model: there is no global parallel state.
A world of one rank needs no process group at all (`TensorParallelGroup.single()`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    # The torch.distributed process group of the ranks; None for a world of one.
    process_group: Any = None

    @classmethod
    def single(cls) -> TensorParallelGroup:
        return cls(rank=0, world_size=1)

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    @property
    def group_name(self) -> str:
        """The process group's name in torch's registry: what the functional
        collectives that compiled graphs record take (a string, a graph constant)."""
        return self.process_group.group_name

    @property
    def first_rank_global(self) -> int:
        """The global rank of this group's rank 0 (torch.distributed's `src`)."""
        return dist.get_global_rank(self.process_group, 0)


def init_tensor_parallel(rank: int, world_size: int, init_method: str,
                         device: torch.device, timeout_s: float = 600.0
                         ) -> TensorParallelGroup:
    """Join the process group of `world_size` ranks at `init_method` (e.g.
    "tcp://127.0.0.1:29500"); on CUDA, also make `device` this process's current one."""
    if world_size == 1:
        return TensorParallelGroup.single()
    import datetime

    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return TensorParallelGroup(rank=rank, world_size=world_size,
                               process_group=dist.group.WORLD)
