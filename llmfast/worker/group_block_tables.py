"""Block tables of a model with several KV-cache groups (core/kv_cache_groups.py): one
`BlockTable` per group (its rows, its slot mapping), behind BlockTable's interface.

The scheduler sends a request's block ids as a tuple of one list per group; row i of
group g's table lists the request's blocks in group g. A sliding group's table keeps
the ids of blocks that left its window (the scheduler does not say; the attention never
reads them), as the single-group table of an all-sliding model does. Each group's slot
mapping places the step's tokens in that group's blocks: the same positions, other block
ids. Every buffer is allocated once (CUDA graphs read them at fixed addresses).

`table` and `slot_mapping` are group 0's, so that code which fills a dummy step (the
captures) through them fills the first group; the attention metadata carries every
group's (`device_groups`), and each layer reads its own group's (models/decoder.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from llmfast.worker.block_table import BlockTable


class MultiGroupBlockTable:
    def __init__(self, num_groups: int, max_num_reqs: int, max_num_blocks_per_req: int,
                 max_num_batched_tokens: int, block_size: int, device: torch.device) -> None:
        self.groups = [BlockTable(max_num_reqs, max_num_blocks_per_req,
                                  max_num_batched_tokens, block_size, device)
                       for _ in range(num_groups)]
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        self.table = self.groups[0].table
        self.slot_mapping = self.groups[0].slot_mapping
        self.num_blocks = self.groups[0].num_blocks

    def add_row(self, row: int, block_ids: Sequence[list[int]]) -> None:
        for table, ids in zip(self.groups, block_ids, strict=True):
            table.add_row(row, ids)

    def append_row(self, row: int, block_ids: Sequence[list[int]]) -> None:
        for table, ids in zip(self.groups, block_ids, strict=True):
            table.append_row(row, ids)

    def clear_row(self, row: int) -> None:
        for table in self.groups:
            table.clear_row(row)

    def move_row(self, src: int, dst: int) -> None:
        for table in self.groups:
            table.move_row(src, dst)

    def compute_slot_mapping(self, req_indices: np.ndarray, positions: np.ndarray,
                             num_padded_tokens: int) -> None:
        """Each group's slot mapping (BlockTable.compute_slot_mapping, per group)."""
        for table in self.groups:
            table.compute_slot_mapping(req_indices, positions, num_padded_tokens)

    def device_groups(self, num_padded: int, num_rows: int, num_reqs: int
                      ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Per group (slot mapping [num_padded], block table [num_rows, max_blocks]) on
        the device: the mappings and the first `num_reqs` table rows copied there."""
        slots = tuple(t.slot_mapping.copy_to_gpu(num_padded) for t in self.groups)
        tables = tuple(t.table.gpu[:num_rows] for t in self.groups)
        for t in self.groups:
            t.table.copy_to_gpu(num_reqs)
        return slots, tables
