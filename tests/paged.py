"""Run an llmfast model step by step over a paged KV cache, without the engine: the
model-level oracle harness for comparing with HF transformers."""

from __future__ import annotations

import torch

from llmfast.attention_metadata import AttentionMetadata
from llmfast.models.llama import LlamaForCausalLM


class PagedSequences:
    """A few sequences, each owning a shuffled (non-contiguous) set of cache blocks."""

    def __init__(self, model: LlamaForCausalLM, num_seqs: int, max_len: int, block_size: int = 4,
                 seed: int = 0) -> None:
        cfg = model.config
        blocks_per_seq = -(-max_len // block_size)
        num_blocks = 1 + num_seqs * blocks_per_seq  # block 0 reserved
        dtype = next(model.parameters()).dtype
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                       for _ in range(cfg.num_hidden_layers)]
        model.bind_kv_caches(self.caches)
        perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1
        self.block_table = perm.view(num_seqs, blocks_per_seq).to(torch.int32)
        self.block_size = block_size
        self.lens = [0] * num_seqs
        self.model = model

    def step(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """Feed `chunks` (seq index -> new token ids); returns the logits of every new
        token, [total_new_tokens, vocab], in the order given."""
        ids, positions, slots, qsl, seq_lens, rows = [], [], [], [0], [], []
        for seq, tokens in chunks.items():
            start = self.lens[seq]
            for i, tok in enumerate(tokens):
                pos = start + i
                block = int(self.block_table[seq, pos // self.block_size])
                ids.append(tok)
                positions.append(pos)
                slots.append(block * self.block_size + pos % self.block_size)
            self.lens[seq] += len(tokens)
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(self.lens[seq])
            rows.append(seq)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_table=self.block_table[rows],
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), md)
            return self.model.compute_logits(hidden)
