"""A linear layer over int4 codes with per-32-column scales and zeros, on torch's CPU
int4 kernel (`aten._weight_int4pack_mm_for_cpu`): the weights stay packed, a decode step
streams half a byte per weight plus the groups' scales.

The kernel computes, per group g of 32 columns, `w = (v - 8) * scale + zero` with v in
[0, 16). Any GGUF block type decoded to `w = s * code + o` (models/formats/gguf_blocks.py)
fits as one or two such nibble planes laid side by side along the columns:
- codes of 4 bits: one plane v = code, scale s, zero o + 8 s (exact);
- codes of 5-8 bits: code = 16 h + l; a low plane v = l (scale s, zero o + 8 s) and a high
  plane v = h (scale 16 s, zero 128 s, so that (h - 8) 16 s + 128 s = 16 s h); the
  activations enter twice, once per plane.
- groups of 16 (Q6_K): each group of 16 is padded to 32 columns with v = 8, whose
  activation is a zero column, so the padding adds nothing.

Measured on the 2-core AVX2 dev machine (torch 2.13): the kernel is vectorised for
bfloat16 activations only (float32 ones take a scalar path, 6-12x slower), so the
activations, scales and zeros are bfloat16 and the output (bfloat16) is widened to
float32. That rounds the scales (f16 in GGUF, 11 bits) to 8 bits and the products'
sum to bfloat16: relative errors of ~2^-8, what the tests bound.

The kernel is a GEMV at heart: its time grows with the tokens about as a float32 GEMM's
does not, so a call of DEQUANTIZE_MIN_TOKENS or more (a prefill) unpacks the weight to
float32 into a reused scratch and runs float32 GEMMs instead (int4_dequant.py; prompts
1.4-2x faster than the kernel from 64 tokens on the dev VM; profiles/cpu.md). Compiled graphs call the
layer as the opaque `llmfast::int4_linear` op, so that choice happens at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from llmfast.kernels.cpu.affine_codes import AffineCodes
from llmfast.kernels.cpu.int4_dequant import (
    BLOCK_ROWS,
    GROUP,  # columns per scale/zero pair, the kernel's smallest group
    dequantized_linear,
    packed_layout_known,
    plane_columns,
)

# The kernel's packing needs N divisible by 16; a multiple of 32 keeps its layout to
# whole blocks of 32 rows (a last block of 16 is laid out otherwise), which the
# prefill path's unpack reads (int4_dequant.py).
ROW_MULTIPLE = BLOCK_ROWS
ACT_DTYPE = torch.bfloat16
# From this many tokens a call dequantizes its weight and runs a float32 GEMM instead of
# the int4 kernel: near where the two cost the same (scripts/bench_cpu_quant.py: per
# projection of the default model, the kernel ahead at 32 tokens, the GEMM at 64; whole
# prompts on the shared VM, the two within noise of each other at 40-48, the GEMM ahead
# from 56, by 1.07-1.4x; profiles/cpu.md, "Prefill").
DEQUANTIZE_MIN_TOKENS = 48


def int4_supported() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def nibble_planes(a: AffineCodes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """AffineCodes [N, K] -> (values uint8 [N, K'] in [0, 16), scales_and_zeros float32
    [K' / 32, N, 2], x_index int64 [K'] into the activations' columns with K meaning a
    zero column). K' = K * planes * (32 / group)."""
    rows, cols = a.codes.shape
    if a.bits > 8 or a.group not in (16, 32):
        raise ValueError(f"no int4 planes for {a.bits}-bit codes in groups of {a.group}")
    s, o = a.scale, a.offset  # [N, K / group]
    planes = [(a.codes & 0x0F, s, o + 8 * s)]
    if a.bits > 4:
        planes.append((a.codes >> 4, 16 * s, 128 * s))
    values, scales, zeros, index = [], [], [], []
    columns = np.arange(cols, dtype=np.int64)
    for v, scale, zero in planes:
        if a.group == 16:
            # [N, K/16, 16] -> [N, K/16, 32]: 16 codes then 16 eights (v - 8 = 0 there).
            v = np.concatenate([v.reshape(rows, -1, 16), np.full((rows, cols // 16, 16), 8,
                                                                  np.uint8)], axis=2)
            pad = np.full((cols // 16, 16), cols, np.int64)
            idx = np.concatenate([columns.reshape(-1, 16), pad], axis=1).reshape(-1)
        else:
            idx = columns
        values.append(v.reshape(rows, -1))
        scales.append(scale)
        zeros.append(zero)
        index.append(idx)
    sz = np.stack([np.concatenate(scales, axis=1), np.concatenate(zeros, axis=1)], axis=2)
    return (np.concatenate(values, axis=1), np.ascontiguousarray(sz.transpose(1, 0, 2)),
            np.concatenate(index))


def dequantize_planes(values: np.ndarray, sz: np.ndarray, x_index: np.ndarray,
                      cols: int) -> np.ndarray:
    """float64 [N, K]: the weight the planes stand for (tests compare it with the GGUF
    dequantisation; padding columns must contribute nothing)."""
    rows = values.shape[0]
    scale = np.repeat(sz[..., 0].T.astype(np.float64), GROUP, axis=1)
    zero = np.repeat(sz[..., 1].T.astype(np.float64), GROUP, axis=1)
    w = (values.astype(np.float64) - 8) * scale + zero  # [N, K']
    out = np.zeros((rows, cols + 1))
    np.add.at(out.T, x_index, w.T)
    return out[:, :cols]


def int4_linear_impl(x: torch.Tensor, weight_packed: torch.Tensor,
                     scales_and_zeros: torch.Tensor, x_index: torch.Tensor | None,
                     zero_column: bool, out_features: int) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: the int4 kernel for few tokens; for many (a
    prefill), a float32 GEMM on the weight dequantized for this call, which from
    DEQUANTIZE_MIN_TOKENS costs less than the kernel (a GEMV at heart)."""
    dtype = x.dtype
    if x.shape[0] >= DEQUANTIZE_MIN_TOKENS and packed_layout_known():
        return dequantized_linear(x, weight_packed, scales_and_zeros, x_index, zero_column,
                                  out_features)
    x = plane_columns(x.to(ACT_DTYPE), x_index, zero_column)  # [M, K']
    out = _INT4_MM(x, weight_packed, GROUP, scales_and_zeros)  # [M, N'] bf16
    if out.shape[1] != out_features:  # padded rows (contiguous: the op's fake result is)
        out = out[:, :out_features].contiguous()
    return out.to(dtype)  # the model's dtype (float32 on CPU)


# The kernel's overload, bound once: the packet's attribute lookups and overload
# resolution cost a few microseconds a call, 121 calls a step (None where torch lacks it:
# `int4_supported`).
_INT4_MM = getattr(getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None), "default",
                   None)


# A plain library definition, not `torch.library.custom_op`: the latter's Python wrapper
# costs ~40 us more a call (60 against 18 us measured on the dev VM), 121 calls a step.
_LIB = torch.library.Library("llmfast", "FRAGMENT")
_LIB.define("int4_linear(Tensor x, Tensor weight_packed, Tensor scales_and_zeros, "
            "Tensor? x_index, bool zero_column, int out_features) -> Tensor")
_LIB.impl("int4_linear", int4_linear_impl, "CPU")


@torch.library.register_fake("llmfast::int4_linear")
def _(x: torch.Tensor, weight_packed: torch.Tensor, scales_and_zeros: torch.Tensor,
      x_index: torch.Tensor | None, zero_column: bool, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


@dataclass(frozen=True)
class PackedInt4:
    """An `Int4Linear`'s tensors (what the start-up cache stores)."""

    weight_packed: torch.Tensor  # [N', K' / 2] uint8, the kernel's layout
    scales_and_zeros: torch.Tensor  # [K' / 32, N', 2] bfloat16
    x_index: torch.Tensor | None  # [K'] int64 into x's columns (K: a zero column); None: x as is
    in_features: int
    out_features: int


def pack_int4(a: AffineCodes) -> PackedInt4:
    out_features, in_features = a.codes.shape
    values, sz, x_index = nibble_planes(a)
    padded = -out_features % ROW_MULTIPLE
    if padded:  # rows of v = 8, scale 0, zero 0: outputs of 0, sliced off
        values = np.concatenate([values, np.full((padded, values.shape[1]), 8, np.uint8)])
        sz = np.concatenate([sz, np.zeros((sz.shape[0], padded, 2), np.float32)], axis=1)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
        torch.from_numpy(values.astype(np.int32)), 1)
    identity = x_index.size == in_features and bool((x_index == np.arange(in_features)).all())
    return PackedInt4(packed, torch.from_numpy(sz).to(ACT_DTYPE),
                      None if identity else torch.from_numpy(x_index), in_features,
                      out_features)


class Int4Linear(nn.Module):
    """x [M, K] -> [M, N] in x's dtype, from int4 nibble planes."""

    def __init__(self, packed: PackedInt4, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = packed.out_features, packed.in_features
        # Parameters, not buffers: models/weight_bytes.py counts parameters.
        self.weight_packed = nn.Parameter(packed.weight_packed, requires_grad=False)
        self.scales_and_zeros = nn.Parameter(packed.scales_and_zeros, requires_grad=False)
        x_index = packed.x_index
        self.zero_column = x_index is not None and bool((x_index == self.in_features).any())
        # Gathered columns of x: None when the planes read x as is.
        self.register_buffer("x_index", x_index, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        # The kernel's result is the layer's as is: x read as is, no padded rows, no
        # bias (every projection of the default model; its eager decode calls skip
        # the general path's checks).
        self.plain = (x_index is None and bias is None
                      and packed.weight_packed.shape[0] == self.out_features)

    @classmethod
    def from_codes(cls, a: AffineCodes, bias: torch.Tensor | None = None) -> Int4Linear:
        return cls(pack_int4(a), bias)

    def packed(self) -> PackedInt4:
        return PackedInt4(self.weight_packed.data, self.scales_and_zeros.data, self.x_index,
                          self.in_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # An opaque op: Inductor's own lowering of the int4 kernel adds a real tensor
            # constant that fails under its fake tensors (torch 2.13).
            shape = x.shape
            out = torch.ops.llmfast.int4_linear(
                x.reshape(-1, self.in_features), self.weight_packed, self.scales_and_zeros,
                self.x_index, self.zero_column, self.out_features)
            if self.bias is not None:
                out = out + self.bias.to(out.dtype)
            return out.reshape(*shape[:-1], self.out_features)
        # Eager: the decoder's activations are already [M, K] (no reshape calls then).
        flat = x.dim() == 2
        if self.plain and flat and x.shape[0] < DEQUANTIZE_MIN_TOKENS:
            # int4_linear_impl's kernel path, inlined: 121 calls a decode step.
            return _INT4_MM(x.to(ACT_DTYPE), self.weight_packed, GROUP,
                            self.scales_and_zeros).to(x.dtype)
        out = int4_linear_impl(x if flat else x.reshape(-1, self.in_features),
                               self.weight_packed, self.scales_and_zeros, self.x_index,
                               self.zero_column, self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out if flat else out.reshape(*x.shape[:-1], self.out_features)

    def forward_unwidened(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` for eager decode-sized calls, leaving the kernel's bfloat16 result
        as it is, for a caller that adds it to a float32 tensor next: the add widens it
        exactly (the same values as `forward`'s; the add casts inside its own call, one
        op call fewer from Python; models/cpu_layer.py, twice a layer). Other calls:
        `forward`."""
        if self.plain and x.dim() == 2 and x.shape[0] < DEQUANTIZE_MIN_TOKENS:
            return _INT4_MM(x.to(ACT_DTYPE), self.weight_packed, GROUP, self.scales_and_zeros)
        return self.forward(x)

    def extra_repr(self) -> str:
        planes = self.scales_and_zeros.shape[0] * GROUP // self.in_features
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"int4 x{planes}"
