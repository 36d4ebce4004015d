"""FP8 (float8_e4m3fn) matmul with row-wise scales: vLLM's dynamic `--quantization fp8`.

Weights are quantized once, at load, with one scale per output channel; activations per
token (row) at every call. `torch._scaled_mm` multiplies the fp8 operands, accumulates
in float32 and applies both scales in its epilogue, writing the model dtype: a decode
step then streams one byte per weight instead of two.

Where `_scaled_mm` cannot take row-wise scales (torch 2.11's CPU backend: per-tensor
only; a GPU without fp8 tensor cores) `fp8_matmul` computes the same product from the
same fp8 values in float32 (exact products, float32 accumulation), so CPU tests check the
math the GPU runs. Which path a device takes is probed once per (device kind, dtype),
lazily, with tiny tensors: nothing runs at import.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
# A row of zeros gets this scale instead of 0 (no 0 / 0); its values quantize to 0.
MIN_SCALE = 1e-12
# cuBLASLt's fp8 GEMM wants both K and N in multiples of 16.
FP8_ALIGNMENT = 16


def fp8_shape_supported(out_features: int, in_features: int) -> bool:
    """Whether `_scaled_mm` takes a weight [N, K] on CUDA (checked on every device, so
    CPU runs quantize exactly the layers a GPU run does)."""
    return out_features % FP8_ALIGNMENT == 0 and in_features % FP8_ALIGNMENT == 0


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, C] -> (t_fp8 [R, C] float8_e4m3fn, scale [R, 1] float32), t ~= t_fp8 * scale:
    each row scaled so its largest magnitude maps to FP8_MAX."""
    amax = t.abs().amax(dim=-1, keepdim=True).float()  # [R, 1]
    scale = (amax / FP8_MAX).clamp_min(MIN_SCALE)  # [R, 1]
    # x / scale promotes a bf16/fp16 x to float32: the one rounding is to fp8.
    t_fp8 = (t / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [R, C]
    return t_fp8, scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (weight_fp8 [N, K] row-major, weight_scale [1, N] float32): one
    scale per output channel, laid out as `_scaled_mm`'s scale_b wants it."""
    weight_fp8, scale = quantize_rows(weight)  # scale [N, 1]
    return weight_fp8, scale.t().contiguous()  # [1, N]


@functools.cache
def scaled_mm_out_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype | None:
    """The out_dtype to ask `_scaled_mm` for row-wise scales when the model runs in
    `dtype` on `device_type`: `dtype` itself, else bfloat16 (CUDA's row-wise kernels
    were bf16-only in some releases; the result is then cast), or None: no row-wise
    `_scaled_mm` here, use the float32 fallback. Probed once with tiny tensors."""
    for out_dtype in dict.fromkeys((dtype, torch.bfloat16)):
        if _scaled_mm_works(device_type, out_dtype):
            return out_dtype
    logger.info("fp8: torch._scaled_mm has no row-wise scaling on %s; the fp8 projections "
                "multiply in float32 from the same fp8 values", device_type)
    return None


def _scaled_mm_works(device_type: str, out_dtype: torch.dtype) -> bool:
    device = torch.device(device_type)
    a = torch.ones(16, 16, device=device).to(FP8_DTYPE)
    b = torch.ones(16, 16, device=device).to(FP8_DTYPE)
    scale_a = torch.full((16, 1), 0.5, device=device)
    scale_b = torch.full((1, 16), 0.25, device=device)
    try:
        out = torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    except (RuntimeError, TypeError, NotImplementedError) as e:
        # Expected on some CPUs; on a GPU it means every projection takes the slow path.
        log = logger.warning if device.type == "cuda" else logger.debug
        log("fp8: torch._scaled_mm with row-wise scales and %s output failed on %s: %s",
            out_dtype, device_type, str(e).splitlines()[0] if str(e) else type(e).__name__)
        return False
    # 16 products of 1 * 0.5 * 0.25: checks the scales were applied row-wise at all.
    return bool(torch.all(out.float() == 2.0))


def fp8_matmul(x_fp8: torch.Tensor, scale: torch.Tensor, weight_fp8: torch.Tensor,
               weight_scale: torch.Tensor, out_dtype: torch.dtype,
               mm_out_dtype: torch.dtype | None) -> torch.Tensor:
    """x_fp8 [M, K] (scale [M, 1]) @ weight_fp8 [N, K].T (weight_scale [1, N]) -> [M, N]
    in `out_dtype`. `mm_out_dtype`: `scaled_mm_out_dtype`'s answer for this device."""
    if mm_out_dtype is None:
        # fp8 values are exact in float32 and so are their products; float32
        # accumulation, then both scales, as _scaled_mm's epilogue applies them.
        acc = x_fp8.float() @ weight_fp8.float().t()  # [M, N]
        return (acc * scale * weight_scale).to(out_dtype)
    # weight_fp8.t() is the column-major [K, N] operand _scaled_mm requires.
    out = torch._scaled_mm(x_fp8, weight_fp8.t(), scale_a=scale, scale_b=weight_scale,
                           out_dtype=mm_out_dtype)  # [M, N]
    return out if mm_out_dtype == out_dtype else out.to(out_dtype)


# Compiled graphs call the op: the engine compiles with an unbacked token count, and
# _scaled_mm's meta function guards on it (`scale_a.numel() == 1`), which fails to trace.
# Eager calls `fp8_matmul` directly (no dispatcher overhead).
@torch.library.custom_op("llmfast::fp8_matmul", mutates_args=())
def fp8_matmul_op(x_fp8: torch.Tensor, scale: torch.Tensor, weight_fp8: torch.Tensor,
                  weight_scale: torch.Tensor, out_dtype: torch.dtype,
                  mm_out_dtype: torch.dtype | None) -> torch.Tensor:
    return fp8_matmul(x_fp8, scale, weight_fp8, weight_scale, out_dtype, mm_out_dtype)


@fp8_matmul_op.register_fake
def _(x_fp8: torch.Tensor, scale: torch.Tensor, weight_fp8: torch.Tensor,
      weight_scale: torch.Tensor, out_dtype: torch.dtype,
      mm_out_dtype: torch.dtype | None) -> torch.Tensor:
    return x_fp8.new_empty(x_fp8.shape[0], weight_fp8.shape[0], dtype=out_dtype)


def fp8_linear(x: torch.Tensor, weight_fp8: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None, mm_out_dtype: torch.dtype | None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32) -> [M, N] in x's dtype: x quantized per row (traced:
    Inductor fuses it), then `fp8_matmul`. No host syncs: fit for CUDA graphs."""
    x_fp8, scale = quantize_rows(x)  # [M, K] fp8, [M, 1] float32
    matmul = fp8_matmul_op if torch.compiler.is_compiling() else fp8_matmul
    out = matmul(x_fp8, scale, weight_fp8, weight_scale, x.dtype, mm_out_dtype)  # [M, N]
    return out if bias is None else out + bias
