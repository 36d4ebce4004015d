"""Per-step attention metadata, threaded from the runner into `forward` (no global
context). All fields but `max_query_len` are device tensors sliced from the runner's
persistent buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step
    # [1] int32 on the CPU (no device sync to read): the most query tokens any request
    # row has this step. 1 tells the attention op that the step is uniform decode (it
    # may rotate and cache the new tokens inside the attention kernel); None: unknown.
    # A tensor, not an int, so that Dynamo does not specialize on its value.
    max_query_len: torch.Tensor | None = None
