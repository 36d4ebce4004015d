"""Triton kernels of the decoder's small per-layer ops, launched by rms_norm.py and
rotary.py (kept apart so that importing those, as every model does, imports no Triton).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, n_cols, eps,
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_square = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.math.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


@triton.jit
def rotary_kernel(
    x_ptr, positions_ptr, cos_sin_ptr, out_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cs, num_heads,
    HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr,
):
    """One token per program, all its heads: out = [x1 cos - x2 sin, x2 cos + x1 sin]
    for halves x1, x2 of each head, with cos and sin of the token's position (the table's
    row: cos of the half, then sin)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HALF_P)
    d_mask = offs_d < HALF
    mask = (offs_h[:, None] < num_heads) & d_mask[None, :]
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    x = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh + offs_d[None, :]
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    o = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :]
    tl.store(o, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)
