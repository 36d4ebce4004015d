"""The Dynamo backend: split the model's FX graph at every attention op, compile the
pieces between with Inductor, leave the attention calls as they are.

Why split: the attention op reads per-step metadata (block tables, sequence lengths) and
its cost depends on the context, not only on the token count, so it stays eager (and
out of CUDA graphs), while everything between two attention calls depends only on the
token count and is fused by Inductor and replayed as a CUDA graph per padded size.

    gm (one Dynamo graph, token dim unbacked)
      └─ split_module(keep_original_order=True)
           submod_0  embed, norm, qkv, rope        -> Inductor (-> CUDA graphs)
           submod_1  llmfast::unified_attention    -> as is
           submod_2  o_proj, mlp, next layer's qkv -> Inductor
           ...
           submod_2L final norm                    -> Inductor

Each piece is compiled on fake inputs made from the tracing context's fake mode, so
its input shapes carry the same unbacked symbols as the whole graph: one compile
serves every token count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from llmfast.compile import precompiled
from llmfast.compile.cache import cache_counters, inductor_cache
from llmfast.compile.precompiled import PieceRecord
from llmfast.compile.stats import CompileStats
from llmfast.cuda_graphs.piecewise import PieceWrapper, data_arg_indices, token_arg_index

logger = logging.getLogger(__name__)

def resolve_splitting_ops(names: Iterable[str]) -> set[Any]:
    """Op names like "llmfast::unified_attention" -> every object Dynamo may record for
    them: the overload packet and each of its overloads (`.default`, ...)."""
    targets: set[Any] = set()
    for name in names:
        namespace, _, op_name = name.partition("::")
        if not op_name:
            raise ValueError(f"splitting op {name!r} is not of the form 'namespace::op'")
        try:
            packet = getattr(getattr(torch.ops, namespace), op_name)
        except (AttributeError, RuntimeError):
            raise ValueError(f"splitting op {name!r} is not a registered torch op") from None
        targets.add(packet)
        targets.update(getattr(packet, overload) for overload in packet.overloads())
    return targets


def is_splitting_node(node: fx.Node, targets: set[Any]) -> bool:
    return node.op == "call_function" and node.target in targets


def split_graph(gm: fx.GraphModule, targets: set[Any]) -> tuple[fx.GraphModule, list[str]]:
    """Split `gm` so that each splitting op sits alone in its own submodule.

    Returns the split module and, per submodule `submod_i` in call order, its kind:
    "split" (a splitting op, left as is) or "compiled".
    """
    partition: dict[fx.Node, int] = {}
    current = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_splitting_node(node, targets):
            current += 1
            partition[node] = current
            current += 1
        else:
            partition[node] = current
    # keep_original_order: without it split_module may hoist nodes across the
    # (side-effecting) attention call, e.g. read `out` before attention wrote it.
    split = split_module(gm, gm, lambda node: partition[node], keep_original_order=True)
    return split, piece_kinds(split, targets)


def _submodules(split: fx.GraphModule) -> list[str]:
    """The split graph's submodule targets, in call order."""
    return [str(n.target) for n in split.graph.nodes if n.op == "call_module"]


def piece_kinds(split: fx.GraphModule, targets: set[Any]) -> list[str]:
    """Per submodule of a split graph, in call order: "split" where it holds a
    splitting op (split_graph gives each one a submodule of its own), else "compiled".
    Read from the graphs, so a warm start's loaded split graph has them too."""
    return ["split" if any(is_splitting_node(n, targets) for n in getattr(split, m).graph.nodes)
            else "compiled" for m in _submodules(split)]


def _compile_with_inductor(piece: fx.GraphModule, fake_args: list[Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(piece, fake_args)


def _compile_eager(piece: fx.GraphModule, fake_args: list[Any]) -> Callable[..., Any]:
    return piece.forward


def _compile_to_artifact(piece: fx.GraphModule, fake_args: list[Any]) -> Callable[..., Any]:
    """Inductor, keeping what it compiled as an artifact a later process can load
    (compile/precompiled.py). Same Inductor settings as `_compile_with_inductor`:
    standalone_compile would autotune Triton kernels at compile time, on the unbacked
    token count's fallback size; left to the first call, as in a plain compile."""
    from torch._inductor import standalone_compile

    try:
        return standalone_compile(
            piece, fake_args, dynamic_shapes="from_tracing_context",
            options={"config_patches": {"triton.autotune_at_compile_time": False}})
    except Exception as exc:  # noqa: BLE001 - not saved then; compiled all the same
        logger.warning("standalone_compile failed (%s): compiling without an artifact", exc)
        return _compile_with_inductor(piece, fake_args)


def _call_impls_directly(piece: fx.GraphModule) -> None:
    """Retarget a splitting op's node at the op's Python implementation, where it has one
    (`llmfast.attention.ops.direct_impl`): the split graph runs as plain Python, so the
    op's dispatch wrappers are pure overhead there."""
    from llmfast.attention.ops import direct_impl

    changed = False
    for node in piece.graph.nodes:
        impl = direct_impl(node.target) if node.op == "call_function" else None
        if impl is not None:
            node.target = impl
            changed = True
    if changed:
        piece.recompile()


def piece_signature(piece: fx.GraphModule, args: Sequence[Any]) -> str | None:
    """What a piece computes, independent of its node names: each node's op, target and
    arguments (by position), plus the shapes, strides and dtypes of the inputs. Two
    pieces with one signature compute the same function of their inputs (the decoder
    layers of a model: their weights are inputs too), so one compiled callable serves
    both. None for a piece that reads module attributes (get_attr, call_module): its
    result would depend on more than its inputs.

    Worked example: layer 3's piece `mm(arg0, t(arg1))` and layer 4's
    `mm(x_4, t(w_4))` both read as `call_function aten.mm ((%0, %2),)` after
    `call_function aten.t ((%1,),)`: one signature, one compile."""
    index: dict[fx.Node, int] = {}
    parts = []
    for i, node in enumerate(piece.graph.nodes):
        if node.op in ("get_attr", "call_module"):
            return None
        index[node] = i
        if node.op == "placeholder":
            parts.append("placeholder")
            continue
        operands = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        parts.append(f"{node.op} {node.target} {operands!r}")
    for a in args:
        if isinstance(a, torch.Tensor):
            parts.append(f"{tuple(a.shape)} {a.stride()} {a.dtype} {a.device.type}")
        else:
            parts.append(repr(a))
    return "\n".join(parts)


def traced_piece_args(piece: fx.GraphModule) -> list[Any] | None:
    """The fake values Dynamo recorded for a piece's inputs while tracing, in call order,
    or None where one is missing (a graph that did not come from Dynamo).

    `split_module` copies each input node's `meta` onto the piece's placeholder, and
    Dynamo's `example_value` is the fake tensor (or SymInt) it propagated through that
    node in the tracing context's fake mode: the same shapes, strides and unbacked
    symbols as re-running the split graph on fake inputs would give, without running
    every piece's ops through the fake mode once more (on a warm start, most of the
    backend's time outside Inductor: profiles/startup.md)."""
    args = []
    for node in piece.graph.nodes:
        if node.op != "placeholder":
            continue
        value = node.meta.get("example_value")
        if value is None:
            return None
        args.append(value)
    return args


class _PieceCompiler(fx.Interpreter):
    """Compiles each submodule of the split graph (unless it is a splitting op) with the
    fake arguments that reach it. A piece with the signature of one compiled before
    reuses its compiled callable (`piece_signature`): a warm start then makes a handful
    of cache lookups instead of one per layer.

    `compile_all` takes the arguments from Dynamo's trace (`traced_piece_args`) where
    every piece has them, and otherwise runs the split graph on fake inputs as an
    `fx.Interpreter`, compiling at each submodule call."""

    def __init__(self, split: fx.GraphModule, kinds: list[str],
                 compile_piece: Callable[[fx.GraphModule, list[Any]], Callable[..., Any]],
                 wrap_piece: PieceWrapper | None) -> None:
        super().__init__(split)
        self.kinds = dict(zip(_submodules(split), kinds))
        self.compile_piece = compile_piece
        self.wrap_piece = wrap_piece
        self.num_compiled = 0
        self.num_shared = 0  # pieces that reused another piece's compiled callable
        self.used_traced_args = False
        self.compiled_fns: list[Callable[..., Any]] = []  # one per distinct piece
        self.pieces: list[PieceRecord] = []  # per compiled piece, in call order
        self._by_signature: dict[str, int] = {}  # -> index into compiled_fns

    def compile_all(self, fake_args: Sequence[Any]) -> None:
        targets = _submodules(self.module)
        traced = [traced_piece_args(self.fetch_attr(t)) for t in targets]
        if all(args is not None for args in traced):
            self.used_traced_args = True
            for target, args in zip(targets, traced):
                # Generate the piece's code now, as its first call did on the fake
                # inputs: AOTAutograd's cache key pickles the module's __dict__, whose
                # order (`_code` before the attributes compiling adds) is part of it.
                # Same order, same keys: caches written by either path keep hitting.
                _ = self.fetch_attr(target).code
                self._compile_submodule(target, args)
        else:
            self.run(*fake_args)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        assert not kwargs, "split_module passes positional arguments only"
        out = self.fetch_attr(target)(*args)  # fake propagation, to reach the next piece
        self._compile_submodule(target, list(args))
        return out

    def _compile_submodule(self, target: str, args: list[Any]) -> None:
        submod = self.fetch_attr(target)
        if self.kinds[target] == "split":
            _install_splitting_op(self.module, target)
            return
        signature = piece_signature(submod, args)
        unique = self._by_signature.get(signature) if signature is not None else None
        if unique is None:
            unique = len(self.compiled_fns)
            self.compiled_fns.append(self.compile_piece(submod, args))
            if signature is not None:
                self._by_signature[signature] = unique
        else:
            self.num_shared += 1
        fn = self.compiled_fns[unique]
        data_args = data_arg_indices(submod)
        token_index = token_arg_index(args, data_args)
        self.pieces.append(PieceRecord(unique, token_index))
        if self.wrap_piece is not None:
            fn = self.wrap_piece(self.num_compiled, fn, token_index, data_args)
        # An instance attribute shadows the submodule: the split graph's
        # `self.submod_i(...)` now calls the compiled piece.
        self.module.__dict__[target] = fn
        self.num_compiled += 1


def _install_splitting_op(split: fx.GraphModule, target: str) -> None:
    """Make the split graph call a splitting op's submodule as cheaply as possible."""
    submod = getattr(split, target)
    _call_impls_directly(submod)
    # Generate the code first: until then a lazy GraphModule's `forward` is
    # `_lazy_forward`, which, bound here, would re-enter nn.Module.__call__ on every
    # call. (Dynamo later marks the submodules lazy again when it recompiles the split
    # graph; their graphs do not change, so the bound code stays theirs.)
    _ = submod.code
    # Call the generated forward directly: skips nn.Module.__call__ (hooks, ~10 us per
    # call, 30 times per step on SmolLM2).
    split.__dict__[target] = submod.forward


def _as_piece_returns(piece: fx.GraphModule, fn: Callable[..., Any]) -> Callable[..., Any]:
    """A loaded artifact returns a flat list of outputs (Inductor compiles every graph
    to one); the split graph expects what the piece returns: unflatten where that is
    not already a flat tuple (a piece returning a single tensor)."""
    from torch.utils import _pytree as pytree

    returned = next(n for n in reversed(piece.graph.nodes) if n.op == "output").args[0]
    if isinstance(returned, (tuple, list)) and all(isinstance(x, fx.Node) for x in returned):
        return fn
    if isinstance(returned, fx.Node):  # the common case: one value, no pytree per call

        def first(*args: Any) -> Any:
            return fn(*args)[0]

        return first
    _, spec = pytree.tree_flatten(returned)

    def call(*args: Any) -> Any:
        return pytree.tree_unflatten(list(fn(*args)), spec)

    return call


def assemble_split_graph(split: fx.GraphModule, targets: set[Any],
                         compiled_fns: Sequence[Any], pieces: Sequence[PieceRecord],
                         wrap_piece: PieceWrapper | None, stats: CompileStats) -> fx.GraphModule:
    """`split` (a split graph as `split_graph` made it, nothing compiled) with the
    compiled callables a warm start loaded (compile/precompiled.py) installed: what the
    backend returns to Dynamo, built without Dynamo."""
    modules = _submodules(split)
    kinds = piece_kinds(split, targets)
    compiled_targets = [m for m, kind in zip(modules, kinds) if kind == "compiled"]
    if len(compiled_targets) != len(pieces):
        raise ValueError(f"{len(compiled_targets)} pieces in the graph, {len(pieces)} saved")
    stats.record_pieces(kinds, num_shared=len(pieces) - len(compiled_fns))
    for target, kind in zip(modules, kinds):
        if kind == "split":
            _install_splitting_op(split, target)
    for index, (target, record) in enumerate(zip(compiled_targets, pieces)):
        submod = getattr(split, target)
        fn = _as_piece_returns(submod, compiled_fns[record.artifact])
        if wrap_piece is not None:
            fn = wrap_piece(index, fn, record.token_index, data_arg_indices(submod))
        split.__dict__[target] = fn
    return split


class PiecewiseBackend:
    """`torch.compile(model, backend=PiecewiseBackend(...), fullgraph=True)`.

    piece_compiler: "inductor", or "eager" (pieces run as plain FX code; for tests of
    the splitting and of the CUDA-graph wrapper without paying for Inductor).
    cache_dir: Inductor's cache directory while compiling; None disables its caches.
    keep_artifacts: compile each piece into an artifact a later process can load (one
    set of Inductor cache entries whether or not a start saves), and keep what a save
    needs in `last_trace` (compile/precompiled.py) while `keep_trace`.
    """

    def __init__(
        self,
        splitting_ops: Iterable[str],
        stats: CompileStats,
        cache_dir: Path | None = None,
        piece_compiler: str = "inductor",
        wrap_piece: PieceWrapper | None = None,
        keep_artifacts: bool = False,
    ) -> None:
        if piece_compiler not in ("inductor", "eager"):
            raise ValueError(f"piece_compiler must be 'inductor' or 'eager', not {piece_compiler!r}")
        self.targets = resolve_splitting_ops(splitting_ops)
        self.stats = stats
        self.cache_dir = cache_dir
        self.piece_compiler = piece_compiler
        self.wrap_piece = wrap_piece
        self.keep_artifacts = keep_artifacts and piece_compiler == "inductor"
        # Whether the next compile keeps `last_trace` (the owner turns it off after its
        # first call: recompiles are not saved, and hold nothing).
        self.keep_trace = self.keep_artifacts
        self.split_gm: fx.GraphModule | None = None  # the last split graph, for inspection
        # (Dynamo's graph, its real example inputs, the pickled split graph, the piece
        # records, the compiled artifacts) of the last compile while `keep_trace`; the
        # owner drops it once saved.
        self.last_trace: tuple[fx.GraphModule, list[Any], bytes, list[PieceRecord],
                               list[Any]] | None = None

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        from torch._guards import detect_fake_mode

        start = time.perf_counter()
        before = cache_counters()
        split, kinds = split_graph(gm, self.targets)
        # Pickled before the compile installs callables (and retargets the attention
        # nodes) in it: what a warm start rebuilds the same split graph from.
        split_bytes = precompiled.dump_graph(split) if self.keep_trace else None
        # The tracing context's fake mode memoises how Dynamo fakified each real input,
        # so `from_tensor` returns tensors with the graph's own (unbacked) symbols.
        fake_mode = detect_fake_mode(example_inputs)
        if fake_mode is None:
            raise RuntimeError("PiecewiseBackend must be called by Dynamo (no fake mode found)")
        fake_args = [
            fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs
        ]
        compile_piece = (_compile_eager if self.piece_compiler == "eager"
                         else _compile_to_artifact if self.keep_artifacts
                         else _compile_with_inductor)
        compiler = _PieceCompiler(split, kinds, compile_piece, self.wrap_piece)
        with inductor_cache(self.cache_dir), fake_mode:
            compiler.compile_all(fake_args)
        after = cache_counters()

        stats = self.stats
        stats.num_dynamo_graphs += 1
        stats.record_pieces(kinds, num_shared=compiler.num_shared)
        stats.compile_time_s += time.perf_counter() - start
        stats.cache_dir = str(self.cache_dir) if self.cache_dir is not None else None
        stats.cache_hits += after["fx_hits"] - before["fx_hits"] + after["aot_hits"] - before["aot_hits"]
        stats.cache_misses += (
            after["fx_misses"] - before["fx_misses"] + after["aot_misses"] - before["aot_misses"]
        )
        if stats.num_dynamo_graphs > 1:
            logger.warning("torch.compile recompiled the model (%d graphs): a guard failed",
                           stats.num_dynamo_graphs)
        logger.info("compiled with %s: %s", self.piece_compiler, stats.summary())
        self.split_gm = split
        if split_bytes is not None:  # keep_trace
            self.last_trace = (gm, list(example_inputs), split_bytes, compiler.pieces,
                               compiler.compiled_fns)
        return split.forward
