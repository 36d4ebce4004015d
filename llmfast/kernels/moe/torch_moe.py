"""The experts on CPU: the (token, expert) pairs sorted by expert, then one loop over
the experts that some token picked (a decode step of Qwen3-30B-A3B: 8 of 128), each a
gate/up GEMM, SiLU-and-mul and a down GEMM over its rows; the routing weights scale the
rows and `index_add_` sums each token's k rows. No loop over tokens; the counts per
expert are read on the host, which costs nothing on CPU (the CUDA form in triton_moe.py
never syncs).

Per token the k contributions are added in increasing expert order, as HF's loop over
experts adds them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmfast.kernels.cpu.linear import MAX_SPLIT_TOKENS, cpu_linear_impl, num_row_blocks


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The CPU row split (kernels/cpu/linear.py) for decode-sized row counts: a GEMV on one
    # expert's weight reads it at a third of the bandwidth otherwise.
    if x.is_cpu and x.dtype == torch.float32:
        return cpu_linear_impl(x, weight, num_row_blocks(weight.shape[0]), MAX_SPLIT_TOKENS)
    return F.linear(x, weight)


def fused_moe_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights
    [T, k] (x's dtype); topk_ids [T, k] -> [T, H] = sum over each token's k experts of
    weight * down(silu(gate(x)) * up(x))."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    inter = w2.shape[2]
    flat_ids = topk_ids.reshape(-1).long()  # [T * k], pair p = token p // k's j-th pick
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert
    tokens = order // top_k  # [T * k] the token of each sorted pair
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    rows = x.index_select(0, tokens)  # [T * k, H]
    out_rows = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        gate_up = _linear(rows[start:start + count], w13[expert])  # [count, 2I]
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out_rows[start:start + count] = _linear(act, w2[expert])
        start += count
    out_rows *= topk_weights.reshape(-1).index_select(0, order).unsqueeze(1)
    out = torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
    return out.index_add_(0, tokens, out_rows)
