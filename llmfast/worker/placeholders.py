"""Placeholders: a sampled token whose value is still on the device (async scheduling).

A step that samples for a row appends `PLACEHOLDER_TOKEN_ID` to the row's tokens on the
host (`record_placeholders`) and keeps its sampled ids on the device. When a later step
computes that token, `PlaceholderFill.fill` writes the value into the step's input ids
by a device-side gather/scatter, so the host never waits for it. Once the step is
collected, `write_sampled_tokens` puts the values into the host rows.
"""

from __future__ import annotations

import numpy as np
import torch

from llmfast.worker.buffers import CpuGpuBuffer
from llmfast.worker.input_batch import PLACEHOLDER_TOKEN_ID, CachedRequestState, InputBatch
from llmfast.worker.step_output import PendingStep


class PlaceholderFill:
    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        # Placeholder fill: input_ids[dst[i]] = previous step's sampled ids[src[i]].
        self.placeholder_dst = CpuGpuBuffer(max_num_reqs, dtype=torch.int64, device=device)
        self.placeholder_src = CpuGpuBuffer(max_num_reqs, dtype=torch.int64, device=device)
        # The last launched step's sampled ids [num_reqs then], on the device.
        self.prev_sampled: torch.Tensor | None = None

    def fill(self, input_ids: torch.Tensor, batch: InputBatch, num_sched: np.ndarray,
             cu: np.ndarray, computed: np.ndarray) -> None:
        """On the device, write the previous step's sampled ids into this step's input ids
        (`input_ids`, the device buffer) where a row computes its placeholder (the host
        holds PLACEHOLDER_TOKEN_ID there).

        Worked example: num_scheduled [1, 3, 1], num_computed [9, 0, 4], num_tokens
        [10, 20, 5] (placeholders at columns 9 and 4 of rows 0 and 2), pending_src
        [2, -1, 0]: rows 0 and 2 compute their last token, at token index
        (cu - num_sched) + column - num_computed = [0 + 9 - 9, 4 + 4 - 4] = [0, 4], so
        input_ids[[0, 4]] = prev_sampled[[2, 0]].
        """
        n = len(num_sched)
        pending = batch.pending_src[:n]
        rows = np.flatnonzero((pending >= 0) & (num_sched > 0))
        if not len(rows) or self.prev_sampled is None:
            return
        cols = batch.num_tokens[rows].astype(np.int64) - 1
        offset = cols - computed[rows]
        if ((offset < 0) | (offset >= num_sched[rows])).any():
            raise RuntimeError("a placeholder outside its row's scheduled tokens")
        k = len(rows)
        self.placeholder_dst.np[:k] = (cu - num_sched)[rows] + offset
        self.placeholder_src.np[:k] = pending[rows]
        input_ids.index_copy_(
            0, self.placeholder_dst.copy_to_gpu(k),
            self.prev_sampled.index_select(0, self.placeholder_src.copy_to_gpu(k)))


def record_placeholders(batch: InputBatch, requests: dict[str, CachedRequestState],
                        num_sched: np.ndarray, sampling_rows: np.ndarray,
                        want_logprobs: bool) -> dict:
    """Give each sampling row a placeholder token (value unknown until collected) and
    note what `collect` needs to read this step's outputs (`PendingStep`'s fields but the
    copy's)."""
    n = len(num_sched)
    rows = np.flatnonzero(num_sched > 0)
    cols = batch.num_tokens[sampling_rows]
    batch.token_ids[sampling_rows, cols] = PLACEHOLDER_TOKEN_ID
    batch.num_tokens[sampling_rows] = cols + 1
    batch.pending_src[:n] = -1
    batch.pending_src[sampling_rows] = sampling_rows
    row_ids = batch.req_ids
    num_sampling = len(sampling_rows)
    if len(rows) == n:  # every row runs (a decode step): no per-row lookups
        rows_list = list(range(n))
        req_ids = row_ids[:n]
    else:
        rows_list = rows.tolist()
        req_ids = [row_ids[r] for r in rows_list]
    if num_sampling == n:  # every row samples: the same rows, in the same order
        sampling_ids = req_ids
        samples = [True] * len(rows_list)
    else:
        sampling_ids = [row_ids[r] for r in sampling_rows.tolist()]
        samples = np.zeros(n, dtype=bool)
        samples[sampling_rows] = True
        samples = samples[rows].tolist()
    params = batch.sampling_params
    return {
        "req_ids": req_ids,
        "samples": samples,
        "rows": rows_list,
        "sampling_states": list(map(requests.__getitem__, sampling_ids)),
        "sampling_rows": sampling_rows,
        "placeholder_cols": cols,
        "num_logprobs": [params[r].logprobs for r in rows_list] if want_logprobs else None,
        "batch_version": batch.version,
    }


def write_sampled_tokens(step: PendingStep, sampled: np.ndarray,
                         requests: dict[str, CachedRequestState], batch: InputBatch) -> None:
    """Write a collected step's sampled ids (`sampled`, per row at launch) into the batch
    rows that still hold their placeholders (one fancy assignment)."""
    states = step.sampling_states
    if not states:
        return
    cols, launch_rows = step.placeholder_cols, step.sampling_rows
    if step.batch_version == batch.version:
        # No request joined, left or moved since the launch (the synchronous loop, and
        # the pipelined one while the batch holds): every state is live, in its row.
        batch.token_ids[launch_rows, cols] = sampled[launch_rows]
        return
    get, index = requests.get, batch.req_id_to_index
    # Still here, not a reused id: the same state object.
    live = [get(state.req_id) is state for state in states]
    if not all(live):
        keep = np.flatnonzero(live)
        states = [states[i] for i in keep.tolist()]
        cols, launch_rows = cols[keep], launch_rows[keep]
    # The rows now (condense may have moved them since the launch).
    rows = np.fromiter([index[state.req_id] for state in states], np.int64, len(states))
    batch.token_ids[rows, cols] = sampled[launch_rows]
