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
- the full graphs' uniform decode batch at the largest full size.
A decode launch's tiles do not depend on its batch, nor a prefill's beyond its class (one
request or several: kernels/attention_config.py), so these cover every size. The
compiled model's norms are Inductor's copies of the kernels (its compile workers'
business: compile/workers.py).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from llmfast.kernels.launch.precompile import KernelPrecompiler
from llmfast.worker.startup.memory_profile import bind_one_block_caches, profile_batch

if TYPE_CHECKING:
    from llmfast.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def dry_batches(runner: ModelRunner) -> list[tuple[torch.Tensor, torch.Tensor, object]]:
    """(input ids, positions, metadata) of each dry forward (module docstring)."""
    ids, positions, md, _ = profile_batch(runner.max_num_tokens, runner.max_num_reqs,
                                          runner.block_size, runner.device,
                                          runner.max_model_len)
    batches = [(ids, positions, md)]
    compiled, capture = runner.compiled, runner.capture_inputs
    piecewise = compiled.piecewise_capture_sizes or compiled.capture_sizes
    # Eager (no graphs): the first steps at those sizes launch the same variants.
    sizes = sorted({1, 2, max(piecewise, default=runner.max_num_tokens)})
    batches += [capture.dummy_batch(n) for n in sizes if n <= runner.max_num_tokens]
    full = compiled.capture_sizes if compiled.full_graphs is not None else ()
    largest_full = max((s for s in full if s <= runner.max_num_reqs),
                       default=min(runner.max_num_reqs, runner.max_num_tokens))
    batches.append(capture.full_batch(largest_full, dummy=True))
    return batches


def precompile_kernels(runner: ModelRunner) -> int | None:
    """Compile every variant the dry forwards launch, in threads, and wait for them;
    returns how many, or None where Triton has no asynchronous compile. Leaves one-block
    KV caches bound.

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
    bind_one_block_caches(runner.model, runner.block_size, runner.kv_dtype, runner.device)
    try:
        with torch.inference_mode(), precompiler.dry_launches():
            for ids, positions, md in dry_batches(runner):
                runner.model(ids, positions, md)
    finally:
        submitted = time.perf_counter() - start
        waited = precompiler.wait()
    if runner.device.type == "cuda":
        # The dry forwards' activations (the largest step's), cached by the allocator:
        # given back before anything is sized (the memory profile does so too, but a
        # configured block count skips it).
        torch.cuda.empty_cache()
    logger.info("compiled %d Triton variants and built %d launchers in threads (%d dry "
                "launches, %.2f s, of which %.2f s waiting)", precompiler.num_submitted,
                precompiler.launchers_built, precompiler.dry_launch_count,
                submitted + waited, waited)
    return precompiler.num_submitted
