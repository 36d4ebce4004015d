"""A float64 oracle for the skinny linear (kernels/gemv/) with a rigorous error bound:
each fusion's value in float64 and how far a correct kernel in `dtype` may be from it,
propagated op by op from the roundings the kernel makes (each `e` relative: one ulp of
the dtype, since the Triton interpreter truncates float32 -> bfloat16 where a GPU rounds
to nearest) and its float32 accumulation over K (K ulps of float32)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

F32_ULP = 2.0**-23
ULP = {torch.float32: F32_ULP, torch.bfloat16: 2.0**-7}


def random_inputs(rows: int, n: int, k: int, dtype: torch.dtype, seed: int = 0,
                  silu_mul: bool = False) -> dict:
    """x [rows, k] ~ N(0, 1), a weight [n (2n: silu_mul), k] ~ N(0, 1/k) (outputs ~1),
    a norm weight near 1, a bias, a residual [rows, n]."""
    g = torch.Generator().manual_seed(seed)
    rows_w = 2 * n if silu_mul else n
    return dict(x=torch.randn(rows, k, generator=g).to(dtype),
                weight=(torch.randn(rows_w, k, generator=g) / k**0.5).to(dtype),
                norm_weight=(1 + 0.2 * torch.randn(k, generator=g)).to(dtype),
                bias=(0.5 * torch.randn(rows_w, generator=g)).to(dtype),
                residual=torch.randn(rows, n, generator=g).to(dtype))


def oracle(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, *,
           weight_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
           norm_weight: torch.Tensor | None = None, eps: float = 1e-5,
           silu_mul: bool = False,
           residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(value [M, N], error bound [M, N]) in float64."""
    e = ULP[dtype]
    x = x.double()
    w = weight.double()
    if weight_scale is not None:  # the weight's values are the fp8 ones times the scales
        w = w * weight_scale.double().reshape(-1, 1)
    err_x = torch.zeros_like(x)
    if norm_weight is not None:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        x = normed * norm_weight.double()
        # The normed row rounded, then the product with the weight rounded (rstd in
        # float32: far below either).
        err_x = (2 * e + 4 * F32_ULP) * x.abs()
    y = x @ w.t()
    magnitude = x.abs() @ w.abs().t()
    err = err_x @ w.abs().t() + (x.shape[1] + 2) * F32_ULP * magnitude
    if bias is not None:
        y = y + bias.double()
    err = err + e * y.abs()  # the product rounded
    if silu_mul:
        gate, up = y.chunk(2, dim=-1)
        err_gate, err_up = err.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        slope = (sig * (1 + gate * (1 - sig))).abs()
        err_silu = slope * err_gate + e * silu.abs()
        y = silu * up
        err = err_silu * up.abs() + silu.abs() * err_up + err_silu * err_up + e * y.abs()
    if residual is not None:
        y = y + residual.double()
        err = err + e * y.abs()
    return y, err


def assert_within(got: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor],
                  dtype: torch.dtype) -> None:
    value, bound = want
    assert got.dtype == dtype and got.shape == value.shape, (got.dtype, got.shape)
    excess = (got.double() - value).abs() - 1.5 * bound
    worst = excess.argmax()
    assert excess.max().item() <= 1e-30, (
        f"error {(got.double() - value).abs().flatten()[worst].item():.3g} past the bound "
        f"{bound.flatten()[worst].item():.3g} at {divmod(worst.item(), value.shape[1])}")


@contextlib.contextmanager
def record_gemv_rows() -> Iterator[list[int]]:
    """The row count of every Triton GEMV launch (`ops.gemv_triton`) inside the block, in
    call order; the real kernel still runs."""
    from llmfast.kernels.gemv import ops

    rows: list[int] = []
    real = ops.gemv_triton

    def spy(*args, **kwargs):
        rows.append(args[0].shape[0])
        return real(*args, **kwargs)

    ops.gemv_triton = spy
    try:
        yield rows
    finally:
        ops.gemv_triton = real
