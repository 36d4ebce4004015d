"""Triton kernels of the skinny GEMM (a few token rows times a weight), launched by
ops.py (kept apart so that importing that, as every linear layer does, imports no
Triton).

One program owns BLOCK_N output columns of every row (M <= BLOCK_M <= 16) over one
K range: `pid_k` of split_k. At batch 1 a decode projection is a weight stream, and the
programs must cover every SM with loads in flight: few columns per program (N=2048 /
16 = 128 programs) and, where that is still too few, K split in ranges whose fp32 sums
the reduce kernel adds (a deterministic order, no atomics, no zeroed workspace).

Fusions, each saving a pass over an activation or a launch:
- NORM: RMSNorm of the input rows in the prologue (each program reads its rows whole
  once for the sum of squares: a few KiB from L2, against the weight tile's MiB);
- SILU_MUL: the weight holds gate rows [0, N) and up rows [N, 2N); each program
  accumulates both for its columns and writes silu(gate) * up;
- RESIDUAL: the residual row added in the epilogue (o_proj, down_proj);
- FP8: float8_e4m3fn weights times a float32 scale per output row, dequantized in
  registers: half the bytes of bf16.
Roundings follow the unfused torch ops in the model dtype (each op's result rounded),
so a fused layer computes what the separate ones do.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_rstd(x_ptr, offs_m, m_mask, stride_xm, K, eps,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """1 / rms of each row over all K, in float32: [BLOCK_M]."""
    sum_sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
        sum_sq += tl.sum(x * x, axis=1)
    return tl.math.rsqrt(sum_sq / K + eps)


@triton.jit
def _tile_product(x, w_ptrs, w_mask, DOT: tl.constexpr, DOT_F32: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] (model dtype) times the weight tile at w_ptrs [BLOCK_N,
    BLOCK_K] (model dtype or fp8) -> [BLOCK_M, BLOCK_N] float32. DOT: tensor cores
    (BLOCK_M >= 16); DOT_F32: in float32 (the interpreter's tl.dot on bf16 is wrong);
    else a broadcast multiply and a sum over K (rows below tl.dot's minimum of 16)."""
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if DOT:
        if DOT_F32:
            return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        if x.dtype == tl.float32:  # a float32 model: no TF32 rounding of its inputs
            return tl.dot(x, tl.trans(w.to(tl.float32)), input_precision="ieee")
        return tl.dot(x, tl.trans(w.to(x.dtype)))
    return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def gemv_kernel(
    x_ptr, w_ptr, w_scale_ptr, norm_w_ptr, bias_ptr, res_ptr, out_ptr, part_ptr,
    M, N, K, k_per_split, stride_xm, stride_wn, stride_rm, stride_om, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, NORM: tl.constexpr, SILU_MUL: tl.constexpr,
    RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, W_SCALE: tl.constexpr,
    DOT: tl.constexpr, DOT_F32: tl.constexpr,
):
    """out [M, N] = epilogue(norm?(x) [M, K] @ w[N(, 2N), K].T); SPLIT (K in ranges of
    k_per_split, one per pid_k): the fp32 partial sums of K range pid_k into
    part [split_k, M, N (x2 with SILU_MUL)] instead. The split count is no constexpr:
    every count of one tile shares a compiled variant (the start-up compiles fewer)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    dtype = x_ptr.dtype.element_ty
    if NORM:
        rstd = _row_rstd(x_ptr, offs_m, m_mask, stride_xm, K, eps, BLOCK_M, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # int64 row offsets: lm_head's 128k rows x 4k columns pass 2^31 elements.
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    up_rows = w_ptr + (offs_n.to(tl.int64) + N)[:, None] * stride_wn
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:  # as rms_norm: normalised in fp32, rounded, times the weight, rounded
            g = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            normed = (x.to(tl.float32) * rstd[:, None]).to(dtype)
            x = (g[None, :] * normed.to(tl.float32)).to(dtype)
        w_mask = n_mask[:, None] & k_mask[None, :]
        acc += _tile_product(x, w_rows + offs_k[None, :], w_mask, DOT, DOT_F32)
        if SILU_MUL:
            acc_up += _tile_product(x, up_rows + offs_k[None, :], w_mask, DOT, DOT_F32)
    if W_SCALE:  # one scale per weight row (a linear map: fine before the split sum)
        acc *= tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if SILU_MUL:
            acc_up *= tl.load(w_scale_ptr + N + offs_n, mask=n_mask, other=0.0)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT:
        width = 2 * N if SILU_MUL else N
        part = part_ptr + (pid_k * M + offs_m)[:, None] * width + offs_n[None, :]
        tl.store(part, acc, mask=out_mask)
        if SILU_MUL:
            tl.store(part + N, acc_up, mask=out_mask)
    else:
        _epilogue(acc, acc_up, offs_m, offs_n, out_mask, bias_ptr, res_ptr, out_ptr,
                  stride_rm, stride_om, SILU_MUL, RESIDUAL, HAS_BIAS)


@triton.jit
def gemv_reduce_kernel(
    part_ptr, bias_ptr, res_ptr, out_ptr, M, N, split_k, stride_rm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """The split-K partial sums, in split order, then gemv_kernel's epilogue."""
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    width = 2 * N if SILU_MUL else N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for s in range(split_k):
        part = part_ptr + (s * M + offs_m)[:, None] * width + offs_n[None, :]
        acc += tl.load(part, mask=mask, other=0.0)
        if SILU_MUL:
            acc_up += tl.load(part + N, mask=mask, other=0.0)
    _epilogue(acc, acc_up, offs_m, offs_n, mask, bias_ptr, res_ptr, out_ptr,
              stride_rm, stride_om, SILU_MUL, RESIDUAL, HAS_BIAS)


@triton.jit
def _epilogue(acc, acc_up, offs_m, offs_n, mask, bias_ptr, res_ptr, out_ptr,
              stride_rm, stride_om, SILU_MUL: tl.constexpr, RESIDUAL: tl.constexpr,
              HAS_BIAS: tl.constexpr):
    """fp32 sums -> the model dtype, rounded as the separate torch ops round: the
    product (+ bias, as cuBLAS's epilogue adds it), then silu(gate) * up or + residual,
    each rounded."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    out = acc.to(dtype).to(tl.float32)
    if SILU_MUL:
        up = acc_up.to(dtype).to(tl.float32)
        gate = (out * tl.sigmoid(out)).to(dtype).to(tl.float32)
        out = gate * up
    if RESIDUAL:
        out += tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out.to(dtype),
             mask=mask)
