"""Inductor's compile workers, started a trace ahead of the compile that needs them.

On CUDA, Inductor compiles a piece's Triton kernels in a pool of worker processes, but
only once that pool answers: until then it compiles them one after another in this
process (`AsyncCompile.use_process_pool`). The pool is slow to start: a side process
imports torch, then forks the workers. `torch.compile(backend="inductor")` starts it when
the backend is looked up, long before the first kernel; llmfast's backend is its own
(compile/backend.py), so nothing started it early, and a cold start's first kernels
were compiled serially while the pool came up beside them.

`start_compile_workers` starts it now (Inductor's own `maybe_warm_pool`: it honours
`TORCH_WARM_POOL=0` and `TORCHINDUCTOR_COMPILE_THREADS=1`). The runner's model is built,
profiled and then traced: the pool comes up during that. A warm start that loads the
precompiled model (compile/precompiled.py) compiles nothing, so the pool is started
only where a trace is coming: `trace_expected` at construction, and the trace itself
starts it in any case (`CompiledModel._first_call`). The CPU path compiles C++ in
threads, not in this pool: nothing to start there.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def trace_expected(precompiled_root: Path | None) -> bool:
    """Whether the first call will trace: nothing saved under the precompiled root (the
    directory whose subdirectories are saved models, one per fingerprint), or no root
    (precompiling off). A saved model of another fingerprint still traces; that start
    finds out at its first call."""
    if precompiled_root is None:
        return True
    try:
        return not any(p.is_dir() for p in precompiled_root.iterdir())
    except OSError:  # no such directory (yet), or unreadable: nothing to load
        return True


def start_compile_workers(device: torch.device) -> bool:
    """Start Inductor's Triton compile workers if `device` compiles Triton through them
    (CUDA); returns whether they were asked to start. Idempotent: the pool is one per
    process."""
    if device.type != "cuda":
        return False
    try:
        from torch._inductor.async_compile import maybe_warm_pool
    except ImportError:  # a torch without it: the pool starts at the first kernel
        return False
    try:
        maybe_warm_pool()
    except Exception as exc:  # noqa: BLE001 - a pool that fails to start is Inductor's to handle
        logger.warning("could not start Inductor's compile workers early: %s", exc)
        return False
    return True
