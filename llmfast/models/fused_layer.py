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
`--gemv-fuse` (worker/startup/gemv_routing.py) until a GPU run shows larger batches lose nothing
by it.

Layers it takes: dense MLPs with SiLU, plain RMSNorm weights, no q/k norms, no
gate_up/down biases, one rank (a row-parallel projection's residual add would follow
its all-reduce), projections in the model dtype or fp8.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from llmfast.kernels.gemv.ops import linear as gemv_linear

if TYPE_CHECKING:
    from llmfast.attention.metadata import AttentionMetadata
    from llmfast.config import ModelConfig


def fusable(config: ModelConfig, world_size: int) -> bool:
    """Whether every layer of `config` has the fused form's shape."""
    return (world_size == 1 and config.hidden_act == "silu" and not config.norm_offset
            and not config.sandwich_norms and not config.qk_norm and not config.o_bias
            and config.num_experts == 0 and not config.embed_scale)


def projection_weights(layer: torch.nn.Module) -> dict:
    """The weight arguments of a `Linear` or an `Fp8Linear`."""
    if hasattr(layer, "weight_fp8"):
        return dict(weight=layer.weight_fp8, weight_scale=layer.weight_scale,
                    bias=layer.bias, mm_out_dtype=layer.mm_out_dtype)
    return dict(weight=layer.weight, bias=layer.bias)


def fused_projections(layer) -> dict[str, tuple[torch.nn.Module, dict]]:
    """A `DecoderLayer`'s four fused launches: kind -> (projection layer, what is fused
    around it: the `skinny_linear` keywords besides x and the residual)."""
    attn, mlp = layer.self_attn, layer.mlp
    norm_in, norm_post = layer.input_layernorm, layer.post_attention_layernorm
    return {"qkv": (attn.qkv_proj, dict(norm_weight=norm_in.weight, eps=norm_in.eps)),
            "o": (attn.o_proj, {}),
            "gate_up": (mlp.gate_up_proj, dict(norm_weight=norm_post.weight,
                                               eps=norm_post.eps, silu_mul=True)),
            "down": (mlp.down_proj, {})}


# The launches that add the residual stream in their epilogue.
RESIDUAL_KINDS = ("o", "down")


def fused_layer_forward(layer, positions: torch.Tensor, residual: torch.Tensor,
                        attn_metadata: AttentionMetadata, backend: str) -> torch.Tensor:
    """A `DecoderLayer` on the residual stream [num_tokens, hidden] -> the stream after
    it (attention's output and the MLP's added); `backend`: --gemv's."""
    launches = {kind: dict(backend=backend, **fusions, **projection_weights(proj))
                for kind, (proj, fusions) in fused_projections(layer).items()}
    qkv = gemv_linear(residual, **launches["qkv"])  # [T, q_size + 2 * kv_size]
    out = layer.self_attn.attend(positions, qkv, attn_metadata)  # [T, q_size]
    residual = gemv_linear(out, residual=residual, **launches["o"])
    act = gemv_linear(residual, **launches["gate_up"])  # [T, intermediate]
    return gemv_linear(act, residual=residual, **launches["down"])
