"""The decoder's triton ops (`torch.library.triton_op`): `llmfast::rms_norm`,
`llmfast::add_rms_norm`, `llmfast::rotary_embedding`. Registered by the compiler's entry
point (compile/compiled_model.py) before Dynamo traces a model, never at import:
registering a triton op imports torch._inductor and with it Dynamo and Triton (~1 s),
which an eager engine never needs. Eager models call the ops' bodies directly.
"""

from __future__ import annotations

import functools

import torch

from llmfast.kernels.layers.kernel_choice import layer_kernels, layer_kernels_enabled
from llmfast.kernels.layers.rms_norm import add_rms_norm_impl, rms_norm_impl
from llmfast.kernels.layers.rotary import rotary_impl


@functools.cache
def register_triton_ops() -> None:
    """Once per process; the schemas are inferred from the bodies' annotations. The
    kernels' module is imported here, before Dynamo traces the ops' bodies, which then
    find it loaded."""
    if layer_kernels_enabled():
        layer_kernels()
    for name, fn in (("rms_norm", rms_norm_impl), ("add_rms_norm", add_rms_norm_impl),
                     ("rotary_embedding", rotary_impl)):
        torch.library.triton_op(f"llmfast::{name}", fn, mutates_args=())
