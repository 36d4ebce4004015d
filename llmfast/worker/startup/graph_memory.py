"""What the CUDA graphs will take, estimated before the KV cache is sized: the graphs
are captured once, after the cache is allocated (they read it), so their memory must be
set aside from a measurement made without capturing.

Two parts:
- the shared pool: every graph allocates its activations from one private pool,
  largest size first, and the smaller sizes reuse that memory (cuda_graphs/piecewise.py),
  so it holds about one forward's activations at the largest piecewise size and one
  whole forward with its logits at the largest full size. Measured here by running the
  eager model at those sizes on the one-block scratch caches: the eager forward keeps
  more alive than the compiled pieces do, so the estimate errs on the large side, and
  the two are added rather than overlapped, for the same reason.
- each graph's own structures (its nodes and their parameters), which the driver holds
  outside torch's allocator: `GRAPH_OBJECT_BYTES` a graph. On an H100 a full graph of
  a 16-layer model took ~0.5 MiB; a piecewise graph (one piece: a few kernels) less.

After the capture the runner logs what the graphs took against this estimate.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llmfast.cuda_graphs.model_graphs import ModelCudaGraphs
from llmfast.models.decoder import DecoderForCausalLM
from llmfast.worker.startup.graph_capture import CaptureInputs

GRAPH_OBJECT_BYTES = 2**19


def estimate_graph_memory(model: DecoderForCausalLM, capture: CaptureInputs,
                          graphs: ModelCudaGraphs, device: torch.device) -> int:
    """Bytes to leave free for `graphs`' capture (module doc); 0 without graphs or off
    CUDA. The model must have its (one-block) scratch caches bound."""
    if not graphs.enabled or device.type != "cuda":
        return 0
    piecewise = graphs.dispatcher.piecewise_sizes
    full = graphs.dispatcher.full_sizes if graphs.full is not None else ()
    pool = 0
    with torch.inference_mode():
        if piecewise:
            batch = capture.dummy_batch(max(piecewise))
            pool += _peak_bytes(lambda: model(*batch), device)
        if full:
            ids, positions, md = capture.full_batch(max(full), dummy=True)
            pool += _peak_bytes(lambda: model.compute_logits(model(ids, positions, md)),
                                device)
    num_pieces = len(model.attention_layers()) + 1  # split at every attention call
    num_graphs = num_pieces * len(piecewise) + len(full)
    return pool + num_graphs * GRAPH_OBJECT_BYTES


def _peak_bytes(forward: Callable[[], object], device: torch.device) -> int:
    """Device memory `forward` allocates at its peak beyond what was allocated before."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    torch.cuda.empty_cache()
    return max(peak, 0)
