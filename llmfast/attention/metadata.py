"""Per-step attention metadata, threaded from the runner into `forward` (no global
context). All fields but `max_query_len` are device tensors sliced from the runner's
persistent buffers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from llmfast.attention.cpu_step import CpuStepState


# Marks a field that compiled graphs never read (dataclasses.field metadata): a
# precompiled model does not check it against the traced call's.
EAGER_ONLY = "eager_only"


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step
    # [1] int32 on the CPU (no device sync to read): the most query tokens any request
    # row has this step. 1 tells the attention op that the step is uniform decode (it
    # may rotate and cache the new tokens inside the attention kernel); None: unknown.
    # A tensor, not an int, so that Dynamo does not specialize on its value; made by
    # `host_max_query_len`.
    max_query_len: torch.Tensor | None = None
    # A model with several KV-cache groups (core/kv_cache_groups.py): per group its slot
    # mapping [num_tokens] and block table [num_reqs, max_blocks_per_req] (group 0's
    # are `slot_mapping` and `block_table` above); a layer reads its group's. None: one
    # group, whose tables are the two above.
    group_slot_mappings: tuple[torch.Tensor, ...] | None = None
    group_block_tables: tuple[torch.Tensor, ...] | None = None
    # The torch (CPU) paths' per-step memo of what every layer computes alike: the
    # attention plan, the rotary rows, the padding flag (attention/cpu_step.py). Made
    # fresh with each step's metadata; eager code only reads it, compiled graphs never
    # (not a graph input: `EAGER_ONLY`). None: each layer computes its own.
    cpu_step: CpuStepState | None = field(default=None, repr=False, compare=False,
                                          metadata={EAGER_ONLY: True})


def host_max_query_len(value: int = 0) -> torch.Tensor:
    """A [1] int32 CPU tensor holding `value`, for AttentionMetadata.max_query_len: always
    a normal tensor, also when made under torch.inference_mode (as captures run).

    Where the model hands it to the attention op (RoPE in the op: the CUDA default) it is
    a graph input, and Dynamo guards on its dispatch keys, which differ between normal
    and inference tensors: a full graph's tensor made in its capture, among steps' made
    at start-up, recompiled the model mid-capture (the piecewise graphs' pieces then
    never ran at the next size, and the start failed). Whoever makes one makes it here."""
    with torch.inference_mode(False):
        return torch.full((1,), value, dtype=torch.int32)
