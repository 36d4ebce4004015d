"""The collectives tensor parallelism needs, callable from eager code and from code that
torch.compile traces.

Eager calls go straight to torch.distributed, in place (no copy, no wrapper tensor).
Under compilation they are torch's functional collectives (`_c10d_functional.*`), which
Dynamo records as graph nodes and Inductor schedules (all_reduce + wait_tensor), taking
the process group by name, a string constant of the graph. They stay inside the
compiled pieces between two attention calls, so piecewise CUDA graphs capture them on
every rank (NCCL collectives are capturable); nothing here syncs with the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmfast.distributed.group import TensorParallelGroup


def all_reduce(x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    """The sum of `x` over the group's ranks (eager: `x` itself, summed in place)."""
    if torch.compiler.is_compiling():
        import torch.distributed._functional_collectives as fc

        return fc.all_reduce(x, "sum", group.group_name)
    dist.all_reduce(x, group=group.process_group)
    return x


# torch 2.13 renamed all_gather_into_tensor (deprecated there); 2.11 has only the old name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_last_dim(x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    """[n, k] on each rank -> [n, world_size * k], rank r's columns at [r * k, (r + 1) * k).

    Gathered along dim 0 ([world_size * n, k], the layout collectives produce) and then
    reordered: worked example, n = 2, k = 3, world 2: rows (r0 t0, r0 t1, r1 t0, r1 t1)
    -> view [2, 2, 3] (rank, token, col) -> permute (token, rank, col) -> [2, 6].
    """
    world = group.world_size
    n, k = x.shape
    if torch.compiler.is_compiling():
        import torch.distributed._functional_collectives as fc

        stacked = fc.all_gather_tensor(x.contiguous(), 0, group.group_name)
    else:
        stacked = x.new_empty(world * n, k)  # [world_size * n, k]
        _all_gather_single(stacked, x.contiguous(), group=group.process_group)
    return stacked.view(world, n, k).permute(1, 0, 2).reshape(n, world * k)


def broadcast_from_first(x: torch.Tensor, group: TensorParallelGroup) -> torch.Tensor:
    """Overwrite `x` on every rank with rank 0's `x`, in place (eager only: the runner
    calls it between steps' graphs). On CUDA the device waits, the host does not."""
    dist.broadcast(x, src=group.first_rank_global, group=group.process_group)
    return x


def min_across_ranks(value: int, group: TensorParallelGroup, device: torch.device) -> int:
    """The smallest of every rank's `value` (a start-up agreement, e.g. KV blocks; it
    syncs with the host). `device`: where the group communicates (cuda for NCCL)."""
    if group.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group.process_group)
    return int(t.item())
