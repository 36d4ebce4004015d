"""Linear layers for CPU decode: the weight's rows split into a batch of GEMMs.

A decode step multiplies a few token rows by every weight matrix once, so it is bound by
streaming the weights from DRAM. MKL's fp32 GEMM with so few rows reads them at ~12 GB/s
on our 2-core EPYC, a third of what one `sum` over the same bytes reaches (~31 GB/s), and
using one thread or two makes no difference. Viewing the weight [N, K] as T row blocks
[T, N / T, K] and running one `bmm` against the activations shared across the batch
(a stride-0 expand, no copy) lets torch spread the T GEMMs over its threads: 2.4x faster
for SmolLM2's projections at one token, 1.4x at 8, 1.15x at 32 (engine-level
figures in `profiles/cpu.md`). The lm_head gains up to ~128 rows.

The result for row m, column n is the same dot product over K in both forms, so the two
paths agree to fp32 rounding.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from llmfast.kernels.gemv.ops import linear as gemv_linear

logger = logging.getLogger(__name__)

# Row blocks per weight; more blocks than threads balance the work.
WEIGHT_ROW_BLOCKS = 8
# Above this many token rows F.linear is as fast: the split's gain shrinks as the GEMM
# turns compute-bound, and its output must be transposed into place (a strided copy).
# Measured in the engine (SmolLM2 decode steps, interleaved): 1.5x at 8 requests, 1.2x
# at 32, 1.16x at 64, even at 128.
MAX_SPLIT_TOKENS = 64
# The lm_head (vocabulary-wide, run on the sampled rows only) keeps gaining up to here.
MAX_SPLIT_TOKENS_LM_HEAD = 128
# With oneDNN-prepacked weights (see `Linear.prepack`), the split still wins up to here.
MAX_PACKED_SPLIT_TOKENS = 2
# oneDNN picks its weight blocking for this many rows; measured the same from 32 to 256.
PACK_HINT_TOKENS = 32


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


def prepack_supported(weight: torch.Tensor) -> bool:
    """oneDNN prepacking: measured for float32 only."""
    return (
        weight.is_cpu
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_weight(weight: torch.Tensor, hint_tokens: int = PACK_HINT_TOKENS) -> torch.Tensor:
    """weight [N, K] -> an opaque oneDNN copy in its GEMM's blocked layout."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), hint_tokens)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state-dict names) with the CPU paths.

    On CUDA, the skinny-GEMM op (kernels/gemv/) where the start-up routed this layer
there (`gemv_backend`: worker/startup/gemv_routing.py), else F.linear. Eager CPU forward, by
token count M:
    - M <= max_packed_split_tokens, or no packed weight and M <= max_split_tokens: row split;
    - a packed weight (`prepack()`): oneDNN's GEMM on it;
    - otherwise F.linear.
    """

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
        self.packed_weight: torch.Tensor | None = None
        # --gemv's backend for this layer's launches (worker/startup/gemv_routing.py sets it at
        # start-up on CUDA, before any trace); "": never the op. A plain str: a constant
        # to torch.compile, and part of the saved trace's fingerprint.
        self.gemv_backend = ""

    def prepack(self) -> bool:
        """Keep a oneDNN-packed copy of the weight (twice the weight memory); after
        the weights are final. Returns whether it packed."""
        if not prepack_supported(self.weight):
            return False
        self.packed_weight = pack_weight(self.weight)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv_backend and x.dim() == 2:  # decode-sized M: kernels/gemv/
            return gemv_linear(x, self.weight, bias=self.bias, backend=self.gemv_backend)
        if not (x.is_cpu and x.dim() == 2 and self.row_blocks > 1 and self.weight.is_contiguous()):
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            out = torch.ops.llmfast.cpu_linear(
                x, self.weight, self.row_blocks, self.max_split_tokens
            )
            return out if self.bias is None else out + self.bias
        # Eager skips the op dispatcher (tens of microseconds a call).
        if self.packed_weight is not None and x.shape[0] > MAX_PACKED_SPLIT_TOKENS:
            return packed_linear(x, self.packed_weight, self.bias)
        out = cpu_linear_impl(x, self.weight, self.row_blocks, self.max_split_tokens)
        return out if self.bias is None else out + self.bias


def physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def prepack_budget_bytes() -> int | None:
    """The most bytes the prepacked copies of the weights may take: a quarter of the RAM
    (None where the RAM's size is unknown). The runner packs within it; the CPU KV-cache
    fit counts the packs against host memory by the same rule."""
    ram = physical_memory_bytes()
    return None if ram is None else ram // 4


def prepack_linears(model: nn.Module, max_bytes: int | None) -> int:
    """Prepack every `Linear` of an eager CPU model (see `Linear.prepack`) unless the
    copies would take more than `max_bytes`; returns the bytes packed (0: none)."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and prepack_supported(m.weight)]
    # A tied lm_head shares the embedding's storage: count each storage once.
    storages = {m.weight.untyped_storage().data_ptr(): m.weight for m in layers}
    total = sum(w.numel() * w.element_size() for w in storages.values())
    if not layers or (max_bytes is not None and total > max_bytes):
        logger.info("CPU linears not prepacked (%.0f MiB over the %s budget)", total / 2**20,
                    "unknown" if max_bytes is None else f"{max_bytes / 2**20:.0f} MiB")
        return 0
    for layer in layers:
        layer.prepack()
    logger.info("CPU linears prepacked for oneDNN: %d layers, %.0f MiB", len(layers),
                total / 2**20)
    return total
