"""The static batch of `tests/helpers/static_buffers.py` with a step function for tests: a
step writes its inputs into the fixed buffers and pads them to `pad(n)` tokens, using
`tests/helpers/paged.py`'s step arithmetic (one naive loop, shared with the paged
harness)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tests.helpers.static_buffers import Forward
from tests.helpers.static_buffers import StaticBatch as _Buffers
from tests.helpers.paged import step_inputs


class StaticBatch(_Buffers):
    def step(self, chunks: dict[int, list[int]], forward: Forward,
             pad: Callable[[int], int] = lambda n: n) -> torch.Tensor:
        """Feed `chunks` (seq -> new token ids) through `forward`; returns the logits of
        every new token (float32, [total_new_tokens, vocab]), in the order given."""
        st = step_inputs(chunks, self.lens, self.block_table, self.block_size)
        n, num_reqs = len(st.ids), len(st.rows)
        num_padded = pad(n)
        assert num_padded <= self.max_num_tokens
        dev = self.device
        self.input_ids[:n].copy_(torch.tensor(st.ids, device=dev))
        self.input_ids[n:num_padded] = 0
        self.positions[:n].copy_(torch.tensor(st.positions, device=dev))
        self.positions[n:num_padded] = 0
        self.slot_mapping[:n].copy_(torch.tensor(st.slots, device=dev))
        self.slot_mapping[n:num_padded] = -1
        self.table[:num_reqs].copy_(self.block_table[st.rows])
        self.query_start_loc[: num_reqs + 1].copy_(torch.tensor(st.query_start_loc, device=dev))
        self.seq_lens[:num_reqs].copy_(torch.tensor(st.seq_lens, device=dev))
        hidden = self.run(forward, num_padded, num_reqs)
        with torch.inference_mode():
            return self.model.compute_logits(hidden[:n])

