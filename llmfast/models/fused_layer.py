"""A decoder layer whose projections carry their neighbours (kernels/gemv/): four launches
and attention a layer, where the plain layer runs two norm kernels, the SiLU-and-mul
and four projections.

    qkv      = norm(residual) @ Wqkv        the input RMSNorm in the GEMV's prologue
    residual = attend(qkv) @ Wo + residual  the residual add in its epilogue
    act      = silu_mul(norm(residual) @ Wgate_up)
    residual = act @ Wdown + residual

The residual stream is one tensor, each sum rounded as the plain layer's
`add_rms_norm` rounds it, so both compute the same values. Launches of at most 16 rows
take the fused Triton GEMV where chosen (launch_config.py), larger ones the separate
torch ops inside the same op: the fused form is for decode-sized batches, opt-in with
`LLMFAST_GEMV_FUSE=1` (read once per process) until a GPU run shows larger batches lose
nothing by it.

Layers it takes: dense MLPs with SiLU, plain RMSNorm weights, no q/k norms, no
gate_up/down biases, one rank (a row-parallel projection's residual add would follow
its all-reduce), projections in the model dtype or fp8.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from llmfast.kernels.gemv.ops import linear as gemv_linear
from llmfast.kernels.triton_mode import triton_interpret_enabled

if TYPE_CHECKING:
    from llmfast.attention.metadata import AttentionMetadata
    from llmfast.config import ModelConfig

_ENABLED: bool | None = None


def gemv_fusion_enabled() -> bool:
    """LLMFAST_GEMV_FUSE=1 (and the GEMV not switched off), read once per process; a
    plain global so Dynamo reads it as a constant."""
    global _ENABLED
    if _ENABLED is None:
        _ENABLED = (os.environ.get("LLMFAST_GEMV_FUSE", "0") == "1"
                    and os.environ.get("LLMFAST_GEMV", "table") != "0")
    return _ENABLED


def fusable(config: ModelConfig, world_size: int) -> bool:
    """Whether every layer of `config` has the fused form's shape."""
    return (world_size == 1 and config.hidden_act == "silu" and not config.norm_offset
            and not config.sandwich_norms and not config.qk_norm and not config.o_bias
            and config.num_experts == 0 and not config.embed_scale)


def takes_fused(x: torch.Tensor) -> bool:
    """On a Triton device (CUDA, or the interpreter) with the fusion on: static."""
    return (x.is_cuda or triton_interpret_enabled()) and gemv_fusion_enabled()


def _projection(layer: torch.nn.Module) -> dict:
    """The weight arguments of a `Linear` or an `Fp8Linear`."""
    if hasattr(layer, "weight_fp8"):
        return dict(weight=layer.weight_fp8, weight_scale=layer.weight_scale,
                    bias=layer.bias, mm_out_dtype=layer.mm_out_dtype)
    return dict(weight=layer.weight, bias=layer.bias)


def fused_layer_forward(layer, positions: torch.Tensor, residual: torch.Tensor,
                        attn_metadata: AttentionMetadata) -> torch.Tensor:
    """A `DecoderLayer` on the residual stream [num_tokens, hidden] -> the stream after
    it (attention's output and the MLP's added)."""
    attn, mlp = layer.self_attn, layer.mlp
    norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
    qkv = gemv_linear(residual, norm_weight=norm_in.weight, eps=norm_in.eps,
                      **_projection(attn.qkv_proj))  # [T, q_size + 2 * kv_size]
    out = attn.attend(positions, qkv, attn_metadata)  # [T, q_size]
    residual = gemv_linear(out, residual=residual, **_projection(attn.o_proj))
    act = gemv_linear(residual, norm_weight=norm_post.weight, eps=norm_post.eps,
                      silu_mul=True, **_projection(mlp.gate_up_proj))  # [T, intermediate]
    return gemv_linear(act, residual=residual, **_projection(mlp.down_proj))
