"""`ModelCudaGraphs`: one model's CUDA graphs, apart from its compilation.

    stats = CompileStats()
    graphs = ModelCudaGraphs(config.compile, device, max_num_tokens, max_num_reqs=R,
                             stats=stats)
    compiled = CompiledModel(model, config.compile, device, graphs=graphs, stats=stats)
    graph_bytes = graphs.capture(run_dummy, full_forward)  # once, the KV cache bound
    step = graphs.dispatcher.dispatch(n, num_reqs, uniform_decode)  # which graph, padding
    hidden = compiled(input_ids[:n_pad], positions[:n_pad], attn_metadata)  # not FULL
    logits = graphs.replay_full(n_pad, inputs)                             # FULL

The kinds, from `CompileConfig.cuda_graph_mode` and the device: piecewise graphs of the
compiled pieces (the compile backend hands each piece to `wrap_piece`; attention runs
eagerly between them) and/or full graphs of the whole forward for uniform-decode steps
(dispatch.py says which step uses which). Both are captured in one pass, largest size
first, into one shared memory pool, on one side stream, after the KV cache is bound:
the full graphs read it at its capture-time address.

The emulated capturer (capturers.py) stands for CUDA graphs on the CPU, for tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from llmfast.config import CompileConfig, CudaGraphMode
from llmfast.cuda_graphs.capture_context import CaptureStream, graph_capture
from llmfast.cuda_graphs.capturers import CudaGraphCapturer, EmulatedGraphCapturer
from llmfast.cuda_graphs.dispatch import GraphDispatcher
from llmfast.cuda_graphs.full import FullGraphRunner
from llmfast.cuda_graphs.piecewise import GraphCaptureState, PieceWrapper
from llmfast.cuda_graphs.sizes import capture_sizes
from llmfast.cuda_graphs.stats import GraphStats

# `full_forward(size, dummy)` -> (fn, inputs): a closure running the whole forward and
# lm_head at `size` tokens/request rows from the runner's persistent buffers, and those
# buffers (for the static-address check). With dummy=True it first fills the buffers
# with a harmless decode batch (slot -1: no KV write). Verify graphs (speculative
# decoding) call `full_forward(size, True, query_len)`: size / query_len requests
# of query_len tokens each.
FullForward = Callable[[int, bool], tuple[Callable[[], torch.Tensor], list[torch.Tensor]]]

logger = logging.getLogger(__name__)


def _capturer(graph_impl: str, device: torch.device, config: CompileConfig) -> Any:
    if graph_impl == "auto":
        graph_impl = "cuda" if device.type == "cuda" and config.use_cuda_graphs else "off"
    if not config.use_cuda_graphs or config.enforce_eager:
        graph_impl = "off"
    if graph_impl == "cuda":
        return CudaGraphCapturer(device)
    if graph_impl == "emulated":
        return EmulatedGraphCapturer(device)
    if graph_impl == "off":
        return None
    raise ValueError(f"graph_impl must be auto, cuda, emulated or off, not {graph_impl!r}")


class ModelCudaGraphs:
    """graph_impl: "auto" (CUDA graphs on CUDA when enabled), "emulated" (the CPU
    stand-in, for tests) or "off". max_num_reqs bounds the full graphs' sizes (default:
    max_num_tokens). `stats`: where the capture's figures go (the compiled model's)."""

    def __init__(self, config: CompileConfig, device: torch.device | str,
                 max_num_tokens: int, *, max_num_reqs: int | None = None,
                 graph_impl: str = "auto", stats: GraphStats | None = None,
                 spec_query_len: int = 0) -> None:
        self.config = config
        self.device = torch.device(device)
        self.max_num_tokens = max_num_tokens
        self.stats = stats if stats is not None else GraphStats()
        # The piece runners' shared state (the capturer and its pool); None: no graphs.
        self.piecewise: GraphCaptureState | None = None
        self.full: FullGraphRunner | None = None
        self.capture_sizes: tuple[int, ...] = ()
        self.piecewise_capture_sizes: tuple[int, ...] | None = None  # None: capture_sizes
        self.dispatcher = GraphDispatcher(CudaGraphMode.NONE, (), 0)
        # One side stream for every capture (capture_context.py).
        self._capture_stream = CaptureStream(self.device)
        capturer = _capturer(graph_impl, self.device, config)
        if capturer is None:
            return
        mode = config.cuda_graph_mode
        self.piecewise = GraphCaptureState(capturer, config.check_static_addresses)
        self.capture_sizes = capture_sizes(max_num_tokens, config.cuda_graph_sizes)
        if config.piecewise_graph_sizes is not None:
            self.piecewise_capture_sizes = capture_sizes(max_num_tokens,
                                                         config.piecewise_graph_sizes)
        if mode.has_full:
            self.full = FullGraphRunner(capturer, config.check_static_addresses)
        self.dispatcher = GraphDispatcher(mode, self.capture_sizes,
                                          max_num_reqs if max_num_reqs is not None
                                          else max_num_tokens, self.piecewise_capture_sizes,
                                          spec_query_len)

    @property
    def wrap_piece(self) -> PieceWrapper | None:
        """What the compile backend wraps each compiled piece with (None: no piecewise
        graphs)."""
        if self.piecewise is None or not self.dispatcher.mode.has_piecewise:
            return None
        return self.piecewise.wrap

    @property
    def enabled(self) -> bool:
        """Some graph will be captured (a capturer, and sizes for it)."""
        return self.piecewise is not None and bool(self.capture_sizes)

    @property
    def checks_static_addresses(self) -> bool:
        """Debug mode: replays compare their inputs' addresses with the captured ones."""
        return self.config.check_static_addresses

    @property
    def num_piecewise_graphs(self) -> int:
        return self.piecewise.num_graphs if self.piecewise is not None else 0

    def drop_piece_runners(self) -> None:
        """Forget the piece runners and their graphs (pieces replaced by others)."""
        if self.piecewise is not None:
            self.piecewise.drop_runners()

    # ------------------------------------------------------------------ per step

    def padded_num_tokens(self, num_tokens: int, uniform_decode: bool = False) -> int:
        """The token count a step of `num_tokens` runs at: the smallest CUDA-graph size
        that fits, else `num_tokens` (eager, CPU, or larger than every graph)."""
        return self.dispatcher.padded_num_tokens(num_tokens, uniform_decode)

    def replay_full(self, num_tokens: int | tuple[int, int],
                    inputs: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """Replay the full graph of `num_tokens` (a dispatched FULL size, or a verify
        graph's (size, query length): BatchDescriptor.graph_key); returns its logits
        [size, vocab], valid until the next replay of any graph. `inputs`
        (what the graph reads) are only looked at when `checks_static_addresses`."""
        assert self.full is not None and self.piecewise is not None
        with self.piecewise.whole_forward():  # for the CPU emulation's re-run
            return self.full.replay(num_tokens, inputs)

    # ------------------------------------------------------------------ start-up

    def capture(self, run_dummy: Callable[[int], None],
                full_forward: FullForward | None = None) -> int:
        """Capture every graph, once: run `run_dummy` at the largest size first (the
        compile, if the model has not run yet), then, largest size first, both kinds
        into the one pool: smaller sizes reuse the memory the larger ones' activations
        held during their capture. Call it with the real KV cache bound.

        `run_dummy(n)` must run one forward through the compiled model at `n` tokens
        from the runner's persistent buffers, with dummy metadata whose slot_mapping is
        all -1 (no KV write); `full_forward` (see `FullForward`) is needed for full
        graphs. Returns the device memory the graphs took, in bytes (0 on the CPU or
        without graphs)."""
        if not self.enabled:
            return 0
        with torch.inference_mode():
            return self._capture(run_dummy, full_forward)

    def _capture(self, run_dummy: Callable[[int], None],
                 full_forward: FullForward | None) -> int:
        assert self.piecewise is not None
        state = self.piecewise
        on_cuda = isinstance(state.capturer, CudaGraphCapturer)
        piecewise_sizes = self.dispatcher.piecewise_sizes
        full_sizes = self.dispatcher.full_sizes if self.full is not None else ()
        # Speculative decoding's verify graphs (dispatch.py), by size.
        spec_sizes = self.dispatcher.spec_full_sizes if self.full is not None else ()
        spec_query_len = self.dispatcher.spec_query_len
        if full_sizes and full_forward is None:
            # A caller without the runner's buffers (tests, benchmarks of the pieces):
            # piecewise graphs only, and no step dispatched to a full graph.
            logger.info("no full_forward given: capturing piecewise graphs only")
            self.full, full_sizes, spec_sizes = None, (), ()
            mode = self.config.cuda_graph_mode
            self.dispatcher = GraphDispatcher(
                CudaGraphMode.PIECEWISE if mode.has_piecewise else CudaGraphMode.NONE,
                self.capture_sizes, 0, self.piecewise_capture_sizes)
            if not piecewise_sizes:
                run_dummy(min(self.max_num_tokens, 8))  # triggers the compile
                return 0
        sizes = sorted(set(piecewise_sizes) | set(full_sizes) | set(spec_sizes), reverse=True)
        run_dummy(sizes[0])  # compile before measuring memory
        free_before = self._free_device_memory(on_cuda)
        start = time.perf_counter()
        with self._capture_stream.current(), graph_capture("cuda graph capture"):
            for size in sizes:
                if size in piecewise_sizes:
                    run_dummy(size)  # warm-up at this size
                    with state.capturing(size):
                        run_dummy(size)
                if size in full_sizes:
                    self._capture_full(size, full_forward)
                if size in spec_sizes:
                    self._capture_full((size, spec_query_len), full_forward)
        graph_bytes = max(free_before - self._free_device_memory(on_cuda), 0)
        stats = self.stats
        stats.captured_sizes = tuple(sorted(piecewise_sizes))
        stats.full_graph_sizes = tuple(sorted(full_sizes))
        stats.num_cuda_graphs = state.num_graphs
        stats.capture_time_s = time.perf_counter() - start
        stats.graph_memory_bytes = graph_bytes
        logger.info("captured %d piecewise graphs at %d sizes and %d full graphs (%d of "
                    "them verify steps) in %.1f s, %.0f MiB", state.num_graphs,
                    len(piecewise_sizes), len(full_sizes) + len(spec_sizes), len(spec_sizes),
                    stats.capture_time_s, graph_bytes / 2**20)
        return graph_bytes

    def _capture_full(self, key: int | tuple[int, int], full_forward: FullForward) -> None:
        """Capture the full graph of `size` after one uncaptured run of it: a size's
        launch may be a Triton variant of its own (e.g. split partials whose sum buffer
        is not 16-byte aligned at that size), compiled in that warm-up, never inside the
        capture, where compiling fails."""
        assert self.full is not None and self.piecewise is not None
        if isinstance(key, tuple):  # a verify graph: (size, query length)
            fn, inputs = full_forward(key[0], True, key[1])
        else:
            fn, inputs = full_forward(key, True)
        with self.piecewise.whole_forward():
            fn()
            self.full.capture(key, fn, inputs)

    def _free_device_memory(self, on_cuda: bool) -> int:
        if not on_cuda:
            return 0
        torch.cuda.synchronize(self.device)
        # Drop cached-but-unused blocks of the ordinary pool (warm-up activations), so
        # the difference measures the graph pool and the graphs themselves.
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]
