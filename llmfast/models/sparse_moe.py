"""The sparse MLP of a mixture-of-experts layer (Qwen3-MoE, Mixtral): a router (a linear
layer to one logit per expert), each token's top-k experts (kernels/moe/routing.py),
and the picked experts' SwiGLU MLPs weighted and summed by one op (kernels/moe/ops.py).

The experts' weights are stacked per layer, each parameter 2-D so that one checkpoint
tensor fills a block of its rows (as q/k/v fill qkv_proj: models/loading/loader_target.py):
- `gate_up_weight` [E * 2I, H]: expert e's gate rows, then its up rows, from row e * 2I;
  seen as w13 [E, 2I, H];
- `down_weight` [E * H, I]: expert e's down projection from row e * H; seen as w2 [E, H, I].

Tensor parallelism (models/sharding.py): every rank holds every expert, with its slice
of their intermediate columns (gate/up rows, down columns), as the dense MLP splits; the
router is replicated, so all ranks route alike; one all-reduce sums the partial outputs.
"""

from __future__ import annotations

import torch
from torch import nn

from llmfast.config import ModelConfig
from llmfast.distributed import TensorParallelGroup, all_reduce
from llmfast.kernels.cpu.linear import Linear
from llmfast.kernels.moe.ops import fused_moe_impl
from llmfast.kernels.moe.routing import select_experts


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        # Allocated where and as the loader says (models/loading/loader.py's allocate_as);
        # every row is overwritten by the checkpoint or the random fill.
        self.gate_up_weight = nn.Parameter(
            torch.empty(num_experts * 2 * intermediate_size, hidden_size))
        self.down_weight = nn.Parameter(
            torch.empty(num_experts * hidden_size, intermediate_size))

    @property
    def w13(self) -> torch.Tensor:  # [E, 2I, H]
        return self.gate_up_weight.view(self.num_experts, 2 * self.intermediate_size,
                                        self.hidden_size)

    @property
    def w2(self) -> torch.Tensor:  # [E, H, I]
        return self.down_weight.view(self.num_experts, self.hidden_size,
                                     self.intermediate_size)


class SparseMoeBlock(nn.Module):
    """`config`: this rank's view (its slice of the experts' intermediate size)."""

    def __init__(self, config: ModelConfig, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size,
                               config.moe_intermediate_size)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        # Compiled graphs record the op; eager calls skip its dispatcher.
        moe = torch.ops.llmfast.fused_moe if torch.compiler.is_compiling() else fused_moe_impl
        out = moe(x, self.experts.w13, self.experts.w2, topk_weights, topk_ids)
        return all_reduce(out, self.tp) if self.tp.world_size > 1 else out
