"""Linear layers for CPU decode: the weight's rows split into a batch of GEMMs.

A decode step multiplies a few token rows by every weight matrix once, so it is bound by
streaming the weights from DRAM. MKL's fp32 GEMM with so few rows reads them at ~12 GB/s
on our 2-core EPYC, a third of what one `sum` over the same bytes reaches (~31 GB/s), and
using one thread or two makes no difference. Viewing the weight [N, K] as T row blocks
[T, N / T, K] and running one `bmm` against the activations shared across the batch
(a stride-0 expand, no copy) lets torch spread the T GEMMs over its threads: 2.4x faster
for SmolLM2's projections at one token, 1.4x at 8, 1.15x at 32 (`scripts/bench_cpu_linear.py`;
engine-level figures in `profiles/cpu-engine.md`). The lm_head gains up to ~128 rows.

The result for row m, column n is the same dot product over K in both forms, so the two
paths agree to fp32 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Row blocks per weight; more blocks than threads balance the work.
WEIGHT_ROW_BLOCKS = 8
# Above this many token rows F.linear is as fast: the split's gain shrinks as the GEMM
# turns compute-bound, and its output must be transposed into place (a strided copy).
# Measured in the engine (SmolLM2 decode steps, interleaved): 1.5x at 8 requests, 1.2x
# at 32, 1.16x at 64, even at 128.
MAX_SPLIT_TOKENS = 64
# The lm_head (vocabulary-wide, run on the sampled rows only) keeps gaining up to here.
MAX_SPLIT_TOKENS_LM_HEAD = 128


def num_row_blocks(out_features: int) -> int:
    """The largest block count up to WEIGHT_ROW_BLOCKS dividing the rows (1: no split)."""
    for blocks in range(WEIGHT_ROW_BLOCKS, 1, -1):
        if out_features % blocks == 0:
            return blocks
    return 1


def row_split_linear(x: torch.Tensor, weight: torch.Tensor, blocks: int) -> torch.Tensor:
    """x [M, K] @ weight[N, K].T -> [M, N], as `blocks` GEMMs of [N / blocks, K] x [K, M].

    Worked example, N = 6, blocks = 3, M = 2: weight rows {0,1}, {2,3}, {4,5} form the
    batch; bmm gives [3, 2, M] (block, row in block, token); permute -> [M, 3, 2] and
    reshape -> [M, 6] (copied to row-major), column n = block * 2 + row in block = the original row index.
    """
    num_tokens, in_features = x.shape
    out_features = weight.shape[0]
    per_block = weight.view(blocks, out_features // blocks, in_features)
    shared_x = x.t().unsqueeze(0).expand(blocks, in_features, num_tokens)
    out = torch.bmm(per_block, shared_x)  # [blocks, N / blocks, M]
    # The permuted result is a column-major view [M, N]; one token needs no copy.
    return out.permute(2, 0, 1).reshape(num_tokens, out_features).contiguous()


def cpu_linear_impl(
    x: torch.Tensor, weight: torch.Tensor, row_blocks: int, max_split_tokens: int
) -> torch.Tensor:
    """x [M, K] -> [M, N]: the row split for decode-sized M, F.linear above."""
    if x.shape[0] <= max_split_tokens:
        return row_split_linear(x, weight, row_blocks)
    return F.linear(x, weight)


# Compiled graphs call the op: their token count is symbolic, so the choice of path
# (and Inductor's own shape checks on a bmm) must happen at run time, inside it.
@torch.library.custom_op("llmfast::cpu_linear", mutates_args=())
def cpu_linear(
    x: torch.Tensor, weight: torch.Tensor, row_blocks: int, max_split_tokens: int
) -> torch.Tensor:
    return cpu_linear_impl(x, weight, row_blocks, max_split_tokens)


@cpu_linear.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, row_blocks: int, max_split_tokens: int
) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state-dict names) with the CPU decode path."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        max_split_tokens: int = MAX_SPLIT_TOKENS,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.row_blocks = num_row_blocks(out_features)
        self.max_split_tokens = max_split_tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (x.is_cpu and x.dim() == 2 and self.row_blocks > 1 and self.weight.is_contiguous()):
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            out = torch.ops.llmfast.cpu_linear(
                x, self.weight, self.row_blocks, self.max_split_tokens
            )
        else:  # eager skips the op dispatcher (tens of microseconds a call)
            out = cpu_linear_impl(x, self.weight, self.row_blocks, self.max_split_tokens)
        return out if self.bias is None else out + self.bias
