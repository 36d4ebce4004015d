"""A `DecoderLayer` on the eager torch path (the CPU) as one function: the same values in
the same ops as the layer's `forward`, less the host work around them.

On the CPU a decode step is the weights' streaming plus per-op host work, and the host
work was most of the rest (profiles/cpu.md): each `nn.Module.__call__`, each parameter
read through `nn.Module.__getattr__`, each kernel choice (`is_compiling`, the Triton
checks), and each op costs several times its hot cost right after a projection has
streamed its weights through the caches. So this layer
- calls the projections' `forward` directly (no `__call__`), and a packed projection
  before a residual add leaves its bfloat16 result for the add to widen (the same
  values, the cast inside the add's call: `Int4Linear.forward_unwidened`);
- runs the norms' torch maths without the kernel choice;
- attends through `Attention.attend_cpu`, which takes what every layer of the step
  shares (rotary rows, padding flag, attention plan) from the step's memo
  (attention/cpu_step.py).

`DecoderModel` runs it for eager steps whose metadata carries a memo (the runner's on
the CPU), never under torch.compile; tests/test_cpu_step.py checks the logits equal the
modules' forwards bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmfast.attention.cpu_step import CpuStepState
from llmfast.attention.metadata import AttentionMetadata
from llmfast.kernels.cpu.int4_linear import Int4Linear
from llmfast.kernels.layers.rms_norm import rms_norm_reference
from llmfast.models.sparse_moe import SparseMoeBlock


def cpu_layer_forward(layer: nn.Module, positions: torch.Tensor, hidden: torch.Tensor,
                      residual: torch.Tensor | None, attn_metadata: AttentionMetadata,
                      step: CpuStepState) -> tuple[torch.Tensor, torch.Tensor]:
    """`DecoderLayer.forward`: (this layer's MLP output, the residual stream before it).
    The output may be bfloat16 (a packed down_proj's): the next layer's add, or the
    final norm's, widens it."""
    norm = layer.input_layernorm
    if residual is None:  # the first layer: the embeddings are the residual
        residual = hidden
    else:
        residual = hidden + residual  # (add_rms_norm's sum)
    hidden = rms_norm_reference(residual, norm.weight, norm.eps, norm.offset)
    attn = layer.self_attn
    qkv = attn.qkv_proj.forward(hidden)
    hidden = _unwidened(attn.o_proj)(attn.attend_cpu(positions, qkv, attn_metadata, step))
    norm = layer.post_attention_layernorm
    residual = hidden + residual  # float32 (a packed projection's bfloat16 widens)
    hidden = rms_norm_reference(residual, norm.weight, norm.eps, norm.offset)
    mlp = layer.mlp
    if type(mlp) is SparseMoeBlock:  # a sparse MLP: its own forward
        return mlp.forward(hidden), residual
    gate, up = mlp.gate_up_proj.forward(hidden).chunk(2, dim=-1)
    gate = F.gelu(gate, approximate="tanh") if mlp.tanh_gelu else F.silu(gate)
    return _unwidened(mlp.down_proj)(gate * up), residual


def _unwidened(proj: nn.Module):
    """The projection's forward, or a packed one's that may leave its result in
    bfloat16 for the residual add to widen."""
    return proj.forward_unwidened if type(proj) is Int4Linear else proj.forward
