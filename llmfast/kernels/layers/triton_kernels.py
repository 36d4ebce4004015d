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
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, OFFSET: tl.constexpr,
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
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if OFFSET:  # Gemma: (1 + w) * x_normed in float32, rounded once
        out = (xf * tl.math.rsqrt(mean_square + eps) * (1.0 + w.to(tl.float32))).to(
            out_ptr.dtype.element_ty)
    else:
        normed = (xf * tl.math.rsqrt(mean_square + eps)).to(out_ptr.dtype.element_ty)
        out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


@triton.jit
def load_cos_sin(cos_sin_ptr, pos, stride_cs, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """[1, HALF_P] cos and sin of position `pos` (the table's row: cos of the half, then
    sin)."""
    offs_d = tl.arange(0, HALF_P)
    d_mask = offs_d < HALF
    row = cos_sin_ptr + pos * stride_cs
    cos = tl.load(row + offs_d, mask=d_mask, other=0.0)[None, :]
    sin = tl.load(row + HALF + offs_d, mask=d_mask, other=0.0)[None, :]
    return cos, sin


@triton.jit
def rotate_halves(x_ptr, stride_h, num_heads, cos, sin, HALF: tl.constexpr,
                  HALF_P: tl.constexpr, HEADS_P: tl.constexpr):
    """[HEADS_P, HALF_P] first and second halves of `num_heads` heads at x_ptr, rotated
    in float32: (x1 cos - x2 sin, x2 cos + x1 sin); and the mask of real elements."""
    offs_h = tl.arange(0, HEADS_P)
    offs_d = tl.arange(0, HALF_P)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    x = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(x, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin, mask


@triton.jit
def rotary_kernel(
    x_ptr, positions_ptr, cos_sin_ptr, out_ptr,
    stride_xt, stride_xh, stride_ot, stride_oh, stride_cs, num_heads,
    HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr,
):
    """One token per program, all its heads: out = [x1 cos - x2 sin, x2 cos + x1 sin]
    for halves x1, x2 of each head, with cos and sin of the token's position."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    cos, sin = load_cos_sin(cos_sin_ptr, pos, stride_cs, HALF, HALF_P)
    o1, o2, mask = rotate_halves(x_ptr + t * stride_xt, stride_xh, num_heads, cos, sin,
                                 HALF, HALF_P, HEADS_P)
    offs_h = tl.arange(0, HEADS_P)
    o = out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + tl.arange(0, HALF_P)[None, :]
    tl.store(o, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(o + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)
