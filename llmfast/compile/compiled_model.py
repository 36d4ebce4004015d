"""`CompiledModel`: what the runner calls instead of `model.forward`.

    compiled = CompiledModel(model, config.compile, device, max_num_tokens, max_num_reqs=R)
    step = compiled.dispatcher.dispatch(n, num_reqs, uniform_decode)  # which graph, padding
    hidden = compiled(input_ids[:n_pad], positions[:n_pad], attn_metadata)  # not FULL
    logits = compiled.replay_full(n_pad, inputs)                           # FULL
    graph_bytes = compiled.capture(run_dummy, full_forward)  # compile now; capture graphs
    compiled.stats                                 # pieces, times, cache hits, graphs

Modes, from `CompileConfig` and the device: eager (`enforce_eager`: the model as is);
compiled (torch.compile with the piecewise backend; CPU, or CUDA without graphs);
compiled + CUDA graphs of the `cuda_graph_mode`'s kinds: piecewise graphs of the
compiled pieces (attention eager between them) and/or full graphs of the whole forward
for uniform-decode steps (see graphs/dispatch.py for which step uses which).

The token dimension of the inputs, the request dimension of the metadata and the block
dimension of the KV caches are marked unbacked before the first call, so one graph
serves every step and the KV cache may be re-bound (e.g. from the profiling scratch
cache to the real one) without a recompile. The piecewise graphs never read the KV
cache (attention runs between them; Dynamo passes caches to some pieces only to check
their sizes), so they may be captured before it is allocated.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmfast.attention.metadata import AttentionMetadata
from llmfast.compile import precompiled
from llmfast.compile.backend import PiecewiseBackend, assemble_split_graph
from llmfast.compile.cache import compile_cache_dir, compile_cache_key, inductor_cache
from llmfast.compile.graph_inputs import (
    InputsChanged,
    bind_slots,
    first_mismatch,
    first_unfit,
    input_patterns,
    model_fingerprint,
    record_slots,
)
from llmfast.compile.stats import CompileStats
from llmfast.compile.workers import start_compile_workers, trace_expected
from llmfast.config import CompileConfig, CudaGraphMode
from llmfast.graphs.capture_context import CaptureStream, graph_capture
from llmfast.graphs.dispatch import GraphDispatcher
from llmfast.graphs.full import FullGraphRunner
from llmfast.graphs.piecewise import CudaGraphCapturer, EmulatedGraphCapturer, GraphCaptureState
from llmfast.graphs.sizes import capture_sizes
from llmfast.kernels.layers.triton_ops import register_triton_ops

# `full_forward(size, dummy)` -> (fn, inputs): a closure running the whole forward and
# lm_head at `size` tokens/request rows from the runner's persistent buffers, and those
# buffers (for the static-address check). With dummy=True it first fills the buffers
# with a harmless decode batch (slot -1: no KV write).
FullForward = Callable[[int, bool], tuple[Callable[[], torch.Tensor], list[torch.Tensor]]]

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


def _release_graphs(backend: PiecewiseBackend, state: GraphCaptureState | None) -> None:
    """Drop a discarded model's piecewise CUDA graphs and what holds their memory pool.

    Dynamo keeps what it compiled for the life of the process: the backend in its
    registry of backends (`eval_frame.cached_backends`, by id), and the split graph, whose
    piece runners hold the graphs, in a `__compiled_fn_*` global of this module. Neither
    lets go when the model does, so the graphs, the capture state and its pool would
    outlive every engine (`memory_reserved` never coming back)."""
    backend.wrap_piece = None  # a bound method of `state`
    backend.split_gm = None
    backend.last_trace = None  # the first call's tensors (a save that never came)
    if state is not None:
        state.drop_runners()


# The least device memory counted for a full graph's own structures when one graph's
# capture stands for all (`capture`'s full_graphs_later): a reading below the driver's
# allocation granularity may show none.
FULL_GRAPH_MIN_BYTES = 2 * 2**20


class CompiledModel:
    """graph_impl: "auto" (CUDA graphs on CUDA when enabled), "emulated" (the CPU
    stand-in, for tests) or "off". piece_compiler: "inductor" or "eager" (tests).
    max_num_reqs bounds the full graphs' sizes (default: max_num_tokens). precompile:
    save the first trace for the next start and load a saved one (compile/precompiled.py;
    with the compile cache on, unless LLMFAST_PRECOMPILED=0)."""

    def __init__(
        self,
        model: nn.Module,
        config: CompileConfig,
        device: torch.device | str,
        max_num_tokens: int,
        *,
        max_num_reqs: int | None = None,
        graph_impl: str = "auto",
        piece_compiler: str = "inductor",
        precompile: bool = True,
    ) -> None:
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.max_num_tokens = max_num_tokens
        self.stats = CompileStats()
        # What all the full graphs were estimated to take when only the largest was
        # captured (`capture`'s full_graphs_later), for recapture_full's check; 0 else.
        self._full_graphs_estimate = 0
        self.eager = config.enforce_eager
        self._started = False  # the first call (which traces or loads) has happened
        self._cache_dir: Path | None = None
        # Where a warm start skips Dynamo: <compile cache>/precompiled, then (first call)
        # its subdirectory for this model's fingerprint.
        self._precompiled_dir: Path | None = None
        self._graph_state: GraphCaptureState | None = None
        self.full_graphs: FullGraphRunner | None = None
        self.capture_sizes: tuple[int, ...] = ()
        self.piecewise_capture_sizes: tuple[int, ...] | None = None  # None: capture_sizes
        self.dispatcher = GraphDispatcher(CudaGraphMode.NONE, (), 0)
        # One side stream for every capture, the full graphs' recapture included.
        self._capture_stream = CaptureStream(self.device)
        if self.eager:
            self._forward: Callable[..., torch.Tensor] = model
            return

        if graph_impl == "auto":
            graph_impl = "cuda" if self.device.type == "cuda" and config.use_cuda_graphs else "off"
        if not config.use_cuda_graphs:
            graph_impl = "off"
        if graph_impl == "cuda":
            capturer: Any = CudaGraphCapturer(self.device)
        elif graph_impl == "emulated":
            capturer = EmulatedGraphCapturer(self.device)
        elif graph_impl == "off":
            capturer = None
        else:
            raise ValueError(f"graph_impl must be auto, cuda, emulated or off, not {graph_impl!r}")
        mode = config.cuda_graph_mode if capturer is not None else CudaGraphMode.NONE
        if capturer is not None:
            self._graph_state = GraphCaptureState(capturer, config.check_static_addresses)
            self.capture_sizes = capture_sizes(max_num_tokens, config.cuda_graph_sizes)
            if config.piecewise_graph_sizes is not None:
                self.piecewise_capture_sizes = capture_sizes(max_num_tokens,
                                                             config.piecewise_graph_sizes)
            if mode.has_full:
                self.full_graphs = FullGraphRunner(capturer, config.check_static_addresses)
        self.dispatcher = GraphDispatcher(mode, self.capture_sizes,
                                          max_num_reqs if max_num_reqs is not None
                                          else max_num_tokens, self.piecewise_capture_sizes)
        self._wrap = (self._graph_state.wrap
                      if self._graph_state is not None and mode.has_piecewise else None)

        if config.use_compile_cache:
            dtype = next(model.parameters()).dtype
            key = compile_cache_key(model.config, dtype, self.device.type, config)
            self._cache_dir = compile_cache_dir(key)
            if precompile and piece_compiler == "inductor" and precompiled.precompiled_enabled():
                self._precompiled_dir = self._cache_dir / precompiled.DIRNAME
        # Inductor's Triton compile workers, started while the model is profiled and
        # traced (compile/workers.py); not for a start that will load a saved model.
        self._starts_workers = piece_compiler == "inductor"
        if self._starts_workers and trace_expected(self._precompiled_dir):
            start_compile_workers(self.device)
        self.backend = PiecewiseBackend(
            config.splitting_ops,
            self.stats,
            cache_dir=self._cache_dir,
            piece_compiler=piece_compiler,
            wrap_piece=self._wrap,
            keep_artifacts=self._precompiled_dir is not None,
        )
        register_triton_ops()  # the norms and RoPE the model records when compiling
        self._dynamo_forward = torch.compile(
            _private_forward(model), backend=self.backend, fullgraph=True
        )
        self._forward = self._dynamo_forward
        weakref.finalize(self, _release_graphs, self.backend, self._graph_state)

    # ------------------------------------------------------------------ per step

    def padded_num_tokens(self, num_tokens: int, uniform_decode: bool = False) -> int:
        """The token count a step of `num_tokens` runs at: the smallest CUDA-graph size
        that fits, else `num_tokens` (eager, CPU, or larger than every graph)."""
        return self.dispatcher.padded_num_tokens(num_tokens, uniform_decode)

    @property
    def checks_static_addresses(self) -> bool:
        """Debug mode: replays compare their inputs' addresses with the captured ones."""
        return self.config.check_static_addresses

    def replay_full(self, num_tokens: int, inputs: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """Replay the full graph of `num_tokens` (a dispatched FULL size); returns its
        logits [num_tokens, vocab], valid until the next replay of any graph. `inputs`
        (what the graph reads) are only looked at when `checks_static_addresses`."""
        assert self.full_graphs is not None and self._graph_state is not None
        with self._graph_state.whole_forward():  # for the CPU emulation's re-run
            return self.full_graphs.replay(num_tokens, inputs)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: AttentionMetadata) -> torch.Tensor:
        """[T] ids and positions -> [T, hidden] (T already padded by the caller).

        Under CUDA graphs the result lives in the graph pool: use it before the next
        call (the runner does: it samples, then syncs, every step)."""
        if not self._started and not self.eager:
            return self._first_call(input_ids, positions, attn_metadata)
        try:
            return self._forward(input_ids, positions, attn_metadata)
        except InputsChanged as exc:  # raised before any piece ran: nothing to undo
            self._fall_back_to_dynamo(exc, input_ids, positions, attn_metadata)
            return self._forward(input_ids, positions, attn_metadata)

    def _first_call(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Load what a cold start traced (compile/precompiled.py), else trace with
        Dynamo now, and save what the trace compiled for the next start."""
        self._started = True
        call = (input_ids, positions, attn_metadata)
        if self._precompiled_dir is not None:
            # Now, not at construction: the KV caches are bound (their dtype counts).
            self._precompiled_dir = self._precompiled_dir / model_fingerprint(self.model)
            if precompiled.failed_before(self._precompiled_dir):
                self.backend.keep_trace = False  # neither loaded nor saved again
            else:
                out = self._run_precompiled(self._precompiled_dir, call)
                if out is not None:
                    return out
                precompiled.discard(self._precompiled_dir)  # unusable: room for a new one
        if self._starts_workers:
            start_compile_workers(self.device)  # (already started, unless a saved one was expected)
        self._mark_dynamic(*call)
        out = self._forward(*call)
        if self.backend.last_trace is not None:
            self._save_precompiled(call, out)  # (and drops the trace)
        self.backend.keep_trace = False  # recompiles (if any) are not saved
        return out

    def _run_precompiled(self, directory: Path,
                         call: tuple[torch.Tensor, torch.Tensor, AttentionMetadata]
                         ) -> torch.Tensor | None:
        """Load the saved model and run this first call on it; None if there is none
        or it is unusable (traced for other inputs, or failing on this call: nothing
        it ran is kept, the caller traces)."""
        start = time.perf_counter()
        with inductor_cache(self._cache_dir):
            record = precompiled.load(directory)
        if record is None:
            return None
        try:
            flatten = bind_slots(record.slots, self.model, record.none_fields)
            flat = flatten(*call)
            unfit = first_unfit(record.patterns, flat)
            if unfit is not None:
                then = record.patterns[unfit] if unfit < len(record.patterns) else "absent"
                raise ValueError(f"traced for other inputs: {record.slots[unfit]} was {then}")
            split = assemble_split_graph(record.split, self.backend.targets, record.artifacts,
                                         record.pieces, self._wrap, self.stats)
        except Exception as exc:  # noqa: BLE001 - an unusable entry means tracing again
            logger.warning("ignoring the precompiled model in %s: %s", directory, exc)
            self._drop_runners()
            return None
        try:
            out = split.forward(*flat)[record.output_index]
        except Exception as exc:  # noqa: BLE001 - traced instead; not tried again
            # Everything checkable held, and the loaded model still failed: likely to
            # fail the same way next time (an artifact this torch cannot run), so this
            # configuration traces from now on rather than loading and failing first.
            logger.warning("ignoring the precompiled model in %s, which failed on its first "
                           "call: %s; this configuration traces from now on", directory, exc)
            precompiled.mark_failed(directory, exc)
            self.backend.keep_trace = False  # nor saved again
            self._drop_runners()
            return None
        run, index = split.forward, record.output_index
        self.backend.split_gm = split

        def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                    attn_metadata: AttentionMetadata) -> torch.Tensor:
            return run(*flatten(input_ids, positions, attn_metadata))[index]

        self._forward = forward
        self.backend.keep_trace = False  # a fallback's trace is not saved
        stats = self.stats
        stats.precompiled = True
        stats.cache_dir = str(self._cache_dir)
        stats.cache_hits += len(record.artifacts)  # each an AOTAutograd cache entry
        stats.compile_time_s += time.perf_counter() - start
        logger.info("loaded the precompiled model from %s: %s", directory, stats.summary())
        return out

    def _save_precompiled(self, call: tuple[torch.Tensor, torch.Tensor, AttentionMetadata],
                          out: torch.Tensor) -> None:
        """After the traced first call: name the graph's inputs, check that the split
        graph called on them returns Dynamo's `out` exactly, and save."""
        assert self._precompiled_dir is not None and self.backend.last_trace is not None
        gm, example_inputs, split_bytes, pieces, compiled_fns = self.backend.last_trace
        self.backend.last_trace = None  # holds the first call's tensors
        start = time.perf_counter()
        try:
            if self.backend.split_gm is None or self.stats.num_dynamo_graphs != 1:
                return
            if not all(getattr(fn, "is_saveable", lambda: False)() for fn in compiled_fns):
                logger.info("not saving a precompiled model: a piece has no artifact")
                return
            slots = record_slots(gm, example_inputs, self.model, call)
            if slots is None:
                logger.info("not saving a precompiled model: a graph input has no name")
                return
            md = call[2]
            none_fields = tuple(f.name for f in dataclasses.fields(md)
                                if getattr(md, f.name) is None)
            flatten = bind_slots(slots, self.model, none_fields)
            flat = flatten(*call)
            mismatch = first_mismatch(flat, example_inputs)
            if mismatch is not None:
                logger.warning("not saving a precompiled model: graph input %d gathered as "
                               "%s differs from Dynamo's", mismatch, slots[mismatch])
                return
            index = precompiled.output_index(self.backend.split_gm.forward(*flat), out)
            if index is None:
                logger.warning("not saving a precompiled model: the split graph called "
                               "without Dynamo did not return Dynamo's result")
                return
            traced = [n.meta.get("example_value") for n in gm.graph.nodes
                      if n.op == "placeholder"]
            precompiled.save(self._precompiled_dir, precompiled.Precompiled(
                self.backend.split_gm, slots, none_fields, input_patterns(traced), index,
                pieces, compiled_fns), split_bytes)
        finally:
            self.stats.compile_time_s += time.perf_counter() - start

    def _fall_back_to_dynamo(self, exc: InputsChanged, input_ids: torch.Tensor,
                             positions: torch.Tensor, md: AttentionMetadata) -> None:
        state = self._graph_state
        lost = state.num_graphs if state is not None else 0
        logger.log(logging.ERROR if lost else logging.WARNING,
                   "the precompiled model does not fit this call (%s): tracing with Dynamo "
                   "instead%s", exc,
                   f"; its {lost} piecewise CUDA graphs are dropped, and the new pieces "
                   "run without graphs" if lost else "")
        self._drop_runners()  # the loaded pieces'
        self.stats.precompiled = False
        self._mark_dynamic(input_ids, positions, md)
        self._forward = self._dynamo_forward

    def _drop_runners(self) -> None:
        if self._graph_state is not None:
            self._graph_state.drop_runners()

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

    # ------------------------------------------------------------------ start-up

    def capture(self, run_dummy: Callable[[int], None],
                full_forward: FullForward | None = None, *,
                full_graphs_later: bool = False) -> int:
        """Compile now (not at the first request) and capture the CUDA graphs.

        `run_dummy(n)` must run one forward through this object at `n` tokens from the
        runner's persistent buffers, with dummy metadata whose slot_mapping is all -1
        (no KV write); `full_forward` (see `FullForward`) is needed for full graphs.
        Returns the device memory the graphs took, in bytes (0 without graphs), to be
        reserved when sizing the KV cache.

        `full_graphs_later`: the caller captures the full graphs itself afterwards
        (`recapture_full`, once the real KV cache they read exists). Only the largest is
        captured now, to measure what they take: whatever it adds to the shared pool
        (the smaller sizes reuse that memory), and its graph's own device memory, counted
        once for every full size. (Before, every size was captured twice, with a
        warm-up each time.)
        """
        if self.eager:
            return 0
        with torch.inference_mode():
            if self._graph_state is None or not self.capture_sizes:
                run_dummy(min(self.max_num_tokens, 8))  # triggers the compile
                return 0
            return self._capture_graphs(run_dummy, full_forward, full_graphs_later)

    def _capture_graphs(self, run_dummy: Callable[[int], None],
                        full_forward: FullForward | None, full_graphs_later: bool) -> int:
        assert self._graph_state is not None
        state = self._graph_state
        on_cuda = isinstance(state.capturer, CudaGraphCapturer)
        piecewise_sizes = self.dispatcher.piecewise_sizes
        full_sizes = self.dispatcher.full_sizes if self.full_graphs is not None else ()
        if full_sizes and full_forward is None:
            # A caller without the runner's buffers (tests, benchmarks of the pieces):
            # piecewise graphs only, and no step dispatched to a full graph.
            logger.info("no full_forward given: capturing piecewise graphs only")
            self.full_graphs, full_sizes = None, ()
            mode = self.config.cuda_graph_mode
            self.dispatcher = GraphDispatcher(
                CudaGraphMode.PIECEWISE if mode.has_piecewise else CudaGraphMode.NONE,
                self.capture_sizes, 0, self.piecewise_capture_sizes)
            if not piecewise_sizes:
                run_dummy(min(self.max_num_tokens, 8))  # triggers the compile
                return 0
        # The full sizes captured now: all, or the largest alone (its measure stands for
        # the rest, which the caller captures later).
        capture_full_now = full_sizes[-1:] if full_graphs_later else full_sizes
        sizes = sorted(set(piecewise_sizes) | set(capture_full_now), reverse=True)
        run_dummy(sizes[0])  # compile before measuring memory
        free_before = self._free_device_memory(on_cuda)
        later_bytes = 0
        start = time.perf_counter()
        with self._capture_stream.current(), graph_capture("cuda graph capture"):
            # Largest first, both kinds into the one pool: smaller sizes reuse the
            # memory the larger ones' activations held during their capture.
            for size in sizes:
                if size in piecewise_sizes:
                    run_dummy(size)  # warm-up at this size
                    with state.capturing(size):
                        run_dummy(size)
                if size in capture_full_now:
                    graph_own = self._capture_full(size, full_forward, warm_up=True,
                                                   measure=on_cuda and full_graphs_later)
                    if on_cuda and full_graphs_later:
                        # Free memory moves in the driver's chunks: a reading of one
                        # graph may be 0, and is multiplied by ~50, hence a floor.
                        graph_own = max(graph_own, FULL_GRAPH_MIN_BYTES)
                        later_bytes = graph_own * (len(full_sizes) - 1)
                        self._full_graphs_estimate = graph_own * len(full_sizes)
        graph_bytes = max(free_before - self._free_device_memory(on_cuda), 0) + later_bytes
        stats = self.stats
        stats.captured_sizes = tuple(sorted(piecewise_sizes))
        stats.full_graph_sizes = tuple(sorted(full_sizes))
        stats.num_cuda_graphs = state.num_graphs
        stats.capture_time_s = time.perf_counter() - start
        stats.graph_memory_bytes = graph_bytes
        logger.info("captured %d piecewise graphs at %d sizes and %d of %d full graphs in "
                    "%.1f s, %.0f MiB", state.num_graphs, len(piecewise_sizes),
                    len(capture_full_now), len(full_sizes), stats.capture_time_s,
                    graph_bytes / 2**20)
        return graph_bytes

    def recapture_full(self, full_forward: FullForward) -> None:
        """Capture the full graphs of every full size (again), e.g. after binding the
        real KV cache: they read the caches at their capture-time addresses. Those
        captured before (every size, or the largest alone: `capture`'s
        `full_graphs_later`) are dropped first, their memory back to the shared pool,
        so the new ones take no more than measured.

        The largest size runs once uncaptured first, on the new cache: should anything
        differ for it (a Dynamo guard, a Triton specialisation), the recompile happens
        there and not inside a capture, where it would fail. So does every size not
        captured before: a size's launch may be a Triton variant of its own (e.g. split
        partials whose sum buffer is not 16-byte aligned at that size), compiled in its
        warm-up, never inside the capture."""
        if self.full_graphs is None or not self.full_graphs.graphs:
            return
        sizes = sorted(self.stats.full_graph_sizes or self.full_graphs.sizes, reverse=True)
        ran_before = set(self.full_graphs.sizes)
        self.full_graphs.clear()
        on_cuda = isinstance(self._graph_state.capturer, CudaGraphCapturer)
        free_before = self._free_device_memory(on_cuda)
        start = time.perf_counter()
        with torch.inference_mode(), self._capture_stream.current(), \
                graph_capture("full cuda graph recapture"):
            for size in sizes:
                self._capture_full(size, full_forward,
                                   warm_up=size == sizes[0] or size not in ran_before)
        self.stats.capture_time_s += time.perf_counter() - start
        if on_cuda and self._full_graphs_estimate:
            # What the full graphs took (the one measured before was dropped first),
            # against what the KV cache was sized to leave them.
            taken = max(free_before - self._free_device_memory(on_cuda), 0)
            estimate = self._full_graphs_estimate
            log = logger.warning if taken > max(2 * estimate, estimate + 2**26) else logger.info
            log("%d full graphs took %.0f MiB on the KV cache (%.0f MiB left for them)",
                len(sizes), taken / 2**20, estimate / 2**20)

    def _capture_full(self, size: int, full_forward: FullForward, warm_up: bool,
                      measure: bool = False) -> int:
        """Capture the full graph of `size`; with `measure` (CUDA), returns the device
        memory its capture took outside torch's allocator (the graph's own: its nodes
        and their parameters), else 0."""
        assert self.full_graphs is not None and self._graph_state is not None
        fn, inputs = full_forward(size, True)
        with self._graph_state.whole_forward():
            if warm_up:  # Triton compiles the decode-shaped attention launch here
                fn()
            if not measure:
                self.full_graphs.capture(size, fn, inputs)
                return 0
            torch.cuda.synchronize(self.device)
            free, reserved = torch.cuda.mem_get_info(self.device)[0], \
                torch.cuda.memory_reserved(self.device)
            self.full_graphs.capture(size, fn, inputs)
            torch.cuda.synchronize(self.device)
            grown = free - torch.cuda.mem_get_info(self.device)[0]
            return max(grown - (torch.cuda.memory_reserved(self.device) - reserved), 0)

    def _free_device_memory(self, on_cuda: bool) -> int:
        if not on_cuda:
            return 0
        torch.cuda.synchronize(self.device)
        # Drop cached-but-unused blocks of the ordinary pool (warm-up activations), so
        # the difference measures the graph pool and the graphs themselves.
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)[0]

