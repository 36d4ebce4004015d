"""The fused MoE layer's Triton kernels (launched by triton_moe.py).

The (token, expert) pairs are numbered p = token * top_k + j (the router's j-th pick).
`moe_align_kernel` groups them by expert, each group padded to a multiple of BLOCK_M,
so that every BLOCK_M rows belong to one expert. Worked example, 3 tokens, top_k 2,
topk_ids [[1, 0], [1, 3], [0, 1]], BLOCK_M 4: expert 0 holds pairs 1 5, expert 1 pairs
0 2 4, expert 3 pair 3; sorted_pairs = [1 5 P P | 0 2 4 P | 3 P P P] (P = 6, the number of
pairs: padding), block_experts = [0, 1, 3], num_padded = 12.

The two GEMM kernels then run one program per (block of BLOCK_M sorted rows, BLOCK_N
output columns), each against its block's expert's weight (the grouped GEMM):
`moe_gate_up_kernel` computes silu(x W_gate^T) * (x W_up^T) for the pairs' tokens, both
halves in the same program so the activation is applied before anything is stored;
`moe_down_kernel` multiplies those rows by W_down^T and by the pair's routing weight.
The grid covers the worst-case padding (a static size for a given token count, so a CUDA
graph captures it); programs past `num_padded` return at once.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def moe_align_kernel(topk_ids_ptr, sorted_pairs_ptr, block_experts_ptr, num_padded_ptr,
                     num_pairs, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                     BLOCK_P: tl.constexpr):
    """Program e places expert e's pairs (in pair order) and its padding, and names e as
    the expert of its blocks. Each program counts every expert's pairs itself (a
    [BLOCK_P, BLOCK_E] comparison per chunk), so one launch does it all."""
    expert = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_P):
        offs = start + tl.arange(0, BLOCK_P)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    group_start = tl.sum(tl.where(experts < expert, padded, 0), axis=0)
    count = tl.sum(tl.where(experts == expert, counts, 0), axis=0)
    group_size = tl.sum(tl.where(experts == expert, padded, 0), axis=0)
    placed = count * 0
    for start in range(0, num_pairs, BLOCK_P):
        offs = start + tl.arange(0, BLOCK_P)
        ids = tl.load(topk_ids_ptr + offs, mask=offs < num_pairs, other=-1)
        mine = (ids == expert).to(tl.int32)
        rank = placed + tl.cumsum(mine, axis=0) - 1  # within the group, in pair order
        tl.store(sorted_pairs_ptr + group_start + rank, offs, mask=mine > 0)
        placed += tl.sum(mine, axis=0)
    # Fewer than BLOCK_M padding slots: one masked store.
    pad = count + tl.arange(0, BLOCK_M)
    tl.store(sorted_pairs_ptr + group_start + pad, tl.zeros([BLOCK_M], tl.int32) + num_pairs,
             mask=pad < group_size)
    num_blocks = group_size // BLOCK_M
    for start in range(0, num_blocks, BLOCK_P):
        blocks = start + tl.arange(0, BLOCK_P)
        tl.store(block_experts_ptr + group_start // BLOCK_M + blocks,
                 tl.zeros([BLOCK_P], tl.int32) + expert, mask=blocks < num_blocks)
    if expert == 0:
        tl.store(num_padded_ptr, tl.sum(padded, axis=0))


@triton.jit
def _block_of(pid, num_blocks_m, num_pid_n, GROUP_M: tl.constexpr):
    """(row block, column block) of program `pid`: GROUP_M row blocks side by side per
    column block, so programs that run together share weight tiles in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_rows = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_rows
    pid_n = (pid % in_group) // group_rows
    return pid_m, pid_n


@triton.jit
def moe_gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr,
                       num_padded_ptr, num_pairs, num_blocks_m, inter, hidden,
                       stride_xm, stride_we, stride_wn, stride_om,
                       TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    """out[p, n] = silu(x[p // TOP_K] . w[e, n]) * (x[p // TOP_K] . w[e, inter + n]) for
    the pairs p of this block (expert e), columns n of this program; w [E, 2 * inter, hidden]."""
    pid_m, pid_n = _block_of(tl.program_id(0), num_blocks_m, tl.cdiv(inter, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < inter
    a_ptrs = x_ptr + tokens[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    g_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + inter * stride_wn  # [BLOCK_K, BLOCK_N] each
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_ok = offs_k < hidden - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        g = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        u = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's tl.dot is wrong on bf16 (see DESIGN.md)
            a, g, u = a.to(tl.float32), g.to(tl.float32), u.to(tl.float32)
        acc_g = tl.dot(a, g, acc_g, input_precision=DOT_PRECISION)
        acc_u = tl.dot(a, u, acc_u, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def moe_down_kernel(act_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_pairs_ptr,
                    block_experts_ptr, num_padded_ptr, num_pairs, num_blocks_m, hidden,
                    inter, stride_am, stride_we, stride_wn, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, UPCAST: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """out[p, n] = topk_weights[p] * (act[p] . w[e, n]) for the pairs p of this block
    (expert e); w [E, hidden, inter]."""
    pid_m, pid_n = _block_of(tl.program_id(0), num_blocks_m, tl.cdiv(hidden, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rows = pairs.to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < hidden
    a_ptrs = act_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(inter, BLOCK_K)):
        k_ok = offs_k < inter - k * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    weight = tl.load(topk_weights_ptr + rows, mask=valid, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])
