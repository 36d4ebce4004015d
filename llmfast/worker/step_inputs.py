"""`StepInputs`: the persistent buffers the model reads each step, and how a step's
scheduled tokens fill them: vectorised numpy on the host views, then one copy each to
the device, padded to the size the step runs at (a CUDA graph's).

The buffers are allocated once; their device tensors' addresses never change, which
CUDA-graph replay relies on (startup/graph_capture.py captures from the same buffers).
"""

from __future__ import annotations

from itertools import repeat

import numpy as np
import torch

from llmfast.attention.cpu_step import CpuStepState
from llmfast.attention.metadata import AttentionMetadata, host_max_query_len
from llmfast.core.scheduler_output import SchedulerOutput
from llmfast.cuda_graphs.dispatch import GraphDispatcher, StepDispatch, uniform_query_len
from llmfast.kernels.triton_mode import use_triton
from llmfast.worker.buffers import CpuGpuBuffer
from llmfast.worker.input_batch import InputBatch
from llmfast.worker.placeholders import PlaceholderFill


class StepInputs:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, device: torch.device) -> None:
        def buf(*shape: int, dtype: torch.dtype) -> CpuGpuBuffer:
            return CpuGpuBuffer(*shape, dtype=dtype, device=device)

        self.input_ids = buf(max_num_tokens, dtype=torch.int64)
        self.positions = buf(max_num_tokens, dtype=torch.int64)
        self.query_start_loc = buf(max_num_reqs + 1, dtype=torch.int32)
        self.seq_lens = buf(max_num_reqs, dtype=torch.int32)
        self.logits_indices = buf(max_num_reqs, dtype=torch.int64)
        # The step's most query tokens in a row: on the CPU only (the attention op reads
        # it on the host, AttentionMetadata.max_query_len); one tensor for every step.
        self.max_query_len = host_max_query_len()
        self._max_query_len_np = self.max_query_len.numpy()
        self._arange = np.arange(max(max_num_tokens, max_num_reqs) + 1, dtype=np.int64)
        # The torch paths (the CPU without Triton's interpreter) share per-step work
        # between layers through a fresh memo in each step's metadata.
        self.cpu_step = not use_triton(self.positions.gpu)

    def prepare(
        self, out: SchedulerOutput, batch: InputBatch, dispatcher: GraphDispatcher,
        placeholders: PlaceholderFill,
    ) -> tuple[AttentionMetadata, StepDispatch, np.ndarray, np.ndarray]:
        """Fill the persistent buffers for this step.

        Returns (attention metadata, which runner and padding, tokens scheduled per
        row, rows that sample). Under a full graph the metadata has one request row per
        padded token: rows past the live ones hold no query token (query_start_loc
        repeats the total, seq_len 0), so the attention programs of those rows exit.
        Worked example, num_scheduled [2, 5, 3], num_computed [10, 0, 7]:
            req_indices     = [0 0 1 1 1 1 1 2 2 2]
            query_start_loc = [0 2 7 10]
            offsets         = [0 1 0 1 2 3 4 0 1 2]
            positions       = [10 11 0 1 2 3 4 7 8 9]
            logits_indices  = [1 6 9] (each request's last scheduled token)
        """
        n = batch.num_reqs
        num_sched = scheduled_per_row(out.num_scheduled_tokens, batch.req_ids[:n])
        cu = np.cumsum(num_sched)
        num_tokens = int(cu[-1])
        query_len = uniform_query_len(num_sched)
        dispatch = dispatcher.dispatch(num_tokens, n, query_len == 1, query_len)
        num_padded, num_rows = dispatch.descriptor.num_tokens, dispatch.num_reqs
        req_indices = np.repeat(self._arange[:n], num_sched)
        offsets = self._arange[:num_tokens] - np.repeat(cu - num_sched, num_sched)
        computed = batch.num_computed_tokens[:n]
        positions = computed[req_indices] + offsets

        self.positions.np[:num_tokens] = positions
        self.positions.np[num_tokens:num_padded] = 0
        flat = req_indices * batch.max_model_len + positions
        self.input_ids.np[:num_tokens] = batch.token_ids.ravel()[flat]
        self.input_ids.np[num_tokens:num_padded] = 0
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : n + 1] = cu
        self.query_start_loc.np[n + 1 : num_rows + 1] = num_tokens
        seq_lens = computed + num_sched
        self.seq_lens.np[:n] = seq_lens
        self.seq_lens.np[n:num_rows] = 0
        self.logits_indices.np[:n] = np.maximum(cu - 1, 0)
        batch.block_table.compute_slot_mapping(req_indices, positions, num_padded)
        # A row samples when this step reaches the end of its known tokens.
        sampling_rows = np.flatnonzero((num_sched > 0) & (seq_lens >= batch.num_tokens[:n]))

        # Read by this step's attention ops on the host while the forward is issued,
        # before the next step's prepare rewrites it.
        self._max_query_len_np[0] = num_sched.max() if n else 0
        table = batch.block_table
        if table.groups is None:
            md = AttentionMetadata(
                slot_mapping=table.slot_mapping.copy_to_gpu(num_padded),
                # Rows n.. of a full graph's table are not copied: no program reads them.
                block_table=table.table.gpu[:num_rows],
                query_start_loc=self.query_start_loc.copy_to_gpu(num_rows + 1),
                seq_lens=self.seq_lens.copy_to_gpu(num_rows),
                max_query_len=self.max_query_len,
                cpu_step=CpuStepState() if self.cpu_step else None,
            )
            table.table.copy_to_gpu(n)
        else:  # several KV-cache groups: each group's tables too
            slots, tables = table.device_groups(num_padded, num_rows, n)
            md = AttentionMetadata(
                slot_mapping=slots[0], block_table=tables[0],
                query_start_loc=self.query_start_loc.copy_to_gpu(num_rows + 1),
                seq_lens=self.seq_lens.copy_to_gpu(num_rows),
                max_query_len=self.max_query_len,
                group_slot_mappings=slots, group_block_tables=tables,
                cpu_step=CpuStepState() if self.cpu_step else None,
            )
        self.input_ids.copy_to_gpu(num_padded)
        # After the host's input ids reach the device: the fill overwrites placeholders.
        placeholders.fill(self.input_ids.gpu, batch, num_sched, cu, computed)
        self.positions.copy_to_gpu(num_padded)
        self.logits_indices.copy_to_gpu(n)
        batch.num_computed_tokens[:n] = seq_lens
        return md, dispatch, num_sched, sampling_rows


def scheduled_per_row(num_scheduled_tokens: dict[str, int], row_ids: list[str]) -> np.ndarray:
    """The scheduled token count of each row (0 where a row's request got none).

    The scheduler's dict lists running requests in admission order, then new ones; so do
    the batch rows until a request leaves and condense moves a row into its hole: while
    both list the same ids in the same order (two C-level list compares), the dict's
    values are the answer; otherwise one lookup per row.
    """
    n = len(row_ids)
    if len(num_scheduled_tokens) == n and list(num_scheduled_tokens) == row_ids:
        return np.fromiter(num_scheduled_tokens.values(), np.int64, n)
    return np.fromiter(map(num_scheduled_tokens.get, row_ids, repeat(0, n)), np.int64, n)
