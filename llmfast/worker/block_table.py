"""Block-table rows mirroring the scheduler's block ids, and the slot mapping.

Row `i` of the table lists the KV-cache blocks of the request in batch row `i`, in
order: position `p` of that request lives in block `table[i, p // block_size]` at
offset `p % block_size`, i.e. at slot `block * block_size + p % block_size`.
"""

from __future__ import annotations

import numpy as np
import torch

from llmfast.worker.buffers import CpuGpuBuffer

PAD_SLOT_ID = -1


class BlockTable:
    # The per-group tables of a model with several KV-cache groups
    # (worker/group_block_tables.py); None here: one table serves every layer.
    groups: list[BlockTable] | None = None

    def __init__(
        self,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.max_num_blocks_per_req = max_num_blocks_per_req
        # [max_num_reqs, max_num_blocks_per_req] int32; unused entries are 0 (null block).
        self.table = CpuGpuBuffer(max_num_reqs, max_num_blocks_per_req, dtype=torch.int32,
                                  device=device)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        # [max_num_batched_tokens] int64; padding tokens get PAD_SLOT_ID.
        self.slot_mapping = CpuGpuBuffer(max_num_batched_tokens, dtype=torch.int64, device=device)

    def add_row(self, row: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        self.table.np[row, :n] = block_ids
        self.table.np[row, n:] = 0
        self.num_blocks[row] = n

    def append_row(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = self.num_blocks[row]
        end = start + len(block_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(f"row {row} would hold {end} blocks, max {self.max_num_blocks_per_req}")
        self.table.np[row, start:end] = block_ids
        self.num_blocks[row] = end

    def clear_row(self, row: int) -> None:
        self.table.np[row, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        n = self.num_blocks[src]
        self.table.np[dst, :n] = self.table.np[src, :n]
        self.table.np[dst, n:] = 0
        self.num_blocks[dst] = n
        self.clear_row(src)

    def compute_slot_mapping(
        self, req_indices: np.ndarray, positions: np.ndarray, num_padded_tokens: int
    ) -> None:
        """Fill `slot_mapping.np[:num_padded_tokens]` for the step's tokens.

        Worked example, block_size 16, num_scheduled_tokens [4, 17, 4], rows whose
        tables start [0 ...], [5, 6 ...], [11 ...], all with num_computed_tokens 0:
            req_indices = [0]*4 + [1]*17 + [2]*4
            positions   = [0..3, 0..16, 0..3]
            block index = positions // 16 = [0]*4 + [0]*16 + [1] + [0]*4
            block       = [0]*4 + [5]*16 + [6] + [11]*4
            slots       = block * 16 + positions % 16 = [0..3, 80..96, 176..179]
        """
        n = len(positions)
        block_numbers = self.table.np[req_indices, positions // self.block_size]
        slots = self.slot_mapping.np
        np.add(
            block_numbers.astype(np.int64) * self.block_size,
            positions % self.block_size,
            out=slots[:n],
        )
        slots[n:num_padded_tokens] = PAD_SLOT_ID
