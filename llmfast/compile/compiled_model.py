"""`CompiledModel`: what the runner calls instead of `model.forward`.

    compiled = CompiledModel(model, config.compile, device, max_num_tokens)
    n_pad = compiled.padded_num_tokens(n)          # pad the step to a graph size
    hidden = compiled(input_ids[:n_pad], positions[:n_pad], attn_metadata)
    graph_bytes = compiled.capture(run_dummy)     # compile now; capture CUDA graphs
    compiled.stats                                 # pieces, times, cache hits, graphs

Modes, from `CompileConfig` and the device: eager (`enforce_eager`: the model as is);
compiled (torch.compile with the piecewise backend; CPU, or CUDA without graphs);
compiled + piecewise CUDA graphs (CUDA with `use_cuda_graphs`).

The token dimension of the inputs, the request dimension of the metadata and the block
dimension of the KV caches are marked unbacked before the first call, so one graph
serves every step and the KV cache may be re-bound (e.g. from the profiling scratch
cache to the real one) without a recompile. The piecewise graphs never read the KV
cache (attention runs between them; Dynamo passes caches to some pieces only to check
their sizes), so they may be captured before it is allocated.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from llmfast.attention_metadata import AttentionMetadata
from llmfast.compile.backend import PiecewiseBackend
from llmfast.compile.cache import compile_cache_dir, compile_cache_key
from llmfast.compile.stats import CompileStats
from llmfast.config import CompileConfig
from llmfast.gc_freeze import hold_gc_freeze
from llmfast.graphs.piecewise import CudaGraphCapturer, EmulatedGraphCapturer, GraphCaptureState
from llmfast.graphs.sizes import capture_sizes, pad_num_tokens

logger = logging.getLogger(__name__)


def _mark_unbacked(t: torch.Tensor, dim: int, shape_id: str | None) -> None:
    from torch._dynamo.decorators import mark_unbacked

    # `shape_id` (torch >= 2.12 or so) lets tensors share one size symbol; without it
    # each gets its own and Dynamo relates them by runtime asserts: also one graph.
    if shape_id is not None and "shape_id" in inspect.signature(mark_unbacked).parameters:
        mark_unbacked(t, dim, shape_id=shape_id)
    else:
        mark_unbacked(t, dim)


_forward_ids = itertools.count()  # unique names for _private_forward


def _private_forward(model: nn.Module) -> Callable[..., torch.Tensor]:
    """`model(...)` behind a code object of its own.

    Dynamo keeps compiled code, and its recompile limit (8), per code object. Compiling
    `model` itself would share `DecoderForCausalLM.forward`'s code between every
    CompiledModel in the process (tests, benchmarks), so the ninth would fail; a
    private copy of the code also frees its cache with this object.

    The copy also gets a name of its own (`forward_<n>`): Dynamo's automatic-dynamic
    ("PGO") state, the sizes it has seen per input, is keyed by the code's file, first
    line and *name*, not by the code object. With one shared name every CompiledModel in
    the process pooled it: after models fed from persistent buffers of different lengths
    (e.g. engine tests with different budgets), a new model traced the buffers' bases
    as dynamic and guarded on `input_ids._base.size()`, a guard that fails ("'NoneType'
    object has no attribute 'size'") for a non-view input: a recompile instead of the
    static-address check.
    """

    def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        return model(input_ids, positions, attn_metadata)

    name = f"forward_{next(_forward_ids)}"
    forward.__code__ = forward.__code__.replace(co_name=name, co_qualname=name)
    return forward


class CompiledModel:
    """graph_impl: "auto" (CUDA graphs on CUDA when enabled), "emulated" (the CPU
    stand-in, for tests) or "off". piece_compiler: "inductor" or "eager" (tests)."""

    def __init__(
        self,
        model: nn.Module,
        config: CompileConfig,
        device: torch.device | str,
        max_num_tokens: int,
        *,
        graph_impl: str = "auto",
        piece_compiler: str = "inductor",
    ) -> None:
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.max_num_tokens = max_num_tokens
        self.stats = CompileStats()
        self.eager = config.enforce_eager
        self._marked = False
        self._graph_state: GraphCaptureState | None = None
        self.capture_sizes: tuple[int, ...] = ()
        if self.eager:
            self._forward: Callable[..., torch.Tensor] = model
            return

        if graph_impl == "auto":
            graph_impl = "cuda" if self.device.type == "cuda" and config.use_cuda_graphs else "off"
        if graph_impl == "cuda":
            capturer: Any = CudaGraphCapturer(self.device)
        elif graph_impl == "emulated":
            capturer = EmulatedGraphCapturer(self.device)
        elif graph_impl == "off":
            capturer = None
        else:
            raise ValueError(f"graph_impl must be auto, cuda, emulated or off, not {graph_impl!r}")
        if capturer is not None:
            self._graph_state = GraphCaptureState(capturer, config.check_static_addresses)
            self.capture_sizes = capture_sizes(max_num_tokens, config.cuda_graph_sizes)

        cache_dir = None
        if config.use_compile_cache:
            dtype = next(model.parameters()).dtype
            key = compile_cache_key(model.config, dtype, self.device.type, config)
            cache_dir = compile_cache_dir(key)
        self.backend = PiecewiseBackend(
            config.splitting_ops,
            self.stats,
            cache_dir=cache_dir,
            piece_compiler=piece_compiler,
            wrap_piece=self._graph_state.wrap if self._graph_state is not None else None,
        )
        self._forward = torch.compile(
            _private_forward(model), backend=self.backend, fullgraph=True
        )

    # ------------------------------------------------------------------ per step

    def padded_num_tokens(self, num_tokens: int) -> int:
        """The token count a step of `num_tokens` runs at: the smallest CUDA-graph size
        that fits, else `num_tokens` (eager, CPU, or larger than every graph)."""
        return pad_num_tokens(num_tokens, self.capture_sizes)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: AttentionMetadata) -> torch.Tensor:
        """[T] ids and positions -> [T, hidden] (T already padded by the caller).

        Under CUDA graphs the result lives in the graph pool: use it before the next
        call (the runner does: it samples, then syncs, every step)."""
        if not self._marked and not self.eager:
            self._mark_dynamic(input_ids, positions, attn_metadata)
        return self._forward(input_ids, positions, attn_metadata)

    def _mark_dynamic(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      md: AttentionMetadata) -> None:
        # Dynamo reads these marks when it first traces; later calls with fresh tensor
        # objects are not re-marked: the compiled graph's guards leave the dims free.
        _mark_unbacked(input_ids, 0, "num_tokens")
        _mark_unbacked(positions, 0, "num_tokens")
        _mark_unbacked(md.slot_mapping, 0, "num_tokens")
        _mark_unbacked(md.block_table, 0, "num_reqs")
        _mark_unbacked(md.block_table, 1, None)  # blocks per request: free to vary too
        _mark_unbacked(md.seq_lens, 0, "num_reqs")
        _mark_unbacked(md.query_start_loc, 0, None)
        layers = getattr(self.model, "attention_layers", None)
        for layer in layers() if layers is not None else ():
            _mark_unbacked(layer.k_cache, 0, "num_blocks")
            _mark_unbacked(layer.v_cache, 0, "num_blocks")
        self._marked = True

    # ------------------------------------------------------------------ start-up

    def capture(self, run_dummy: Callable[[int], None]) -> int:
        """Compile now (not at the first request) and capture the CUDA graphs.

        `run_dummy(n)` must run one forward through this object at `n` tokens from the
        runner's persistent buffers, with dummy metadata whose slot_mapping is all -1
        (no KV write). Returns the device memory the graphs took, in bytes (0 without
        graphs), to be reserved when sizing the KV cache.
        """
        if self.eager:
            return 0
        with torch.inference_mode():
            if self._graph_state is None or not self.capture_sizes:
                run_dummy(min(self.max_num_tokens, 8))  # triggers the compile
                return 0
            return self._capture_graphs(run_dummy)

    def _capture_graphs(self, run_dummy: Callable[[int], None]) -> int:
        assert self._graph_state is not None
        state = self._graph_state
        on_cuda = isinstance(state.capturer, CudaGraphCapturer)
        sizes = sorted(self.capture_sizes, reverse=True)
        run_dummy(sizes[0])  # compile before measuring memory
        free_before = self._free_device_memory(on_cuda)
        start = time.perf_counter()
        stream = torch.cuda.Stream(self.device) if on_cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        # Capture allocates many small Python objects; freeze the existing ones so the
        # collector does not rescan the whole heap while we capture hundreds of graphs.
        release_gc = hold_gc_freeze()
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for size in sizes:  # largest first: smaller sizes reuse its pool memory
                    run_dummy(size)  # warm-up at this size
                    with state.capturing(size):
                        run_dummy(size)
        finally:
            release_gc()
            if stream is not None:
                torch.cuda.current_stream(self.device).wait_stream(stream)
        graph_bytes = max(free_before - self._free_device_memory(on_cuda), 0)
        stats = self.stats
        stats.captured_sizes = tuple(sorted(sizes))
        stats.num_cuda_graphs = state.num_graphs
        stats.capture_time_s = time.perf_counter() - start
        stats.graph_memory_bytes = graph_bytes
        logger.info("captured %d graphs at %d sizes in %.1f s, %.0f MiB", state.num_graphs,
                    len(sizes), stats.capture_time_s, graph_bytes / 2**20)
        return graph_bytes

    def _free_device_memory(self, on_cuda: bool) -> int:
        if not on_cuda:
            return 0
        torch.cuda.synchronize(self.device)
        # Drop cached-but-unused blocks of the ordinary pool (warm-up activations), so
        # the difference measures the graph pool and the graphs themselves.
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

