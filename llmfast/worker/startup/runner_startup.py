"""The model runner's start-up stages, in `initialize`'s order: the prefill tiles tuned,
the projections routed (--gemv; a draft model's too), the Triton variants compiled in threads, the KV cache
sized (from a profile on CUDA, from the config elsewhere) and allocated, the model
compiled and its CUDA graphs captured.
The stages themselves live beside this module; this is their order and bookkeeping.

`RunnerStartup` is a base of ModelRunner (worker/model_runner.py): it reads the runner's
model, buffers, graphs and config, and sets its `kv_cache`, `attention_workspaces`,
`num_blocks` and `triton_variants`.
"""

from __future__ import annotations

import logging
import time

from llmfast.attention.triton.launch import tune_model_prefill_tiles
from llmfast.attention.workspaces import AttentionWorkspaces, arrivals_bound
from llmfast.config import dtype_name
from llmfast.distributed import min_across_ranks
from llmfast.kernels.launch.compile_watch import TritonCompileWatch
from llmfast.kernels.launch.precompile import kernel_precompile_enabled
from llmfast.worker.startup.gemv_routing import EVERY_GEMV_ROWS, decode_rows, route_gemv
from llmfast.utils.progress import Progress
from llmfast.worker.startup.graph_capture import compile_and_capture
from llmfast.worker.startup.graph_memory import estimate_graph_memory
from llmfast.worker.startup.kernel_precompile import DryBatch, dry_batches, precompile_kernels
from llmfast.worker.startup.kv_cache_sizing import (
    allocate_kv_cache,
    check_fits_one_request,
    kv_block_bytes,
    num_cpu_blocks,
    num_gpu_blocks,
)
from llmfast.worker.startup.memory_profile import profile_peak_memory

logger = logging.getLogger(__name__)


class RunnerStartup:
    """ModelRunner's start-up (see the module doc)."""

    def initialize(self, progress: Progress | None = None) -> int:
        """Size and allocate the KV cache, compiling (and on CUDA capturing graphs) on the
        way; returns the number of blocks.

        Order on CUDA: tune the prefill attention tiles no table knows yet -> route the
        projections to the GEMV or cuBLAS (worker/startup/gemv_routing.py) -> compile
        the Triton variants the rest will launch, in threads (dry forwards) -> profile
        the largest step on a scratch cache, and estimate what the CUDA graphs will take
        (startup/graph_memory.py) -> size the KV cache from what is left and allocate it
        -> compile the model and capture every CUDA graph once, on the real cache (the
        full graphs read it). Elsewhere: size (from the config), allocate, compile.
        """
        model_cfg = self.model.rank_config  # this rank's KV heads
        t0 = time.perf_counter()
        group = model_cfg.num_attention_heads // model_cfg.num_key_value_heads
        if tune_model_prefill_tiles(self.device, model_cfg.head_dim, group, self.dtype,
                                    progress, kv_dtype=self.kv_dtype):  # CUDA only
            self.startup_times["tune"] = time.perf_counter() - t0
        # Which projections take the GEMV (--gemv auto times what no table knows, CUDA).
        t0 = time.perf_counter()
        target_rows = decode_rows(self.config.compile)
        routing = route_gemv(self.model, self.config.gemv, target_rows, progress)
        measured = routing.measured
        draft = self.spec.proposer.model if self.spec is not None else None
        if draft is not None:  # --speculative-method draft: its model routed alike
            measured += route_gemv(draft, self.config.gemv, EVERY_GEMV_ROWS, progress).measured
        if measured:  # (timed now, or read from the file of an earlier start)
            self.startup_times["gemv"] = time.perf_counter() - t0
        # The Triton variants the rest launches, compiled in threads now (the tiles are
        # known); what it still compiles at a launch is counted.
        if not self._precompiles_kernels():
            return self._size_and_capture(progress)
        t0 = time.perf_counter()
        if progress:
            progress("compiling the attention and layer kernels", None)
        failed = False
        try:
            gemv = [(self.model, target_rows)]
            if draft is not None:
                gemv.append((draft, EVERY_GEMV_ROWS))
            precompiled = precompile_kernels(self.model, self._dry_batches(), self.block_size,
                                             self.kv_dtype, self.device, gemv)
        except Exception as exc:  # noqa: BLE001 - an optimisation: the launches compile
            # Nothing is lost: each variant compiles at its first launch, as without the
            # precompile (counted below, so the start-up report shows the failure).
            logger.warning("compiling the Triton kernels ahead of their launches failed "
                           "(%s: %s); each compiles at its first launch instead "
                           "(LLMFAST_KERNEL_PRECOMPILE=0 skips the attempt)",
                           type(exc).__name__, exc, exc_info=logger.isEnabledFor(logging.DEBUG))
            precompiled, failed = 0, True
        self.startup_times["precompile"] = time.perf_counter() - t0
        if precompiled is None:  # a Triton without asynchronous compiles
            return self._size_and_capture(progress)
        with TritonCompileWatch() as watch:
            num_blocks = self._size_and_capture(progress)
        self.triton_variants = {"precompiled": precompiled,
                                "compiled_at_launch": len(watch.compiles)}
        if failed:
            self.triton_variants["precompile_failed"] = 1
        logger.info("Triton variants: %d compiled in threads, %d more at their launch%s",
                    precompiled, len(watch.compiles),
                    f" ({', '.join(c.name for c in watch.compiles)})" if watch.compiles else "")
        return num_blocks

    def _size_and_capture(self, progress: Progress | None) -> int:
        """`initialize` after the prefill tiles are tuned (see there)."""
        cfg = self.config
        model_cfg = self.model.rank_config
        graph_reserve = None
        if cfg.cache.num_gpu_blocks_override is not None:
            num_blocks = cfg.cache.num_gpu_blocks_override
        elif self._sizes_cache_by_profiling():
            t0 = time.perf_counter()
            peak = profile_peak_memory(self.model, self.sampler, self.max_num_tokens,
                                       self.max_num_reqs, self.block_size, self.kv_dtype,
                                       self.device, self.max_model_len)
            # (The profile leaves one-block scratch caches bound: what this runs on.)
            graph_reserve = estimate_graph_memory(self.model, self.capture_inputs,
                                                  self.cuda_graphs, self.device)
            self.startup_times["profile"] = time.perf_counter() - t0
            num_blocks = num_gpu_blocks(cfg.cache, model_cfg, self.kv_dtype, self.device,
                                        peak + graph_reserve, self._draft_block_bytes())
        else:
            num_blocks = num_cpu_blocks(cfg.cache, model_cfg, self.kv_dtype,
                                        extra_block_bytes=self._draft_block_bytes())
        # Every rank's cache holds the blocks the one scheduler hands out: the fewest.
        num_blocks = min_across_ranks(num_blocks, self.tp_group, self.device)
        t0 = time.perf_counter()
        block_bytes = kv_block_bytes(model_cfg, self.block_size, self.kv_dtype)
        check_fits_one_request(num_blocks, self.block_size, self.max_model_len, block_bytes,
                               self.device, cfg.cache, self.kv_groups, self.max_num_tokens)
        if progress:
            progress(f"allocating KV cache: {num_blocks} blocks "
                     f"({dtype_name(self.kv_dtype)})", None)
        self.kv_cache = allocate_kv_cache(model_cfg, cfg.cache, num_blocks, block_bytes,
                                          self.kv_dtype, self.device)
        # Each layer its page of the cache: its own, or with several KV-cache groups its
        # position in its group's (kv_cache_groups.py's layout).
        self.model.bind_kv_caches([(self.kv_cache[j][0], self.kv_cache[j][1])
                                   for j in self.kv_groups.layer_slot()])
        # The attention kernels' scratch for this cache: freed with the runner. The split
        # launches' counters for the largest step now, outside the full graphs' captures
        # below, which then record no memset to make their own. The CPU attention keeps
        # a plan per block table a step reads: one per KV-cache group.
        self.attention_workspaces = AttentionWorkspaces(
            [self.kv_cache], max_plans=2 * self.kv_groups.num_groups)
        if self.device.type == "cuda":
            self.attention_workspaces.arrivals(self.device, arrivals_bound(
                self.max_num_tokens, self.max_num_reqs, model_cfg.num_key_value_heads))
        self.num_blocks = num_blocks
        if self.spec is not None:  # a draft model's cache: the same blocks
            self.spec.proposer.initialize(num_blocks, self.block_size)
        self.startup_times["kv_cache"] = time.perf_counter() - t0
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB, %s)", num_blocks,
                    self.block_size, num_blocks * block_bytes / 2**20,
                    dtype_name(self.kv_dtype))
        graph_bytes = compile_and_capture(self.capture_inputs, self.cuda_graphs, progress,
                                          self.startup_times)
        if graph_reserve is not None and graph_bytes:
            # What the graphs took against what the KV cache was sized to leave them.
            log = logger.warning if graph_bytes > graph_reserve else logger.info
            log("the CUDA graphs took %.0f MiB (%.0f MiB were left for them)",
                graph_bytes / 2**20, graph_reserve / 2**20)
        return num_blocks

    def _draft_block_bytes(self) -> int:
        """What a block of a draft model's KV cache takes (0 without one): the target's
        cache is sized for both."""
        return 0 if self.spec is None else self.spec.proposer.kv_block_bytes(self.block_size)

    def _dry_batches(self) -> list[DryBatch]:
        """The batches whose dry forwards compile every Triton variant the start-up and
        the first steps launch (worker/startup/kernel_precompile.py)."""
        graphs = self.cuda_graphs
        full = graphs.capture_sizes if graphs.full is not None else ()
        return dry_batches(self.capture_inputs, self.max_num_tokens, self.max_num_reqs,
                           self.block_size, self.max_model_len,
                           graphs.piecewise_capture_sizes or graphs.capture_sizes, full)

    def _precompiles_kernels(self) -> bool:
        """Whether the start-up compiles its Triton variants in threads ahead of their
        launches (worker/startup/kernel_precompile.py): on CUDA, unless
        LLMFAST_KERNEL_PRECOMPILE=0. A method, for the CPU tests that force it."""
        return self.device.type == "cuda" and kernel_precompile_enabled()

    def _sizes_cache_by_profiling(self) -> bool:
        """Whether the KV cache takes what the profiled step and the graphs leave of the
        device (CUDA: the order `initialize` describes) rather than a size from the
        config. A method, so that a CPU test can run that order (tests/test_full_graphs.py)."""
        return self.device.type == "cuda"
