"""Sampling under tensor parallelism: rank 0 samples, every rank gets its ids.

Each rank feeds the sampled ids into its next step on the device (placeholder fill,
see placeholders.py), so the ranks must agree on them bit for bit. Random rows without
a seed draw from each process's own generator, so only one rank samples
and broadcasts its [n] ids, in place, on the device: no host sync (NCCL), and the other
ranks skip the sampler (their logprobs are never returned).
"""

from __future__ import annotations

import torch

from llmfast.distributed import TensorParallelGroup, broadcast_from_first
from llmfast.worker.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata


def sample_on_first_rank(sampler: Sampler, logits: torch.Tensor, metadata: SamplingMetadata,
                         group: TensorParallelGroup) -> SamplerOutput:
    """logits [n, vocab_size] (the same on every rank) -> rank 0's sampled ids [n] on
    every rank; logprobs on rank 0 only."""
    if group.is_first_rank:
        out = sampler(logits, metadata)
    else:
        ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        out = SamplerOutput(sampled_token_ids=ids, logprobs=None)
    broadcast_from_first(out.sampled_token_ids, group)
    return out
