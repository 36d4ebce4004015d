"""`llmfast::fused_moe`: the experts of a sparse MLP as one custom op, opaque to Dynamo
(its CPU form has data-dependent shapes inside; the CUDA form launches Triton kernels on
shapes fixed by the token count). Compiled graphs record the op; eager callers call
`fused_moe_impl` and skip the dispatcher."""

from __future__ import annotations

import torch

from llmfast.kernels.triton_mode import use_triton


def fused_moe_impl(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, k]; topk_ids [T, k] int32
    -> [T, H] (see torch_moe.fused_moe_torch for the maths)."""
    if use_triton(x):
        from llmfast.kernels.moe.triton_moe import fused_moe_triton

        return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
    from llmfast.kernels.moe.torch_moe import fused_moe_torch

    return fused_moe_torch(x, w13, w2, topk_weights, topk_ids)


@torch.library.custom_op("llmfast::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    return fused_moe_impl(x, w13, w2, topk_weights, topk_ids)


@fused_moe.register_fake
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
      topk_ids: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)
