"""Tensor parallelism's communication: the process group of the ranks that share one
model (`TensorParallelGroup`), created once per worker and passed down to the runner and
the model, never looked up globally."""

from llmfast.distributed.group import TensorParallelGroup, init_tensor_parallel

__all__ = ["TensorParallelGroup", "init_tensor_parallel"]
