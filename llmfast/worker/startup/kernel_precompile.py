"""The start-up's dry forwards: the Triton variants that the start-up and the first steps
will launch, compiled in threads, all at once, before the first of them is launched
(kernels/launch/precompile.py).

The eager model runs each batch below with its kernel launches dry (each submits its
variant's compile; nothing else of the forward is skipped, so every launch sees the
arguments, and hence the variant, that the real one will):
- the memory profile's batch (several requests, prefill: the mixed launch with its
  decode region, RoPE + KV write, the norms);
- the capture's dummy batches (one request of n tokens): n = 1 is a uniform decode
  (the fused decode + RoPE kernel), n = 2 decode-like (the unified kernel's decode
  tiles), the largest piecewise size a one-request prefill;
- the full graphs' uniform decode batch at the largest full size;
- the projections routed to the GEMV, alone, at each M bucket of the decode sizes
  (gemv_routing.dry_gemv_launches; the forwards above reach only 1 and 2 rows).
A decode launch's tiles do not depend on its batch, nor a prefill's beyond its class (one
request or several: attention/triton/launch_config.py), so these cover every size. The
compiled model's norms are Inductor's copies of the kernels (its compile workers'
business: compile/workers.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from llmfast.attention.metadata import AttentionMetadata
from llmfast.kernels.launch.precompile import KernelPrecompiler
from llmfast.models.decoder import DecoderForCausalLM
from llmfast.worker.startup.gemv_routing import dry_gemv_launches
from llmfast.worker.startup.graph_capture import CaptureInputs
from llmfast.worker.startup.memory_profile import bind_one_block_caches, profile_batch

logger = logging.getLogger(__name__)

DryBatch = tuple[torch.Tensor, torch.Tensor, AttentionMetadata]


def dry_batches(capture: CaptureInputs, max_num_tokens: int, max_num_reqs: int,
                block_size: int, max_model_len: int | None, graph_sizes: Sequence[int],
                full_sizes: Sequence[int]) -> list[DryBatch]:
    """(input ids, positions, metadata) of each dry forward (module docstring), for a
    runner whose piecewise graphs (or, eager, its first steps) take `graph_sizes` and
    whose full graphs `full_sizes` (empty: none)."""
    device = capture.inputs.input_ids.gpu.device
    ids, positions, md, _ = profile_batch(max_num_tokens, max_num_reqs, block_size, device,
                                          max_model_len, capture.model.kv_groups.num_groups)
    batches = [(ids, positions, md)]
    # Eager (no graphs): the first steps at those sizes launch the same variants.
    sizes = sorted({1, 2, max(graph_sizes, default=max_num_tokens)})
    batches += [capture.dummy_batch(n) for n in sizes if n <= max_num_tokens]
    largest_full = max((s for s in full_sizes if s <= max_num_reqs),
                       default=min(max_num_reqs, max_num_tokens))
    batches.append(capture.full_batch(largest_full, dummy=True))
    return batches


def precompile_kernels(model: DecoderForCausalLM, batches: Sequence[DryBatch],
                       block_size: int, kv_dtype: torch.dtype, device: torch.device,
                       gemv: Sequence[tuple[DecoderForCausalLM, Sequence[int]]] = ()
                       ) -> int | None:
    """Compile every variant the dry forwards of `batches` launch, in threads, and wait
    for them; returns how many, or None where Triton has no asynchronous compile. Leaves
    one-block KV caches bound. `gemv`: (model, row counts) whose routed projections'
    GEMV variants are compiled too, at every M bucket (gemv_routing.dry_gemv_launches:
    the target's at its full graphs' sizes, a draft model's).

    The wait comes at once rather than at each variant's first launch: Triton 3.6 keeps
    a submitted compile out of the kernel's cache until it is finalized (3.7 puts its
    future there), so a launch before that would compile its variant again; and the
    threads have the GIL to themselves while this one waits. The variants' launchers
    are built in the threads too (Triton 3.6: a C compile per variant otherwise, at its
    first launch)."""
    precompiler = KernelPrecompiler()
    if not precompiler.available:
        return None
    start = time.perf_counter()
    bind_one_block_caches(model, block_size, kv_dtype, device)
    try:
        with torch.inference_mode(), precompiler.dry_launches():
            for ids, positions, md in batches:
                model(ids, positions, md)
            for routed, rows in gemv:
                dry_gemv_launches(routed, rows)
    finally:
        submitted = time.perf_counter() - start
        waited = precompiler.wait()
    if device.type == "cuda":
        # The dry forwards' activations (the largest step's), cached by the allocator:
        # given back before anything is sized (the memory profile does so too, but a
        # configured block count skips it).
        torch.cuda.empty_cache()
    logger.info("compiled %d Triton variants and built %d launchers in threads (%d dry "
                "launches, %.2f s, of which %.2f s waiting)", precompiler.num_submitted,
                precompiler.launchers_built, precompiler.dry_launch_count,
                submitted + waited, waited)
    return precompiler.num_submitted
