"""`--quantization fp8` (vLLM's dynamic FP8 on an unquantized checkpoint): after the
weights are loaded, each decoder projection (qkv, o, gate_up, down; tensor-parallel
shards included) becomes an `Fp8Linear` holding its weight in float8_e4m3fn with one
scale per output channel; the original weight is freed. Activations are quantized per
token at run time (kernels/fp8_linear.py). The embedding, norms and lm_head stay in the
model dtype, as in vLLM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from llmfast.distributed import TensorParallelGroup, all_reduce
from llmfast.kernels.cpu.linear import Linear
from llmfast.kernels.gemv.ops import linear as gemv_linear
from llmfast.kernels.fp8_linear import (
    fp8_linear,
    fp8_shape_supported,
    quantize_weight,
    scaled_mm_out_dtype,
)
from llmfast.models.parallel_layers import RowParallelLinear

logger = logging.getLogger(__name__)


class Fp8Linear(nn.Module):
    """x [T, K] -> [T, N] from an fp8 weight; `tp` set: a row-parallel projection, its
    partial sums all-reduced over the ranks (as `RowParallelLinear`)."""

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
                 bias: torch.Tensor | None, mm_out_dtype: torch.dtype | None,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_fp8.shape
        # Parameters, not buffers: what counts weight bytes (models/weight_bytes.py)
        # counts parameters, and compile lifts both alike.
        self.weight_fp8 = nn.Parameter(weight_fp8, requires_grad=False)  # [N, K] fp8
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)  # [1, N] fp32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # [N]
        # Decided at load, outside any trace: a constant to torch.compile.
        self.mm_out_dtype = mm_out_dtype
        self.tp = tp
        self.gemv_backend = ""  # as `Linear.gemv_backend` (worker/startup/gemv_routing.py)

    @classmethod
    def from_linear(cls, layer: Linear) -> Fp8Linear:
        weight = layer.weight.detach()  # [N, K]
        weight_fp8, weight_scale = quantize_weight(weight)
        bias = None if layer.bias is None else layer.bias.detach()
        tp = layer.tp if isinstance(layer, RowParallelLinear) else None
        return cls(weight_fp8, weight_scale, bias,
                   scaled_mm_out_dtype(weight.device.type, weight.dtype), tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv_backend and x.dim() == 2:
            # Decode-sized M: the fp8 GEMV (weight-only: the rows stay in x's dtype);
            # larger M, or where cuBLAS measured faster: `fp8_linear` inside the op.
            out = gemv_linear(x, self.weight_fp8, self.weight_scale, self.bias,
                              mm_out_dtype=self.mm_out_dtype, backend=self.gemv_backend)
            return out if self.tp is None else all_reduce(out, self.tp)
        out = fp8_linear(x, self.weight_fp8, self.weight_scale, self.bias, self.mm_out_dtype)
        return out if self.tp is None else all_reduce(out, self.tp)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


@dataclass(frozen=True)
class QuantizationSummary:
    quantized: int  # projections now fp8
    kept: tuple[str, ...]  # projections left in the model dtype (shapes _scaled_mm refuses)
    bytes_before: int  # the quantized projections' weights in the model dtype
    bytes_after: int  # the same as fp8 weights and their scales


def quantize_fp8(model: nn.Module) -> QuantizationSummary:
    """Replace each decoder projection of a loaded `model` by an `Fp8Linear`, in place,
    one at a time (the peak is one projection's float32 temporaries). Skips the lm_head
    (vocabulary-wide logits keep the model's precision, as vLLM) and layers whose shape
    `_scaled_mm` does not take (kept, logged once). A mixture of experts' router stays
    too (its logits pick the experts, as vLLM keeps it), and so do the experts' stacked
    weights, which are no `Linear`."""
    # Names only: a list of the layers would keep every replaced weight alive.
    names = [name for name, module in model.named_modules()
             if isinstance(module, Linear) and name != "lm_head"
             and not name.endswith(".mlp.gate")]
    device = next(model.parameters()).device
    kept, before, after = [], 0, 0
    for name in names:
        layer = model.get_submodule(name)
        if not fp8_shape_supported(layer.out_features, layer.in_features):
            kept.append(name)
            continue
        quantized = Fp8Linear.from_linear(layer)
        before += _param_bytes(layer)
        after += _param_bytes(quantized)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, quantized)
        del layer  # the last reference: its weight is freed here
    if kept:
        logger.warning("fp8: %d projection(s) kept unquantized (N and K must be multiples "
                       "of 16): %s", len(kept),
                       ", ".join(kept[:4]) + (" ..." if len(kept) > 4 else ""))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the freed weights back to the device
    elif names:
        # No fast fp8 matmul on a CPU: torch 2.13's _scaled_mm took 27 ms for a 1 x 576 x
        # 1536 projection that float32 does in 0.3 ms (2-core VM); the whole default model
        # decoded ~10x slower. Said, not refused: the CPU runs check the GPU path's math.
        logger.warning("--quantization fp8 on the CPU checks the GPU path's numbers; it is "
                       "much slower than float32 here (no fast fp8 matmul on a CPU)")
    return QuantizationSummary(len(names) - len(kept), tuple(kept), before, after)


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())
