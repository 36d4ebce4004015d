"""The skinny linear: x [M, K] (M a decode batch) times a weight [N, K], with optional
fusions (RMSNorm of x before, silu(gate) * up or + residual after), by the Triton GEMV
(triton_kernels.py) where launch_config.py chooses it, else by the torch ops it replaces
(cuBLAS for the product: `F.linear`, or `fp8_linear` for an fp8 weight).

`backend` is --gemv's (the layer passes the one worker/startup/gemv_routing.py gave it).

Compiled graphs call `torch.ops.llmfast.skinny_linear`: the token count is an unbacked
symbol there, so the choice by M happens inside the op, at run time (a CUDA graph
captures the choice of its size). Its fake impl gives Inductor the output's shape.
Eager calls `skinny_linear` directly (no dispatcher). Nothing here imports Triton before a
kernel runs.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
import torch.nn.functional as F

from llmfast.kernels.fp8_linear import fp8_linear
from llmfast.kernels.gemv import launch_config
from llmfast.kernels.gemv.launch_config import Choice, GemvConfig, m_bucket
from llmfast.kernels.launch import precompile
from llmfast.kernels.layers.rms_norm import rms_norm_impl
from llmfast.kernels.triton_mode import triton_interpret_enabled

_KERNELS: ModuleType | None = None


def _kernels() -> ModuleType:
    global _KERNELS
    if _KERNELS is None:
        from llmfast.kernels.gemv import triton_kernels as module

        _KERNELS = module
    return _KERNELS


def fusion_name(norm: bool, silu_mul: bool, residual: bool) -> str:
    """The table key's fusion part: e.g. gate_up with its norm -> "norm-silu_mul"."""
    return "-".join(n for n, on in (("norm", norm), ("silu_mul", silu_mul),
                                    ("residual", residual)) if on)


def out_features(weight: torch.Tensor, silu_mul: bool) -> int:
    return weight.shape[0] // 2 if silu_mul else weight.shape[0]


# ------------------------------------------------------------------ the torch form


def skinny_linear_torch(x: torch.Tensor, weight: torch.Tensor,
                        weight_scale: torch.Tensor | None = None,
                        bias: torch.Tensor | None = None,
                        norm_weight: torch.Tensor | None = None,
                        residual: torch.Tensor | None = None, eps: float = 0.0,
                        silu_mul: bool = False,
                        mm_out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The separate ops the GEMV fuses, each rounded to x's dtype: rms_norm (HF's
    numerics), the product (cuBLAS; fp8: `fp8_linear`, activations quantized per row),
    silu(gate) * up, + residual."""
    if norm_weight is not None:  # (the layers' Triton norm kernel on CUDA)
        x = rms_norm_impl(x, norm_weight, eps)
    if weight_scale is None:
        out = F.linear(x, weight, bias)  # [M, N]
    else:
        out = fp8_linear(x, weight, weight_scale, bias, mm_out_dtype)  # [M, N]
    if silu_mul:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up  # [M, N / 2]
    return out if residual is None else out + residual


# ------------------------------------------------------------------ the Triton form


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig,
                weight_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                norm_weight: torch.Tensor | None = None,
                residual: torch.Tensor | None = None, eps: float = 0.0,
                silu_mul: bool = False) -> torch.Tensor:
    """The GEMV kernel (and its split-K reduce), x [M <= 16, K] -> [M, N]; weight [N, K]
    (silu_mul: [2N, K], gate rows first) in x's dtype or float8_e4m3fn with
    weight_scale [1, N] (one float32 scale per row)."""
    rows, k = x.shape
    if rows > launch_config.MAX_GEMV_ROWS:
        raise ValueError(f"the GEMV takes at most {launch_config.MAX_GEMV_ROWS} rows, "
                         f"got {rows}")
    n = out_features(weight, silu_mul)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)  # [M, N]
    if rows == 0:
        return out
    kernels = _kernels()
    block_m = max(m_bucket(rows), 16 if config.dot else 1)
    # Whole BLOCK_K steps per split; a split count that leaves ranges empty shrinks.
    k_per_split = -(-(-(-k // config.split_k)) // config.block_k) * config.block_k
    split_k = -(-k // k_per_split)
    tiles = -(-n // config.block_n)
    part = (torch.empty(split_k, rows, 2 * n if silu_mul else n, dtype=torch.float32,
                        device=x.device) if split_k > 1 else None)
    res_stride = residual.stride(0) if residual is not None else 0
    launches = [(kernels.gemv_kernel, (tiles, split_k), (
        x, weight, weight_scale, norm_weight, bias, residual, out, part,
        rows, n, k, k_per_split, x.stride(0), weight.stride(0), res_stride, out.stride(0), eps),
        dict(BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT=split_k > 1,
             NORM=norm_weight is not None, SILU_MUL=silu_mul, RESIDUAL=residual is not None,
             HAS_BIAS=bias is not None, W_SCALE=weight_scale is not None, DOT=config.dot,
             DOT_F32=triton_interpret_enabled(), num_warps=config.num_warps,
             num_stages=config.num_stages))]
    if split_k > 1:
        launches.append((kernels.gemv_reduce_kernel, (tiles,), (
            part, bias, residual, out, rows, n, split_k, res_stride, out.stride(0)),
            dict(BLOCK_M=block_m, BLOCK_N=config.block_n, SILU_MUL=silu_mul,
                 RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
                 num_warps=config.num_warps)))
    dry = precompile.ACTIVE
    for kernel, grid, args, kwargs in launches:
        if dry is not None:  # a dry launch (kernels/launch/precompile.py): compile, do not run
            dry.submit(kernel, grid, args, kwargs)
        else:
            kernel[grid](*args, **kwargs)
    return out


def gemv_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor | None, silu_mul: bool) -> bool:
    """Layouts the kernel reads: rows contiguous, a 2-d x, no bias with silu_mul."""
    return (x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
            and (bias is None or (bias.is_contiguous() and not silu_mul))
            and (residual is None or residual.stride(-1) == 1))


@functools.cache
def cuda_device(index: int) -> tuple[str, int]:
    """(name, SM count) of GPU `index`."""
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


@functools.cache
def converts_fp8(index: int) -> bool:
    """Triton converts float8_e4m3fn in registers from sm_89 on."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


@functools.lru_cache(maxsize=4096)
def _choice(rows: int, n: int, k: int, key: str, device_index: int | None, backend: str,
            fp8: bool) -> Choice:
    name, sms = cuda_device(device_index) if device_index is not None else (None, 0)
    return launch_config.choose(rows, n, k, key, name, sms, backend, fp8)


def forget_choices() -> None:
    """After the launch table grew (worker/startup/gemv_tuning.py): choose afresh."""
    _choice.cache_clear()


def cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def weight_key(weight: torch.Tensor, n: int, fusion: str) -> str:
    """The launch table's key of a weight [N (2N with silu_mul), K]: N the output's."""
    return launch_config.shape_key(n, weight.shape[1],
                                   str(weight.dtype).removeprefix("torch."), fusion)


def choice_for(x: torch.Tensor, weight: torch.Tensor, silu_mul: bool, norm: bool,
               residual: bool, backend: str) -> Choice:
    """The kernel of this launch (see launch_config.choose): CUDA tensors by this GPU's
    table, CPU tensors by the interpreter's config when it is on, else torch's ops."""
    fp8 = weight.dtype == torch.float8_e4m3fn
    if x.is_cuda:
        device_index = cuda_index(x.device)
        if fp8 and not converts_fp8(device_index):
            return Choice(None, "no fp8 conversion on this GPU")
    elif triton_interpret_enabled():
        device_index = None
    else:
        return Choice(None, "cpu")
    n = out_features(weight, silu_mul)
    key = weight_key(weight, n, fusion_name(norm, silu_mul, residual))
    return _choice(x.shape[0], n, x.shape[1], key, device_index, backend, fp8)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                  weight_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                  norm_weight: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, eps: float = 0.0,
                  silu_mul: bool = False, mm_out_dtype: torch.dtype | None = None,
                  backend: str = "auto") -> torch.Tensor:
    """x [M, K] -> [M, N]: `skinny_linear_torch`'s result, by the GEMV where `backend`
    (--gemv) and the launch table choose it."""
    if gemv_takes(x, weight, bias, residual, silu_mul):
        config = choice_for(x, weight, silu_mul, norm_weight is not None,
                            residual is not None, backend).config
        if config is not None:
            return gemv_triton(x, weight, config, weight_scale, bias, norm_weight,
                               residual, eps, silu_mul)
    return skinny_linear_torch(x, weight, weight_scale, bias, norm_weight, residual, eps,
                               silu_mul, mm_out_dtype)


@torch.library.custom_op("llmfast::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor,
                     weight_scale: torch.Tensor | None, bias: torch.Tensor | None,
                     norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
                     eps: float, silu_mul: bool, mm_out_dtype: torch.dtype | None,
                     backend: str) -> torch.Tensor:
    return skinny_linear(x, weight, weight_scale, bias, norm_weight, residual, eps,
                         silu_mul, mm_out_dtype, backend)


@skinny_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None,
      bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
      residual: torch.Tensor | None, eps: float, silu_mul: bool,
      mm_out_dtype: torch.dtype | None, backend: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features(weight, silu_mul))


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
           bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, eps: float = 0.0, silu_mul: bool = False,
           mm_out_dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """What the layers call (those worker/startup/gemv_routing.py routed here, with their
    `backend`): the op under torch.compile, `skinny_linear` in eager."""
    fn = skinny_linear_op if torch.compiler.is_compiling() else skinny_linear
    return fn(x, weight, weight_scale, bias, norm_weight, residual, eps, silu_mul,
              mm_out_dtype, backend)
