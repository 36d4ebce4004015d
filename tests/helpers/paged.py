"""Run an llmfast model step by step over a paged KV cache, without the engine: the
model-level oracle harness for comparing with HF transformers. The block layout
(`shuffled_blocks`) is the static batch's; `tests/helpers/static_batch.py` shares the step
arithmetic (`step_inputs`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmfast.attention.cpu_step import CpuStepState
from llmfast.attention.metadata import AttentionMetadata
from tests.helpers.static_buffers import shuffled_blocks
from llmfast.attention.workspaces import AttentionWorkspaces
from llmfast.models.decoder import DecoderForCausalLM


@dataclass
class StepInputs:
    ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # block-table row of each request


def step_inputs(chunks: dict[int, list[int]], lens: list[int], block_table: torch.Tensor,
                block_size: int) -> StepInputs:
    """The flat inputs of one step feeding `chunks` (seq -> new token ids), one token at
    a time (a plain loop, independent of the engine's vectorised index maths). Advances
    `lens`.

    Worked example, block_size 4, seq 0 owns blocks [7, 2], lens[0] = 3, chunk [a, b]:
    positions 3, 4; slots 7*4 + 3 = 31 and 2*4 + 0 = 8; seq_lens [5]."""
    step = StepInputs()
    for seq, tokens in chunks.items():
        start = lens[seq]
        for i, tok in enumerate(tokens):
            pos = start + i
            block = int(block_table[seq, pos // block_size])
            step.ids.append(tok)
            step.positions.append(pos)
            step.slots.append(block * block_size + pos % block_size)
        lens[seq] += len(tokens)
        step.query_start_loc.append(step.query_start_loc[-1] + len(tokens))
        step.seq_lens.append(lens[seq])
        step.rows.append(seq)
    return step


class PagedSequences:
    """A few sequences, each owning a shuffled (non-contiguous) set of cache blocks."""

    def __init__(self, model: DecoderForCausalLM, num_seqs: int, max_len: int, block_size: int = 4,
                 seed: int = 0, device: torch.device | str = "cpu", forward=None,
                 cpu_step: bool = False) -> None:
        """`forward`: called instead of `model` (e.g. its `CompiledModel`). `cpu_step`: each
        step's metadata carries a fresh `CpuStepState`, as the runner's does on the CPU."""
        self.cpu_step = cpu_step
        self.caches, self.block_table = shuffled_blocks(model, num_seqs, max_len, block_size, seed,
                                                        device)
        self.device = device
        self.workspaces = AttentionWorkspaces(k for k, _ in self.caches)  # as a runner's
        self.block_size = block_size
        self.lens = [0] * num_seqs
        self.model = model
        self.forward = forward  # None: self.model

    def step(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        """Feed `chunks` (seq index -> new token ids); returns the logits of every new
        token, [total_new_tokens, vocab], in the order given."""
        s = step_inputs(chunks, self.lens, self.block_table, self.block_size)
        dev = self.device
        slots = torch.tensor(s.slots, dtype=torch.int64, device=dev)
        table = self.block_table[s.rows].to(dev)
        # A model with several KV-cache groups: every group's layers read the same
        # blocks here (each layer has a cache of its own).
        groups = getattr(self.model, "kv_groups", None)  # (a wrapper has none: one group)
        num_groups = 1 if groups is None else groups.num_groups
        md = AttentionMetadata(
            slot_mapping=slots,
            block_table=table,
            query_start_loc=torch.tensor(s.query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(s.seq_lens, dtype=torch.int32, device=dev),
            group_slot_mappings=(slots,) * num_groups if num_groups > 1 else None,
            group_block_tables=(table,) * num_groups if num_groups > 1 else None,
            cpu_step=CpuStepState() if self.cpu_step else None,
        )
        with torch.inference_mode():
            ids = torch.tensor(s.ids, device=dev)
            hidden = (self.forward or self.model)(ids, torch.tensor(s.positions, device=dev), md)
            return self.model.compute_logits(hidden)


# A step sequence over 4 sequences (seq -> new token ids) of 1, 2, 3, 7, 16 and 33
# tokens: decodes, a new prompt, chunks and mixes of both.
MIXED_STEPS = [
    {0: [5]},
    {0: [6], 1: [9]},
    {0: [7], 1: [10], 2: [3]},
    {0: [8], 1: [11], 2: [4, 5, 6, 7, 8]},
    {3: list(range(20, 33)), 0: [9], 1: [12], 2: [9]},
    {0: list(range(40, 60)), 1: [13], 2: [10], 3: list(range(60, 71))},
]
