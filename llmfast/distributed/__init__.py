"""Tensor parallelism's communication: the process group of the ranks that share one
model (`TensorParallelGroup`), created once per worker and passed down to the runner and
the model, never looked up globally."""

from llmfast.distributed.collectives import (
    all_gather_last_dim,
    all_reduce,
    broadcast_from_first,
    min_across_ranks,
)
from llmfast.distributed.group import TensorParallelGroup, init_tensor_parallel

__all__ = [
    "TensorParallelGroup",
    "all_gather_last_dim",
    "all_reduce",
    "broadcast_from_first",
    "init_tensor_parallel",
    "min_across_ranks",
]
