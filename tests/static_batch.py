"""A runner-like harness over persistent (static-address) input buffers, padded to a
graph size: what CUDA-graph replay needs, without the engine. Used by the compile and
graph tests and by scripts/bench_modes.py.

Like `tests/paged.py`, each sequence owns a shuffled set of cache blocks (block 0 is
reserved); unlike it, a step writes its inputs into fixed buffers and pads them to
`padded_num_tokens(n)` with token 0, position 0 and slot -1 (no KV write).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmfast.attention_metadata import AttentionMetadata
from llmfast.models.decoder import DecoderForCausalLM
from tests.paged import shuffled_blocks, step_inputs

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


class StaticBatch:
    def __init__(self, model: DecoderForCausalLM, num_seqs: int, max_len: int,
                 max_num_tokens: int, block_size: int = 16, seed: int = 0) -> None:
        param = next(model.parameters())
        device = param.device
        self.caches, table = shuffled_blocks(model, num_seqs, max_len, block_size, seed, device)
        self.block_table = table.to(device)
        self.model = model
        self.device = device
        self.block_size = block_size
        self.max_num_tokens = max_num_tokens
        self.lens = [0] * num_seqs
        # Persistent buffers: their addresses never change (graph inputs).
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.table = torch.zeros_like(self.block_table)
        self.query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(num_seqs, dtype=torch.int32, device=device)

    def _run(self, forward: Forward, num_padded: int, num_reqs: int) -> torch.Tensor:
        md = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_padded],
            block_table=self.table[:num_reqs],
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
        )
        with torch.inference_mode():
            return forward(self.input_ids[:num_padded], self.positions[:num_padded], md)

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
        hidden = self._run(forward, num_padded, num_reqs)
        with torch.inference_mode():
            return self.model.compute_logits(hidden[:n])

    def dummy_runner(self, forward: Forward) -> Callable[[int], None]:
        """`run_dummy(n)` for `CompiledModel.capture`: n padding tokens (slot -1) plus one
        request that reads one context slot, so attention has work but writes nothing."""

        def run_dummy(num_tokens: int) -> None:
            self.input_ids[:num_tokens] = 0
            self.positions[:num_tokens] = 0
            self.slot_mapping[:num_tokens] = -1
            self.table[:1].copy_(self.block_table[:1])
            self.query_start_loc[:2] = torch.tensor([0, 1], dtype=torch.int32)
            self.seq_lens[:1] = 1
            self._run(forward, num_tokens, 1)

        return run_dummy
