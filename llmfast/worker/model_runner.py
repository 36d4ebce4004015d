"""`ModelRunner`: load -> measure memory -> allocate the KV cache -> (compile, capture)
-> `execute()` one scheduler step at a time.

The runner keeps its own per-request state, so each step applies only the
SchedulerOutput's increments, then prepares inputs with vectorised numpy into
persistent buffers and copies each to the device once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from llmfast.attention_metadata import AttentionMetadata
from llmfast.graphs.dispatch import RunnerKind, StepDispatch, is_uniform_decode
from llmfast.worker.buffers import CpuGpuBuffer
from llmfast.compile import CompiledModel
from llmfast.config import EngineConfig
from llmfast.worker.input_batch import CachedRequestState, InputBatch
from llmfast.kernels.cpu_linear import physical_memory_bytes, prepack_linears
from llmfast.worker.kv_cache_sizing import (
    available_host_memory,
    check_fits_one_request,
    check_kv_cache_fits_host,
    kv_block_bytes,
    kv_cache_out_of_memory,
    num_cpu_blocks,
    num_gpu_blocks,
)
from llmfast.models.loader import ModelSource, build_model
from llmfast.nvtx_ranges import nvtx_range
from llmfast.worker.sampler import Sampler
from llmfast.worker.sampling_metadata import build_sampling_metadata
from llmfast.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

Progress = Callable[[str, float | None], None]


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource,
                 eos_token_ids: tuple[int, ...] = (), progress: Progress | None = None) -> None:
        self.config = config
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
                                 progress=progress)
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
        model_cfg = self.model.config
        captured = False
        if cfg.cache.num_gpu_blocks_override is not None:
            num_blocks = cfg.cache.num_gpu_blocks_override
        elif self.device.type == "cuda":
            t0 = time.perf_counter()
            peak = self._profile_peak_memory()
            self.startup_times["profile"] = time.perf_counter() - t0
            graph_bytes = self._compile_and_capture(progress)
            captured = True
            num_blocks = num_gpu_blocks(cfg.cache, model_cfg, self.dtype, self.device,
                                        peak + graph_bytes)
        else:
            num_blocks = num_cpu_blocks(cfg.cache, model_cfg, self.dtype)
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

    def _profile_peak_memory(self) -> int:
        """Run the largest forward once on a throwaway cache; return peak bytes in use."""
        cfg = self.model.config
        num_tokens = self.max_num_tokens
        num_reqs = min(self.max_num_reqs, num_tokens)
        tokens_per_req = -(-num_tokens // num_reqs)  # ceil
        blocks_per_req = -(-tokens_per_req // self.block_size)
        num_blocks = num_reqs * blocks_per_req + 1
        shape = (num_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        scratch = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                    torch.zeros(shape, dtype=self.dtype, device=self.device))
                   for _ in range(cfg.num_hidden_layers)]
        self.model.bind_kv_caches(scratch)
        torch.cuda.reset_peak_memory_stats(self.device)
        per_req = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
        per_req[: num_tokens % num_reqs] += 1
        cu = np.concatenate([[0], np.cumsum(per_req)])
        req_idx = np.repeat(np.arange(num_reqs), per_req)
        positions = np.arange(num_tokens) - cu[req_idx]
        table = torch.arange(1, num_blocks, dtype=torch.int32, device=self.device)
        md = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            block_table=table.view(num_reqs, blocks_per_req),
            query_start_loc=torch.tensor(cu, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(per_req, dtype=torch.int32, device=self.device),
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, torch.tensor(positions, device=self.device), md)
            self.model.compute_logits(hidden[: self.max_num_reqs])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - sum(
            2 * k.numel() * k.element_size() for k, _ in scratch)
        # The model still holds the scratch caches: bind one-block ones instead (the
        # capture's dummy forwards read block 0 alone), so that the scratch memory is
        # free again before the real cache is sized and allocated beside it.
        one_block = (1, *shape[1:])
        self.model.bind_kv_caches(
            [(torch.zeros(one_block, dtype=self.dtype, device=self.device),
              torch.zeros(one_block, dtype=self.dtype, device=self.device))
             for _ in range(cfg.num_hidden_layers)])
        del scratch
        torch.cuda.empty_cache()
        return peak

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
        step = self.compiled.dispatcher.dispatch(num_tokens, n, is_uniform_decode(num_sched))
        num_padded, num_rows = step.descriptor.num_tokens, step.num_reqs
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
        self.positions.copy_to_gpu(num_padded)
        self.logits_indices.copy_to_gpu(n)
        batch.num_computed_tokens[:n] = seq_lens
        return md, step, num_sched, sampling_rows

    def padded_num_tokens(self, num_tokens: int, uniform_decode: bool = False) -> int:
        """The token count the step runs at (CUDA-graph sizes pad; eager does not)."""
        return self.compiled.padded_num_tokens(num_tokens, uniform_decode)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        with nvtx_range("prepare_inputs"):
            self._update_states(out)
            batch = self.input_batch
            n = batch.num_reqs
            if out.total_num_scheduled_tokens == 0 or n == 0:
                return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
            md, step, num_sched, sampling_rows = self._prepare_inputs(out)
            num_padded = step.descriptor.num_tokens
        if step.runner is RunnerKind.FULL:
            # One token per row, in row order: the graph's logits rows are the rows'.
            with nvtx_range(f"forward[{num_padded} full graph]"):
                logits = self.compiled.replay_full(num_padded,
                                                   self._full_inputs(num_padded))[:n]
        else:
            with nvtx_range(f"forward[{num_padded}]"):
                hidden = self.forward_fn(
                    self.input_ids.gpu[:num_padded], self.positions.gpu[:num_padded], md)
            logits = None
        with nvtx_range("sample"):
            if logits is None:
                logits = self.model.compute_logits(hidden[self.logits_indices.gpu[:n]])
            metadata = build_sampling_metadata(batch, n, self.vocab_size, self.eos_token_ids)
            sampler_out = self.sampler(logits, metadata)
            sampled = sampler_out.sampled_token_ids.cpu().numpy()  # the step's one sync
        return self._collect(out, sampled, sampler_out, num_sched, sampling_rows)

    def _collect(self, out: SchedulerOutput, sampled: np.ndarray, sampler_out,
                 num_sched: np.ndarray, sampling_rows: np.ndarray) -> ModelRunnerOutput:
        batch = self.input_batch
        n = batch.num_reqs
        # Append each sampling row's token to its row of the batch, vectorised.
        if len(sampling_rows):
            counts = batch.num_tokens[sampling_rows]
            batch.token_ids[sampling_rows, counts] = sampled[sampling_rows]
            batch.num_tokens[sampling_rows] = counts + 1
        samples = np.zeros(n, dtype=bool)
        samples[sampling_rows] = True
        sampled_list, samples_list = sampled.tolist(), samples.tolist()
        rows = np.flatnonzero(num_sched > 0).tolist()  # rows scheduled this step
        req_ids = [batch.req_ids[r] for r in rows]
        tokens = [[sampled_list[r]] if samples_list[r] else [] for r in rows]
        logprobs = None
        if sampler_out.logprobs is not None:
            logprobs = self._collect_logprobs(sampler_out.logprobs, rows, samples_list)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=tokens, logprobs=logprobs)

    def _collect_logprobs(self, lp, rows: list[int], samples: list[bool]):
        sampled_lp = lp.sampled_logprobs.cpu().numpy()
        top_ids, top_lps = lp.topk_ids.cpu().numpy(), lp.topk_logprobs.cpu().numpy()
        result: list[list[tuple[float, dict[int, float]]]] = []
        for r in rows:
            want = self.input_batch.sampling_params[r].logprobs
            if not samples[r] or want is None:
                result.append([])
                continue
            top = {int(i): float(v) for i, v in zip(top_ids[r, :want], top_lps[r, :want])}
            result.append([(float(sampled_lp[r]), top)])
        return result
