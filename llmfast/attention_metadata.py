"""Per-step attention metadata, threaded from the runner into `forward` (no global
context). All fields are device tensors sliced from the runner's persistent buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step
