"""Start-up compile and CUDA-graph capture on the runner's persistent buffers.

`CaptureInputs` gives `ModelCudaGraphs.capture` what it runs: a dummy forward at a token
count (piecewise graphs) and, for the full graphs, a closure over the buffers' first
`size` rows with the tensors it reads. Replays later read the same buffers, which the
step's input preparation (step_inputs.py) fills.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from llmfast.attention.metadata import AttentionMetadata, host_max_query_len
from llmfast.compile import CompiledModel
from llmfast.cuda_graphs.model_graphs import ModelCudaGraphs
from llmfast.utils.progress import Progress
from llmfast.worker.input_batch import InputBatch
from llmfast.worker.step_inputs import StepInputs

if TYPE_CHECKING:
    from llmfast.models.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)


class CaptureInputs:
    """The dummy runs and full-graph inputs of one runner: its step buffers, its batch's
    block table, its model and compiled model."""

    def __init__(self, inputs: StepInputs, batch: InputBatch, model: DecoderForCausalLM,
                 compiled: CompiledModel) -> None:
        self.inputs = inputs
        self.batch = batch
        self.model = model
        self.compiled = compiled

    def dummy_run(self, num_tokens: int) -> None:
        """One forward at `num_tokens` from the persistent buffers; slot_mapping all -1,
        so nothing is written to the KV cache."""
        # The runner's forward_fn (the compiled model: it is only wrapped later, by
        # profilers of a started engine).
        self.compiled(*self.dummy_batch(num_tokens))

    def dummy_batch(self, num_tokens: int
                    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, metadata) of `dummy_run`'s forward, in the buffers: one
        request of `num_tokens` tokens reading one (null-block) slot."""
        inputs = self.inputs
        slots = self.batch.block_table.slot_mapping.gpu
        inputs.input_ids.gpu[:num_tokens].zero_()
        inputs.positions.gpu[:num_tokens].zero_()
        slots[:num_tokens].fill_(-1)
        inputs.query_start_loc.gpu[0] = 0
        inputs.query_start_loc.gpu[1] = 1
        inputs.seq_lens.gpu[:1].fill_(1)  # one request reading one (null-block) slot
        inputs.max_query_len[0] = num_tokens  # (its tokens: uniform decode only at 1)
        md = AttentionMetadata(slots[:num_tokens], self.batch.block_table.table.gpu[:1],
                               inputs.query_start_loc.gpu[:2], inputs.seq_lens.gpu[:1],
                               inputs.max_query_len)
        return inputs.input_ids.gpu[:num_tokens], inputs.positions.gpu[:num_tokens], md

    def full_inputs(self, size: int, query_len: int = 1) -> list[torch.Tensor]:
        """What a full graph of `size` reads: the persistent buffers' first `size`
        tokens and `size / query_len` request rows, and the KV caches (see
        cuda_graphs/full.py)."""
        inputs = self.inputs
        table = self.batch.block_table
        rows = size // query_len
        caches = [t for layer in self.model.attention_layers()
                  for t in (layer.k_cache, layer.v_cache)]
        return [inputs.input_ids.gpu[:size], inputs.positions.gpu[:size],
                table.slot_mapping.gpu[:size], table.table.gpu[:rows],
                inputs.query_start_loc.gpu[: rows + 1], inputs.seq_lens.gpu[:rows], *caches]

    def full_forward(self, size: int, dummy: bool, query_len: int = 1):
        """(fn, inputs) for a full graph of `size` uniform-decode rows: fn runs the
        compiled forward and lm_head on the buffers (`model_graphs.FullForward`). The
        dummy batch: `size` one-token requests at position 0, slot -1 (nothing written),
        each reading one slot of the block its table row names."""
        inputs = self.full_inputs(size, query_len)
        ids, positions, md = self.full_batch(size, dummy, query_len)
        compiled, model = self.compiled, self.model

        def fn() -> torch.Tensor:
            return model.compute_logits(compiled(ids, positions, md))

        return fn, inputs

    def full_batch(self, size: int, dummy: bool, query_len: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, metadata) a full graph of `size` tokens in rows of
        `query_len` runs on: the buffers' first rows, first filled with the dummy batch
        if `dummy`."""
        ids, positions, slots, table, query_start_loc, seq_lens = \
            self.full_inputs(size, query_len)[:6]
        if dummy:
            ids.zero_()
            positions.zero_()
            slots.fill_(-1)
            query_start_loc.copy_(torch.arange(0, size + 1, query_len, dtype=torch.int32))
            seq_lens.fill_(query_len)
        # A full graph holds a uniform step (query_len tokens a row: 1 for a decode, 1 + K
        # for a verify step): its capture takes the attention kernels such a step takes.
        max_query_len = host_max_query_len(query_len)  # (made in a capture: see there)
        return ids, positions, AttentionMetadata(slots, table, query_start_loc, seq_lens,
                                                 max_query_len)


def compile_and_capture(capture: CaptureInputs, graphs: ModelCudaGraphs,
                        progress: Progress | None, startup_times: dict[str, float]) -> int:
    """Compile (the first call) and capture every CUDA graph, once, on the bound KV
    cache; returns the graphs' device memory in bytes and notes the stages' seconds in
    `startup_times`."""
    compiled = capture.compiled
    if compiled.eager:
        return 0
    if progress:
        progress("compiling" + (" and capturing CUDA graphs" if graphs.enabled else ""),
                 None)
    t0 = time.perf_counter()
    if graphs.enabled:
        graph_bytes = graphs.capture(capture.dummy_run, capture.full_forward)
    else:
        graph_bytes = 0
        with torch.inference_mode():
            capture.dummy_run(min(graphs.max_num_tokens, 8))  # the compile
    stats = compiled.stats
    # The whole first call, not only the backend's share (stats.compile_time_s):
    # Dynamo's tracing of the model comes before the backend and is most of a warm
    # start's compile.
    startup_times["compile"] = time.perf_counter() - t0 - stats.capture_time_s
    if stats.captured_sizes or stats.full_graph_sizes:
        startup_times["capture"] = stats.capture_time_s
    logger.info("compile: %s", stats.summary())
    return graph_bytes
