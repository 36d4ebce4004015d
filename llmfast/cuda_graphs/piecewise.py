"""CUDA graphs for the compiled pieces: one graph per (piece, padded token count).

Protocol (driven by `ModelCudaGraphs.capture`, model_graphs.py): for each size, largest
first, the runner runs one dummy forward to warm up (lazy inits, Triton autotuning) and
then one inside `GraphCaptureState.capturing(size)`; during that forward each piece
captures its own graph instead of running. The attention calls between pieces run eagerly as always
(on not-yet-computed inputs: harmless, the dummy step writes no KV slot).

Memory: every graph of every piece and size allocates from one shared private pool.
Captured outputs are kept only as non-owning ("weak") tensors, so after a forward at
one size is captured its activations go back to the pool and the next (smaller) size
reuses them. This is safe because graphs never run concurrently and, within a forward,
piece i+1 was captured while piece i's outputs were still alive, so it never reuses
their memory. The price: a replayed piece's outputs are valid only until the next
replay of any graph — the runner consumes the hidden states before the next step.

Replay needs every input a piece reads at its capture-time address: the runner's
persistent buffers (input_ids, positions), the weights, and the previous piece's
(static) outputs. `check_static_addresses` verifies that on every replay (debug mode).
Dynamo also hands some pieces KV caches and metadata tensors, only to check their sizes
(`aten.sym_size` is their sole use): the graph never reads them, so they may move (a cache
bound after the capture) and are not checked.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from llmfast.cuda_graphs.capturers import CudaGraphCapturer, EmulatedGraphCapturer

logger = logging.getLogger(__name__)

# What the compile backend wraps each compiled piece with: (index among the compiled
# pieces, compiled callable, the position of its token-count argument (None: none), the
# positions of the arguments it reads as data) -> the callable the split graph will call
# instead, here a CUDA-graph runner around the piece (`GraphCaptureState.wrap`).
PieceWrapper = Callable[[int, Callable[..., Any], int | None, list[int]], Callable[..., Any]]

_SIZE_QUERIES = (
    torch.ops.aten.sym_size.int,
    torch.ops.aten.sym_stride.int,
    torch.ops.aten.sym_numel.default,
    torch.ops.aten.sym_storage_offset.default,
)


def data_arg_indices(piece: fx.GraphModule) -> list[int]:
    """Positions of the arguments whose data `piece` reads: every placeholder with a
    use other than a size query."""
    placeholders = [n for n in piece.graph.nodes if n.op == "placeholder"]
    return [i for i, node in enumerate(placeholders)
            if any(not (u.op == "call_function" and u.target in _SIZE_QUERIES)
                   for u in node.users)]


def token_arg_index(fake_args: Sequence[Any], data_args: Sequence[int]) -> int | None:
    """The first argument the piece reads whose leading dimension is symbolic: the
    token count. A non-attention piece reads per-token tensors (ids, positions, hidden
    states), weights (static shapes) and size symbols; the KV caches (leading dim: the
    block count) and request metadata reach it only for size checks, not as data.
    """
    for i in data_args:
        arg = fake_args[i]
        if isinstance(arg, torch.Tensor) and arg.dim() > 0 and isinstance(arg.shape[0], torch.SymInt):
            return i
    return None


@dataclass
class _Graph:
    replay: Callable[[], None]
    outputs: Any
    input_addresses: dict[int, int]  # argument position -> data_ptr at capture


class GraphCaptureState:
    """What all piece runners of one compiled model share: the capturer (pool) and which
    size, if any, is being captured right now."""

    def __init__(self, capturer: CudaGraphCapturer | EmulatedGraphCapturer,
                 check_static_addresses: bool = False) -> None:
        self.capturer = capturer
        self.check_static_addresses = check_static_addresses
        self.capturing_size: int | None = None
        # Set while a whole forward runs inside a full graph's warm-up, capture or (CPU
        # emulated) replay: the pieces then run directly, neither replaying nor capturing.
        self.in_full_graph = False
        self.num_graphs = 0
        self.num_replays = 0
        self.runners: list[PiecewiseGraphRunner] = []

    @contextlib.contextmanager
    def capturing(self, num_tokens: int) -> Iterator[None]:
        self.capturing_size = num_tokens
        try:
            yield
        finally:
            self.capturing_size = None
        missing = [r.index for r in self.runners if r.token_index is not None
                   and num_tokens not in r.graphs]
        if missing:
            raise RuntimeError(f"pieces {missing} were not captured at size {num_tokens}: "
                               "the dummy forward did not run at that size")

    @contextlib.contextmanager
    def whole_forward(self) -> Iterator[None]:
        previous, self.in_full_graph = self.in_full_graph, True
        try:
            yield
        finally:
            self.in_full_graph = previous

    def drop_runners(self) -> None:
        """Forget every piece runner and its graphs (a discarded model, or pieces
        replaced by others): what they hold returns to the pool."""
        for runner in self.runners:
            runner.graphs.clear()
        self.runners.clear()

    def wrap(self, index: int, fn: Callable[..., Any], token_index: int | None,
             data_args: Sequence[int]) -> Callable[..., Any]:
        """A `PieceWrapper` for `PiecewiseBackend` (`token_arg_index`, `data_arg_indices`)."""
        runner = PiecewiseGraphRunner(index, fn, token_index, data_args, self)
        self.runners.append(runner)
        return runner


class PiecewiseGraphRunner:
    """Calls one compiled piece: replays its graph for a captured size, captures when
    asked, runs it directly otherwise (sizes without a graph)."""

    def __init__(self, index: int, fn: Callable[..., Any], token_index: int | None,
                 data_args: Sequence[int], state: GraphCaptureState) -> None:
        self.index = index
        self.fn = fn
        self.token_index = token_index
        self.data_args = tuple(data_args)
        # Weak: the state lists its runners, and a strong cycle would outlive a discarded
        # engine (the engine gc.freeze()s what exists at start-up, so no collector pass
        # would ever free the cycle, nor the CUDA graphs and pool it holds).
        self._state = weakref.ref(state)
        self.graphs: dict[int, _Graph] = {}
        if token_index is None:
            logger.warning("piece %d has no token-sized input; it runs without CUDA graphs", index)

    @property
    def state(self) -> GraphCaptureState:
        state = self._state()
        if state is None:
            raise RuntimeError("the compiled model owning this graph runner is gone")
        return state

    def __call__(self, *args: Any) -> Any:
        if self.token_index is None or self.state.in_full_graph:
            return self.fn(*args)
        num_tokens = args[self.token_index].shape[0]
        graph = self.graphs.get(num_tokens)
        if graph is not None:
            if self.state.check_static_addresses:
                self._check_addresses(num_tokens, graph, args)
            graph.replay()
            self.state.num_replays += 1
            return graph.outputs
        if self.state.capturing_size == num_tokens:
            return self._capture(num_tokens, args)
        return self.fn(*args)

    def _capture(self, num_tokens: int, args: Sequence[Any]) -> Any:
        capturer = self.state.capturer
        replay, outputs = capturer.capture(self.fn, args)
        addresses = {i: args[i].data_ptr() for i in self.data_args
                     if isinstance(args[i], torch.Tensor)}
        self.graphs[num_tokens] = _Graph(replay, capturer.static_outputs(outputs), addresses)
        self.state.num_graphs += 1
        # Return the owning outputs: the rest of this capture forward holds them, so the
        # next pieces' captures cannot take their memory from the pool. They are freed
        # (back to the pool, for the next size) when the dummy forward ends.
        return outputs

    def _check_addresses(self, num_tokens: int, graph: _Graph, args: Sequence[Any]) -> None:
        for i, captured in graph.input_addresses.items():
            arg = args[i]
            if arg.data_ptr() != captured:
                raise AssertionError(
                    f"CUDA graph input moved: piece {self.index}, size {num_tokens}, argument "
                    f"{i} ({tuple(arg.shape)}) at {arg.data_ptr():#x}, captured at "
                    f"{captured:#x}; inputs must come from the persistent buffers"
                )
