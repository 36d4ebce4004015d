"""Capture and replay behind one interface: real CUDA graphs, or a CPU stand-in with
their semantics for tests. Both keep what replays return at fixed addresses; the real
one keeps it as non-owning views into its pool (piecewise.py explains why that is safe).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def weak_ref(t: Any) -> Any:
    """A tensor viewing `t`'s memory without owning it (non-tensors pass through).

    The memory stays valid while the graph pool holds it; see the module docstring.
    """
    if not isinstance(t, torch.Tensor):
        return t
    storage = t.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), t.device, storage.nbytes()
    )
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        alias, t.storage_offset(), t.size(), t.stride()
    )


def _map_outputs(out: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(out, (list, tuple)):
        return type(out)(fn(x) for x in out)
    return fn(out)


class CudaGraphCapturer:
    """Captures with `torch.cuda.CUDAGraph` into one pool shared by all pieces/sizes."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Callable[[], None], Any]:
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than `with torch.cuda.graph(...)`: the context
        # manager runs gc.collect() and empty_cache() per capture (hundreds of times).
        # The caller has already made a side stream current (capture needs one).
        # Thread-local: a CUDA call another thread of the process makes meanwhile (the
        # engine loads its tokenizer in one during start-up) is not this capture's
        # concern; in the default global mode an unsafe one would fail the capture.
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        try:
            out = fn(*args)
        finally:
            graph.capture_end()
        return graph.replay, out

    def static_outputs(self, outputs: Any) -> Any:
        """What replays return: weak views of the capture's outputs (see module doc)."""
        return _map_outputs(outputs, weak_ref)


class EmulatedGraphCapturer:
    """CPU stand-in with CUDA-graph semantics, for testing the capture bookkeeping and
    the runner's use of static buffers without a GPU: "capture" runs the piece once and
    keeps its outputs; "replay" reruns it on the capture-time arguments and copies the
    results into those same outputs (static output addresses, like a real graph)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def capture(self, fn: Callable[..., Any], args: Sequence[Any]) -> tuple[Callable[[], None], Any]:
        captured_args = list(args)
        outputs = fn(*captured_args)

        def replay() -> None:
            fresh = fn(*captured_args)
            pairs = zip(outputs, fresh) if isinstance(outputs, (list, tuple)) else [(outputs, fresh)]
            for dst, src in pairs:
                if isinstance(dst, torch.Tensor):
                    dst.copy_(src)

        return replay, outputs

    def static_outputs(self, outputs: Any) -> Any:
        return outputs
