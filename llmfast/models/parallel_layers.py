"""The layers whose tensor-parallel forward differs from the single-device one.

Column-parallel projections (qkv, gate_up) need nothing new: they are plain `Linear`s
with this rank's rows (models/sharding.py says which). What communicates:
- `RowParallelLinear` (o_proj, down_proj): a partial product over this rank's input
  columns, summed over ranks by one all-reduce; the bias is rank 0's alone;
- `VocabParallelEmbedding`: each rank looks up the ids in its vocabulary rows, zeros
  elsewhere; one all-reduce assembles the embeddings;
- `gather_logits`: the lm_head's vocabulary slices, gathered into full rows.

The factories return the single-device layer for a world of one: no extra op there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmfast.distributed import TensorParallelGroup, all_gather_last_dim, all_reduce
from llmfast.kernels.cpu.linear import Linear


class RowParallelLinear(Linear):
    """x [T, in / W] (this rank's columns) -> [T, out], summed over the ranks."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallelGroup) -> None:
        # Only rank 0 holds (and adds) the bias: after the sum it is there once.
        super().__init__(in_features, out_features, bias=bias and tp.is_first_rank)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x), self.tp)


def row_parallel_linear(in_features: int, out_features: int, bias: bool,
                        tp: TensorParallelGroup) -> Linear:
    if tp.world_size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_start + num_embeddings) of the embedding table."""

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_start: int,
                 tp: TensorParallelGroup) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.vocab_start = vocab_start
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start  # [T]
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0.0), self.tp)


def vocab_parallel_embedding(num_embeddings: int, embedding_dim: int, vocab_start: int,
                             tp: TensorParallelGroup) -> nn.Embedding:
    if tp.world_size == 1:
        return nn.Embedding(num_embeddings, embedding_dim)
    return VocabParallelEmbedding(num_embeddings, embedding_dim, vocab_start, tp)


def gather_logits(logits: torch.Tensor, vocab_size: int,
                  tp: TensorParallelGroup) -> torch.Tensor:
    """[n, V_r] this rank's vocabulary slice -> [n, vocab_size] on every rank (the
    padding rows of the last slice dropped)."""
    return all_gather_last_dim(logits, tp)[:, :vocab_size]
