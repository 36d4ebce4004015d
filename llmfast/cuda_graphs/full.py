"""Full CUDA graphs: one graph of the whole forward (embedding, every layer with its
attention and KV write, final norm, lm_head) per padded uniform-decode size.

The caller captures a closure that reads only persistent buffers: the runner's input
ids, positions, slot mapping, block table [max_num_reqs, max_blocks_per_req],
query_start_loc, seq_lens, the bound KV caches and the weights. The split-KV workspace
of the attention kernel is allocated during capture, so it lives in the graph pool at
an address the graph owns. Replay needs those buffers at their capture-time addresses;
`check_static_addresses` verifies that (debug mode), since a moved buffer would
otherwise be read stale, silently.

Like the piecewise graphs' outputs, a full graph's output (the logits) is kept as a
non-owning view into the pool: it is valid until the next replay of any graph, and the
next (smaller) capture may reuse its memory. Owning outputs would pin one
[size, vocab] float32 buffer per size: ~2 GB for the default sizes and a 128k vocab.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class _FullGraph:
    replay: Callable[[], None]
    output: torch.Tensor
    input_addresses: tuple[int, ...]


class FullGraphRunner:
    """Captures and replays whole-forward graphs, one per padded size, with a capturer
    from `capturers.py` (real CUDA graphs or the CPU emulation), so the pool is
    shared with the piecewise graphs."""

    def __init__(self, capturer, check_static_addresses: bool = False) -> None:
        self.capturer = capturer
        self.check_static_addresses = check_static_addresses
        # By BatchDescriptor.graph_key: a decode graph's size, a verify graph's (size,
        # query length).
        self.graphs: dict[int | tuple[int, int], _FullGraph] = {}
        self.num_replays = 0

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(k for k in self.graphs if isinstance(k, int)))

    def capture(self, size: int | tuple[int, int], fn: Callable[[], torch.Tensor],
                inputs: Sequence[torch.Tensor]) -> None:
        """Capture `fn()` (which must read `inputs` and nothing else per step) at `size`."""
        replay, output = self.capturer.capture(fn, ())
        self.graphs[size] = _FullGraph(replay, self.capturer.static_outputs(output),
                                       tuple(t.data_ptr() for t in inputs))

    def replay(self, size: int | tuple[int, int],
               inputs: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """Run the graph of `size` on the buffers' current contents; returns its output
        (valid until the next replay of any graph). `inputs`: what it reads, checked
        against the captured addresses in debug mode (else not looked at)."""
        graph = self.graphs[size]
        if self.check_static_addresses:
            for i, (t, captured) in enumerate(zip(inputs, graph.input_addresses, strict=True)):
                if t.data_ptr() != captured:
                    raise AssertionError(
                        f"full CUDA graph input moved: size {size}, input {i} "
                        f"({tuple(t.shape)}) at {t.data_ptr():#x}, captured at {captured:#x}; "
                        "inputs must come from the persistent buffers")
        graph.replay()
        self.num_replays += 1
        return graph.output

    def clear(self) -> None:
        """Drop every graph (their memory goes back to the shared pool)."""
        self.graphs.clear()
