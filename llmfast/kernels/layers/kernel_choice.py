"""Whether the decoder's norms and RoPE run llmfast's Triton kernels (the default) or
torch ops, and the kernels' module, imported on first use.

`LLMFAST_LAYER_KERNELS=0` selects torch ops everywhere (on CUDA Inductor then fuses them
as it can): a switch for comparing the two and for working around a kernel, read once
per process.

Both are plain module globals once set: Dynamo traces the triton ops' bodies that ask
(layers/triton_ops.py sets them before tracing), and reads a global as a constant where
a cached function's wrapper would be one more thing to trace.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from llmfast.kernels.launch import precompile
from llmfast.kernels.triton_mode import triton_interpret_enabled, use_triton

_ENABLED: bool | None = None
_KERNELS: ModuleType | None = None


def layer_kernels_enabled() -> bool:
    global _ENABLED
    if _ENABLED is None:
        _ENABLED = os.environ.get("LLMFAST_LAYER_KERNELS", "1") != "0"
    return _ENABLED


def layer_kernels() -> ModuleType:
    """llmfast.kernels.layers.triton_kernels (imports Triton: not before a kernel is needed)."""
    global _KERNELS
    if _KERNELS is None:
        from llmfast.kernels.layers import triton_kernels as module

        _KERNELS = module
    return _KERNELS


def takes_layer_kernels(x: torch.Tensor) -> bool:
    """Whether `x`'s device runs the layers' Triton kernels (CUDA, or the interpreter) and
    they are on. A static property of `x`: Dynamo traces this in the ops' bodies."""
    return use_triton(x) and layer_kernels_enabled()


def launchable(name: str):
    """The layers' Triton kernel `name`, wrapped (`torch.library.wrap_triton`) so that
    Dynamo and Inductor trace its launch; as is under the interpreter, whose kernels
    wrap_triton does not take. During a start-up's dry launches (eager only: Dynamo
    folds `is_compiling()` and never reads the global), a stand-in that compiles."""
    kernel = getattr(layer_kernels(), name)
    if not torch.compiler.is_compiling() and precompile.ACTIVE is not None:
        return _DryLaunch(kernel, precompile.ACTIVE)  # a start-up's dry launches
    return kernel if triton_interpret_enabled() else torch.library.wrap_triton(kernel)


class _DryLaunch:
    """`kernel[grid](*args, **kwargs)` submitting the variant's compile instead of
    running (kernels/launch/precompile.py), with the options the real launch passes:
    `wrap_triton` runs an eager launch through a one-config autotuner, whose config
    passes every compile option it has (num_stages and num_ctas at their defaults
    too), and Triton keys its variants by the options passed; a launch passing none is
    not wrapped in one (nor given the Config's defaults)."""

    def __init__(self, kernel, precompiler) -> None:
        self.kernel, self.precompiler = kernel, precompiler

    def __getitem__(self, grid):
        def submit(*args, **kwargs):
            import triton

            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "num_ctas")
                       if k in kwargs}
            if options and not triton_interpret_enabled():  # (none: launched as is)
                options = triton.Config({}, **options).all_kwargs()
            self.precompiler.submit(self.kernel, grid, args, {**kwargs, **options})

        return submit
