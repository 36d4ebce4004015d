"""How many bytes of weights a model holds, and how many one decode step reads.

With tensor parallelism `model` is one rank's: its shards (and the replicated norms), so
these are that rank's bytes, the ones its device streams.
"""

from __future__ import annotations

import torch

from llmfast.models.sparse_moe import SparseMoeBlock


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, a tied one counted once (works on meta too)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one decode step reads: every parameter once, except an untied input
    embedding, of which a step reads only its batch's rows (a tied one is read whole as
    the LM head), and a mixture of experts' experts, of which a batch-1 step reads the
    top-k it picked (the active-weight roofline's bytes; larger batches read more)."""
    total = weight_bytes(model)
    embed = model.model.embed_tokens.weight
    # A packed lm_head (models/quantization/gguf.py) has its own, packed, parameters.
    if embed is not getattr(model.lm_head, "weight", None):
        total -= embed.numel() * embed.element_size()
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            experts = weight_bytes(module.experts)
            total -= experts - experts * module.top_k // module.experts.num_experts
    return total
