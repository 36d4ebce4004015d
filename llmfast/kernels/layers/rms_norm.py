"""RMSNorm, with or without the residual add before it, as one Triton kernel per call.

Compiled code calls them as the triton ops `llmfast::rms_norm` and
`llmfast::add_rms_norm` (kernels/layers/triton_ops.py): Inductor sees through a triton op
to its kernel and launches it from the compiled piece itself. Left to Inductor, the norm was two kernels on CUDA (a looped sum-of-squares reduction,
then a pointwise kernel: 2048 columns are past its persistent-reduction limit) and the
residual add went into the GEMM before it as an addmm, whose cuBLAS call copies the
residual first (`memcpy32_post`): four launches a norm where one does.

Numerics are HF's (and the torch reference's): the residual sum rounded to the model
dtype, normalised in float32, rounded, then scaled by the weight in the model dtype;
with `offset` (Gemma) scaled by 1 + weight in float32 and rounded once.
On CPU (and for shapes the kernel does not take) the same maths in torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmfast.kernels.layers.kernel_choice import launchable, takes_layer_kernels

_MAX_COLS = 16384  # one row per program, held whole in registers


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       offset: bool = False) -> torch.Tensor:
    """Normalise in float32, scale in the input dtype (as HF does); `offset`: by
    1 + weight in float32, rounded once (HF's Gemma)."""
    if offset:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (normed * (1.0 + weight.float())).to(x.dtype)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # One op: the same values as scaling after (F.rms_norm multiplies by the weight
        # last), without the two casts.
        return F.rms_norm(x, (x.shape[-1],), weight, eps=eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


def _kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Static properties only: under torch.compile Dynamo traces this (the triton op's
    # body) with the token count an unbacked symbol, and a branch on it cannot be traced.
    return (
        takes_layer_kernels(x) and x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
        and weight.dtype == x.dtype and x.shape[-1] <= _MAX_COLS
    )


def _launch(x, residual, weight, out, residual_out, eps: float, offset: bool) -> None:
    rows, cols = x.shape
    if type(rows) is int and rows == 0:  # eager only (traced: a SymInt, never 0)
        return
    block = 1 << (cols - 1).bit_length()
    add = residual is not None
    launchable("rms_norm_kernel")[(rows,)](
        x, residual, weight, out, residual_out,  # (None: the residual pointers unused)
        x.stride(0), residual.stride(0) if add else 0, out.stride(0),
        residual_out.stride(0) if add else 0, cols, eps,
        ADD_RESIDUAL=add, BLOCK=block, OFFSET=offset, num_warps=max(1, min(16, block // 512)),
    )


def rms_norm_impl(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  offset: bool = False) -> torch.Tensor:
    """[rows, cols] -> weight * rms_norm(x) (`offset`: (1 + weight) * ...). Eager callers
    may call this directly (the op's dispatcher costs more than a small norm on CPU);
    compiled code uses the op."""
    if not _kernel_takes(x, weight):
        return rms_norm_reference(x, weight, eps, offset)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, out, None, eps, offset)
    return out


def add_rms_norm_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual), the sum in x's dtype."""
    if not (_kernel_takes(x, weight) and residual.dim() == 2
            and residual.shape[-1] == x.shape[-1] and residual.dtype == x.dtype
            and residual.stride(-1) == 1):
        summed = x + residual
        return rms_norm_reference(summed, weight, eps, offset), summed
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, out, residual_out, eps, offset)
    return out, residual_out
