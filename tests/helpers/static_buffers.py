"""Persistent (static-address) input buffers over a paged KV cache, padded to a graph
size: what CUDA-graph replay needs, without the engine. For model-level benchmarks
(scripts/bench_modes.py) and, with a step function on top
(tests/helpers/static_batch.py), the compile and graph tests.

Each sequence owns a shuffled (non-contiguous) set of cache blocks; block 0 stays
reserved, as in the engine. Padding tokens are token 0, position 0 and slot -1 (no KV
write).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmfast.attention.metadata import AttentionMetadata, host_max_query_len
from llmfast.attention.workspaces import AttentionWorkspaces
from llmfast.models.decoder import DecoderForCausalLM

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def shuffled_blocks(model: DecoderForCausalLM, num_seqs: int, max_len: int, block_size: int,
                    seed: int, device: torch.device | str = "cpu"):
    """Zeroed KV caches bound to `model`, and a [num_seqs, blocks_per_seq] int32 block
    table giving each sequence a shuffled (non-contiguous) set of blocks; block 0 stays
    reserved, as in the engine."""
    cfg = model.rank_config  # this rank's KV heads (all of them for one rank)
    dtype = next(model.parameters()).dtype
    blocks_per_seq = -(-max_len // block_size)
    num_blocks = 1 + num_seqs * blocks_per_seq
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, dtype=dtype, device=device),
               torch.zeros(shape, dtype=dtype, device=device))
              for _ in range(cfg.num_hidden_layers)]
    model.bind_kv_caches(caches)
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
    return caches, perm.view(num_seqs, blocks_per_seq).to(torch.int32)


class StaticBatch:
    def __init__(self, model: DecoderForCausalLM, num_seqs: int, max_len: int,
                 max_num_tokens: int, block_size: int = 16, seed: int = 0,
                 table_len: int | None = None) -> None:
        """KV blocks for `max_len` tokens per sequence. `table_len` (> max_len) widens the
        block table to that many tokens, as the engine's is for its max_model_len (the
        attention's split count, fixed in a full CUDA graph, follows the table's width);
        the extra columns point at block 0 and are never read (seq_lens stop short)."""
        param = next(model.parameters())
        device = param.device
        self.caches, table = shuffled_blocks(model, num_seqs, max_len, block_size, seed, device)
        if table_len is not None and table_len > max_len:
            extra = -(-table_len // block_size) - table.shape[1]
            table = torch.cat([table, torch.zeros(num_seqs, extra, dtype=table.dtype)], dim=1)
        # The attention's scratch for these caches, reused across layers and steps.
        self.workspaces = AttentionWorkspaces(k for k, _ in self.caches)
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
        # AttentionMetadata.max_query_len (CPU): set by `run` for each call.
        self.max_query_len = host_max_query_len()

    def run(self, forward: Forward, num_padded: int, num_reqs: int,
            max_query_len: int | None = None) -> torch.Tensor:
        """`forward` over the first `num_padded` tokens and `num_reqs` requests of the
        buffers, as they are filled now; `max_query_len`: the most tokens a request has
        (1: a uniform decode step), else taken as `num_padded`."""
        self.max_query_len[0] = num_padded if max_query_len is None else max_query_len
        md = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_padded],
            block_table=self.table[:num_reqs],
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            max_query_len=self.max_query_len,
        )
        with torch.inference_mode():
            return forward(self.input_ids[:num_padded], self.positions[:num_padded], md)

    def dummy_runner(self, forward: Forward) -> Callable[[int], None]:
        """`run_dummy(n)` for `ModelCudaGraphs.capture`: n padding tokens (slot -1) plus one
        request that reads one context slot, so attention has work but writes nothing."""

        def run_dummy(num_tokens: int) -> None:
            self.input_ids[:num_tokens] = 0
            self.positions[:num_tokens] = 0
            self.slot_mapping[:num_tokens] = -1
            self.table[:1].copy_(self.block_table[:1])
            self.query_start_loc[:2] = torch.tensor([0, 1], dtype=torch.int32)
            self.seq_lens[:1] = 1
            self.run(forward, num_tokens, 1)

        return run_dummy
