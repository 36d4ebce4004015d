"""`CompiledModel`: what the runner calls instead of `model.forward`.

    compiled = CompiledModel(model, config.compile, device, graphs=graphs, stats=stats)
    hidden = compiled(input_ids[:n_pad], positions[:n_pad], attn_metadata)
    compiled.stats                                 # pieces, times, cache hits, graphs

Modes, from `CompileConfig`: eager (`enforce_eager`: the model as is); compiled
(torch.compile with the piecewise backend). The CUDA graphs are not this module's: the
backend hands each compiled piece to `graphs.wrap_piece` (llmfast/cuda_graphs/), which
captures and replays it; this module traces (or, on a warm start, loads what a cold
start traced: compile/precompiled.py) and falls back to Dynamo when a loaded model does
not fit a call.

The token dimension of the inputs, the request dimension of the metadata and the block
dimension of the KV caches are marked unbacked before the first call, so one graph
serves every step and the KV cache may be re-bound (e.g. from the profiling scratch
cache to the real one) without a recompile.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from llmfast.attention.metadata import EAGER_ONLY, AttentionMetadata
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
from llmfast.config import CompileConfig
from llmfast.cuda_graphs.model_graphs import ModelCudaGraphs
from llmfast.cuda_graphs.piecewise import GraphCaptureState
from llmfast.kernels.layers.triton_ops import register_triton_ops

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


class CompiledModel:
    """graphs: the model's CUDA graphs, whose piece wrapper the backend applies (None:
    none). stats: where the figures go (shared with `graphs`). piece_compiler:
    "inductor" or "eager" (tests). precompile: save the first trace for the next start
    and load a saved one (compile/precompiled.py; with the compile cache on, unless
    LLMFAST_PRECOMPILED=0)."""

    def __init__(
        self,
        model: nn.Module,
        config: CompileConfig,
        device: torch.device | str,
        *,
        graphs: ModelCudaGraphs | None = None,
        stats: CompileStats | None = None,
        piece_compiler: str = "inductor",
        precompile: bool = True,
    ) -> None:
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.stats = stats if stats is not None else CompileStats()
        self.graphs = graphs
        self.eager = config.enforce_eager
        self._started = False  # the first call (which traces or loads) has happened
        self._cache_dir: Path | None = None
        # Where a warm start skips Dynamo: <compile cache>/precompiled, then (first call)
        # its subdirectory for this model's fingerprint.
        self._precompiled_dir: Path | None = None
        if self.eager:
            self._forward: Callable[..., torch.Tensor] = model
            return
        self._wrap = graphs.wrap_piece if graphs is not None else None

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
        weakref.finalize(self, _release_graphs, self.backend,
                         graphs.piecewise if graphs is not None else None)

    # ------------------------------------------------------------------ per step

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metadata: AttentionMetadata) -> torch.Tensor:
        """[T] ids and positions -> [T, hidden] (T already padded by the caller).

        Under CUDA graphs the result lives in the graph pool: use it before the next
        call (the runner does: it samples before the next step's forward)."""
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
                                if getattr(md, f.name) is None
                                and not f.metadata.get(EAGER_ONLY))
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
        lost = self.graphs.num_piecewise_graphs if self.graphs is not None else 0
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
        if self.graphs is not None:
            self.graphs.drop_piece_runners()

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
        for slots in md.group_slot_mappings or ():  # several KV-cache groups
            _mark_unbacked(slots, 0, "num_tokens")
        for table in md.group_block_tables or ():
            _mark_unbacked(table, 0, "num_reqs")
            _mark_unbacked(table, 1, None)
        layers = getattr(self.model, "attention_layers", None)
        for layer in layers() if layers is not None else ():
            _mark_unbacked(layer.k_cache, 0, "num_blocks")
            _mark_unbacked(layer.v_cache, 0, "num_blocks")
