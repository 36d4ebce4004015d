"""`ModelRunner`: load -> measure memory -> allocate the KV cache -> (compile, capture)
-> `execute()` one scheduler step at a time.

The runner keeps its own per-request state, so each step applies only the
SchedulerOutput's increments, then prepares inputs with vectorised numpy into
persistent buffers and copies each to the device once.

`execute_async` launches a step and returns at once with a `PendingStep`; `collect`
reads its sampled ids later (`execute` does both). Nothing between them waits for the
device: the sampled ids stay there, and the next step's input ids (and penalty token ids)
take a row's not-yet-known last token from them by a device-side gather/scatter, so the
host can prepare step N+1 while the device still runs step N.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from llmfast.attention_metadata import AttentionMetadata
from llmfast.compile import CompiledModel
from llmfast.config import EngineConfig
from llmfast.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from llmfast.distributed import TensorParallelGroup, min_across_ranks
from llmfast.graphs.dispatch import RunnerKind, StepDispatch, is_uniform_decode
from llmfast.kernels.cpu.linear import physical_memory_bytes, prepack_linears
from llmfast.kernels.workspaces import AttentionWorkspaces
from llmfast.models.loader import ModelSource, build_model
from llmfast.profiling.nvtx_ranges import nvtx_range
from llmfast.utils.progress import Progress
from llmfast.worker.buffers import CpuGpuBuffer
from llmfast.worker.input_batch import PLACEHOLDER_TOKEN_ID, CachedRequestState, InputBatch
from llmfast.worker.kv_cache_sizing import (
    available_host_memory,
    check_fits_one_request,
    check_kv_cache_fits_host,
    kv_block_bytes,
    kv_cache_out_of_memory,
    num_cpu_blocks,
    num_gpu_blocks,
)
from llmfast.worker.memory_profile import profile_peak_memory
from llmfast.worker.sampler import Sampler
from llmfast.worker.sampling_metadata import SamplingStaging, build_sampling_metadata
from llmfast.worker.step_output import OutputCopier, PendingStep
from llmfast.worker.tp_sampling import sample_on_first_rank

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource,
                 eos_token_ids: tuple[int, ...] = (), progress: Progress | None = None,
                 tp_group: TensorParallelGroup | None = None) -> None:
        self.config = config
        # This rank's place in tensor parallelism (one rank: no communication).
        self.tp_group = tp_group or TensorParallelGroup.single()
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.eos_token_ids = eos_token_ids
        sched = config.scheduler
        self.max_num_tokens = sched.max_num_batched_tokens
        self.max_num_reqs = sched.max_num_seqs
        self.max_model_len = sched.max_model_len
        self.block_size = config.cache.block_size
        self.startup_times: dict[str, float] = {}

        t0 = time.perf_counter()
        self.model = build_model(source, self.dtype, self.device,
                                 max_positions=self.max_model_len, seed=config.seed,
                                 progress=progress, tp=self.tp_group)
        if self.device.type == "cpu" and config.compile.enforce_eager:
            # A second, blocked copy of the weights: at most a quarter of the RAM.
            ram = physical_memory_bytes()
            prepack_linears(self.model, None if ram is None else ram // 4)
        self.startup_times["load"] = time.perf_counter() - t0
        self.vocab_size = source.config.vocab_size

        def buf(*shape: int, dtype: torch.dtype) -> CpuGpuBuffer:
            return CpuGpuBuffer(*shape, dtype=dtype, device=self.device)

        self.input_ids = buf(self.max_num_tokens, dtype=torch.int64)
        self.positions = buf(self.max_num_tokens, dtype=torch.int64)
        self.query_start_loc = buf(self.max_num_reqs + 1, dtype=torch.int32)
        self.seq_lens = buf(self.max_num_reqs, dtype=torch.int32)
        self.logits_indices = buf(self.max_num_reqs, dtype=torch.int64)
        self._arange = np.arange(max(self.max_num_tokens, self.max_num_reqs) + 1, dtype=np.int64)
        # Placeholder fill: input_ids[dst[i]] = previous step's sampled ids[src[i]].
        self.placeholder_dst = buf(self.max_num_reqs, dtype=torch.int64)
        self.placeholder_src = buf(self.max_num_reqs, dtype=torch.int64)
        self.sampling_staging = SamplingStaging(self.device)
        self.output_copier = OutputCopier(self.max_num_reqs, self.device)
        # The last launched step's sampled ids [num_reqs then], on the device.
        self._prev_sampled: torch.Tensor | None = None
        # CUDA: recorded after a step's host-to-device copies; the next step waits on it
        # before rewriting the pinned buffers those copies read (in steady state they
        # finished long ago: they ran before the previous forward).
        self._inputs_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self._inputs_copy_queued = False
        self.phase_timer = None  # a PhaseTimer while profiling (LLMEngine.set_phase_timer)

        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len,
                                      self.max_num_tokens, self.block_size, self.device)
        self.sampler = Sampler()
        # Eager passthrough under enforce_eager; else piecewise compile (+ CUDA graphs).
        self.compiled = CompiledModel(
            self.model, config.compile, self.device, self.max_num_tokens,
            max_num_reqs=self.max_num_reqs,
            graph_impl="emulated" if config.compile.emulate_cuda_graphs else "auto")
        self.forward_fn = self.compiled
        self.num_blocks = 0

    # ------------------------------------------------------------------ start-up

    def initialize(self, progress: Progress | None = None) -> int:
        """Size and allocate the KV cache, compiling (and on CUDA capturing graphs) on the
        way; returns the number of blocks.

        Order on CUDA: profile the largest forward on a scratch cache -> compile and
        capture on that scratch cache (the piecewise graphs never touch the KV cache, so
        rebinding it later needs no recapture) -> size the KV cache from what is left
        (graph memory of both kinds known) -> capture the full graphs again on the real
        cache (they read it; the dropped ones' pool memory is reused).
        """
        cfg = self.config
        model_cfg = self.model.rank_config  # this rank's KV heads
        captured = False
        if cfg.cache.num_gpu_blocks_override is not None:
            num_blocks = cfg.cache.num_gpu_blocks_override
        elif self.device.type == "cuda":
            t0 = time.perf_counter()
            peak = profile_peak_memory(self.model, self.max_num_tokens, self.max_num_reqs,
                                       self.block_size, self.dtype, self.device)
            self.startup_times["profile"] = time.perf_counter() - t0
            graph_bytes = self._compile_and_capture(progress)
            captured = True
            num_blocks = num_gpu_blocks(cfg.cache, model_cfg, self.dtype, self.device,
                                        peak + graph_bytes)
        else:
            num_blocks = num_cpu_blocks(cfg.cache, model_cfg, self.dtype)
        # Every rank's cache holds the blocks the one scheduler hands out: the fewest.
        num_blocks = min_across_ranks(num_blocks, self.tp_group, self.device)
        t0 = time.perf_counter()
        block_bytes = kv_block_bytes(model_cfg, self.block_size, self.dtype)
        check_fits_one_request(num_blocks, self.block_size, self.max_model_len, block_bytes)
        if progress:
            progress(f"allocating KV cache: {num_blocks} blocks", None)
        shape = (model_cfg.num_hidden_layers, 2, num_blocks, self.block_size,
                 model_cfg.num_key_value_heads, model_cfg.head_dim)
        check_kv_cache_fits_host(num_blocks, block_bytes, self.device, cfg.cache)
        try:
            kv_cache = torch.empty(shape, dtype=self.dtype, device=self.device)
        except (torch.OutOfMemoryError, RuntimeError):  # RuntimeError: the CPU allocator's
            available = (torch.cuda.mem_get_info(self.device)[0]
                         if self.device.type == "cuda" else available_host_memory())
            raise kv_cache_out_of_memory(num_blocks, block_bytes, available, self.device,
                                         cfg.cache) from None
        # fill_ writes every page now: on Linux, reading never-written (calloc'd) pages
        # of a big CPU tensor was measured ~50x slower than reading written ones.
        self.kv_cache = kv_cache.fill_(0)
        self.model.bind_kv_caches([(layer[0], layer[1]) for layer in self.kv_cache])
        # The attention kernels' scratch for this cache: freed with the runner.
        self.attention_workspaces = AttentionWorkspaces([self.kv_cache])
        self.num_blocks = num_blocks
        self.startup_times["kv_cache"] = time.perf_counter() - t0
        if captured and self.compiled.full_graphs is not None:
            # Full graphs read the KV cache: capture them again on the real one.
            self.compiled.recapture_full(self._full_forward)
            self.startup_times["capture"] = self.compiled.stats.capture_time_s
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, self.block_size,
                    num_blocks * block_bytes / 2**20)
        if not captured:
            self._compile_and_capture(progress)
        return num_blocks

    def _compile_and_capture(self, progress: Progress | None) -> int:
        if self.config.compile.enforce_eager:
            return 0
        if progress:
            progress("compiling" + (" and capturing CUDA graphs"
                                    if self.compiled.capture_sizes else ""), None)
        t0 = time.perf_counter()
        graph_bytes = self.compiled.capture(self._dummy_run, self._full_forward)
        stats = self.compiled.stats
        # The whole first call, not only the backend's share (stats.compile_time_s):
        # Dynamo's tracing of the model comes before the backend and is most of a warm
        # start's compile.
        self.startup_times["compile"] = time.perf_counter() - t0 - stats.capture_time_s
        if stats.captured_sizes or stats.full_graph_sizes:
            self.startup_times["capture"] = stats.capture_time_s
        logger.info("compile: %s", stats.summary())
        return graph_bytes

    def _dummy_run(self, num_tokens: int) -> None:
        """One forward at `num_tokens` from the persistent buffers; slot_mapping all -1,
        so nothing is written to the KV cache."""
        slots = self.input_batch.block_table.slot_mapping.gpu
        self.input_ids.gpu[:num_tokens].zero_()
        self.positions.gpu[:num_tokens].zero_()
        slots[:num_tokens].fill_(-1)
        self.query_start_loc.gpu[0] = 0
        self.query_start_loc.gpu[1] = 1
        self.seq_lens.gpu[:1].fill_(1)  # one request reading one (null-block) slot
        md = AttentionMetadata(slots[:num_tokens], self.input_batch.block_table.table.gpu[:1],
                               self.query_start_loc.gpu[:2], self.seq_lens.gpu[:1])
        self.forward_fn(self.input_ids.gpu[:num_tokens], self.positions.gpu[:num_tokens], md)

    def _full_inputs(self, size: int) -> list[torch.Tensor]:
        """What a full graph of `size` reads: the persistent buffers' first `size`
        tokens / request rows and the KV caches (see graphs/full.py)."""
        table = self.input_batch.block_table
        caches = [t for layer in self.model.attention_layers()
                  for t in (layer.k_cache, layer.v_cache)]
        return [self.input_ids.gpu[:size], self.positions.gpu[:size],
                table.slot_mapping.gpu[:size], table.table.gpu[:size],
                self.query_start_loc.gpu[: size + 1], self.seq_lens.gpu[:size], *caches]

    def _full_forward(self, size: int, dummy: bool):
        """(fn, inputs) for a full graph of `size` uniform-decode rows: fn runs the
        compiled forward and lm_head on the buffers (`CompiledModel.FullForward`). The
        dummy batch: `size` one-token requests at position 0, slot -1 (nothing written),
        each reading one slot of the block its table row names."""
        inputs = self._full_inputs(size)
        ids, positions, slots, table, query_start_loc, seq_lens = inputs[:6]
        if dummy:
            ids.zero_()
            positions.zero_()
            slots.fill_(-1)
            query_start_loc.copy_(torch.arange(size + 1, dtype=torch.int32))
            seq_lens.fill_(1)
        md = AttentionMetadata(slots, table, query_start_loc, seq_lens)
        compiled, model = self.compiled, self.model

        def fn() -> torch.Tensor:
            return model.compute_logits(compiled(ids, positions, md))

        return fn, inputs

    # ------------------------------------------------------------------ per step

    def _update_states(self, out: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        cached = out.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            state = self.requests[req_id]
            state.block_ids.extend(new_blocks)
            state.num_computed_tokens = num_computed
            row = batch.req_id_to_index[req_id]
            batch.block_table.append_row(row, new_blocks)
            batch.num_computed_tokens[row] = num_computed
        for new in out.scheduled_new_reqs:
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
            self.requests[new.req_id] = state
            batch.add_request(state)
        batch.condense()

    def _prepare_inputs(
        self, out: SchedulerOutput
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
        batch = self.input_batch
        n = batch.num_reqs
        num_sched = np.fromiter(
            (out.num_scheduled_tokens.get(r, 0) for r in batch.req_ids[:n]), np.int64, n)
        cu = np.cumsum(num_sched)
        num_tokens = int(cu[-1])
        dispatch = self.compiled.dispatcher.dispatch(num_tokens, n, is_uniform_decode(num_sched))
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

        md = AttentionMetadata(
            slot_mapping=batch.block_table.slot_mapping.copy_to_gpu(num_padded),
            # Rows n.. of a full graph's table are not copied: no program reads them.
            block_table=batch.block_table.table.gpu[:num_rows],
            query_start_loc=self.query_start_loc.copy_to_gpu(num_rows + 1),
            seq_lens=self.seq_lens.copy_to_gpu(num_rows),
        )
        batch.block_table.table.copy_to_gpu(n)
        self.input_ids.copy_to_gpu(num_padded)
        self._fill_placeholders(num_sched, cu, computed)
        self.positions.copy_to_gpu(num_padded)
        self.logits_indices.copy_to_gpu(n)
        batch.num_computed_tokens[:n] = seq_lens
        return md, dispatch, num_sched, sampling_rows

    def _fill_placeholders(self, num_sched: np.ndarray, cu: np.ndarray,
                           computed: np.ndarray) -> None:
        """On the device, write the previous step's sampled ids into this step's input ids
        where a row computes its placeholder (the host holds PLACEHOLDER_TOKEN_ID there).

        Worked example: num_scheduled [1, 3, 1], num_computed [9, 0, 4], num_tokens
        [10, 20, 5] (placeholders at columns 9 and 4 of rows 0 and 2), pending_src
        [2, -1, 0]: rows 0 and 2 compute their last token, at token index
        (cu - num_sched) + column - num_computed = [0 + 9 - 9, 4 + 4 - 4] = [0, 4], so
        input_ids[[0, 4]] = prev_sampled[[2, 0]].
        """
        batch = self.input_batch
        n = len(num_sched)
        pending = batch.pending_src[:n]
        rows = np.flatnonzero((pending >= 0) & (num_sched > 0))
        if not len(rows) or self._prev_sampled is None:
            return
        cols = batch.num_tokens[rows].astype(np.int64) - 1
        offset = cols - computed[rows]
        if ((offset < 0) | (offset >= num_sched[rows])).any():
            raise RuntimeError("a placeholder outside its row's scheduled tokens")
        k = len(rows)
        self.placeholder_dst.np[:k] = (cu - num_sched)[rows] + offset
        self.placeholder_src.np[:k] = pending[rows]
        self.input_ids.gpu.index_copy_(
            0, self.placeholder_dst.copy_to_gpu(k),
            self._prev_sampled.index_select(0, self.placeholder_src.copy_to_gpu(k)))

    def padded_num_tokens(self, num_tokens: int, uniform_decode: bool = False) -> int:
        """The token count the step runs at (CUDA-graph sizes pad; eager does not)."""
        return self.compiled.padded_num_tokens(num_tokens, uniform_decode)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled ids (the synchronous loop)."""
        pending = self.execute_async(out)
        if pending is None:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        return self.collect(pending)

    @torch.inference_mode()
    def execute_async(self, out: SchedulerOutput) -> PendingStep | None:
        """Apply `out`, launch its forward and sampler, queue the copy of the sampled ids
        to the host; None if nothing was scheduled. Never waits for the device, except
        (CUDA) for the previous step's input copies, before rewriting their sources."""
        with nvtx_range("prepare_inputs", self.phase_timer):
            if self._inputs_copy_queued:
                self._inputs_copied.synchronize()
                self._inputs_copy_queued = False
            self._update_states(out)
            batch = self.input_batch
            n = batch.num_reqs
            if out.total_num_scheduled_tokens == 0 or n == 0:
                return None
            md, dispatch, num_sched, sampling_rows = self._prepare_inputs(out)
            num_padded = dispatch.descriptor.num_tokens
            metadata = build_sampling_metadata(batch, n, self.vocab_size, self.eos_token_ids,
                                               self.sampling_staging, self._prev_sampled)
            if self._inputs_copied is not None:
                self._inputs_copied.record()
                self._inputs_copy_queued = True
            step = self._record_placeholders(num_sched, sampling_rows,
                                             metadata.max_num_logprobs is not None)
        if dispatch.runner is RunnerKind.FULL:
            # One token per row, in row order: the graph's logits rows are the rows'.
            with nvtx_range(f"forward[{num_padded} full graph]", self.phase_timer):
                logits = self.compiled.replay_full(num_padded,
                                                   self._full_inputs(num_padded))[:n]
        else:
            with nvtx_range(f"forward[{num_padded}]", self.phase_timer):
                hidden = self.forward_fn(
                    self.input_ids.gpu[:num_padded], self.positions.gpu[:num_padded], md)
            logits = None
        with nvtx_range("sample", self.phase_timer):
            if logits is None:
                logits = self.model.compute_logits(hidden[self.logits_indices.gpu[:n]])
            sampler_out = (self.sampler(logits, metadata) if self.tp_group.world_size == 1
                           else sample_on_first_rank(self.sampler, logits, metadata,
                                                     self.tp_group))
            sampled = sampler_out.sampled_token_ids  # [n], stays on the device
            self._prev_sampled = sampled
            step["sampled_host"], step["logprobs_host"], step["event"] = \
                self.output_copier.copy(sampled, sampler_out.logprobs)
        return PendingStep(sampled_device=sampled, **step)

    def _record_placeholders(self, num_sched: np.ndarray, sampling_rows: np.ndarray,
                             want_logprobs: bool) -> dict:
        """Give each sampling row a placeholder token (value unknown until collected) and
        note what `collect` needs to read this step's outputs."""
        batch = self.input_batch
        n = len(num_sched)
        rows = np.flatnonzero(num_sched > 0)
        rows_list = rows.tolist()
        samples = np.zeros(n, dtype=bool)
        samples[sampling_rows] = True
        cols = batch.num_tokens[sampling_rows]
        batch.token_ids[sampling_rows, cols] = PLACEHOLDER_TOKEN_ID
        batch.num_tokens[sampling_rows] = cols + 1
        batch.pending_src[:n] = -1
        batch.pending_src[sampling_rows] = sampling_rows
        req_ids = [batch.req_ids[r] for r in rows_list]
        params = batch.sampling_params
        return {
            "req_ids": req_ids,
            "samples": samples[rows].tolist(),
            "rows": rows_list,
            "sampling_states": [self.requests[batch.req_ids[r]]
                                for r in sampling_rows.tolist()],
            "placeholder_cols": cols.tolist(),
            "num_logprobs": [params[r].logprobs for r in rows_list] if want_logprobs else None,
        }

    def collect(self, step: PendingStep) -> ModelRunnerOutput:
        """Wait for a launched step's sampled ids; write them into the batch rows that
        still hold their placeholders; return them per scheduled request."""
        sampled = step.wait().tolist()
        requests = self.requests
        batch = self.input_batch
        index, token_ids = batch.req_id_to_index, batch.token_ids
        sampling_rows = [r for r, s in zip(step.rows, step.samples) if s]
        for state, col, r in zip(step.sampling_states, step.placeholder_cols, sampling_rows):
            if requests.get(state.req_id) is state:  # still here, not a reused id
                token_ids[index[state.req_id], col] = sampled[r]
        tokens = [[sampled[r]] if s else [] for r, s in zip(step.rows, step.samples)]
        logprobs = None
        if step.logprobs_host is not None:
            logprobs = self._collect_logprobs(step)
        return ModelRunnerOutput(req_ids=step.req_ids, sampled_token_ids=tokens,
                                 logprobs=logprobs)

    @staticmethod
    def _collect_logprobs(step: PendingStep):
        lp = step.logprobs_host
        sampled_lp = lp.sampled_logprobs.numpy()
        top_ids, top_lps = lp.topk_ids.numpy(), lp.topk_logprobs.numpy()
        result: list[list[tuple[float, dict[int, float]]]] = []
        for r, sampled_here, want in zip(step.rows, step.samples, step.num_logprobs):
            if not sampled_here or want is None:
                result.append([])
                continue
            top = {int(i): float(v) for i, v in zip(top_ids[r, :want], top_lps[r, :want])}
            result.append([(float(sampled_lp[r]), top)])
        return result
