"""The MoE layer's kernels against a float64 oracle (tests/helpers/moe.py): the router's
choice against HF's routers, the CPU torch form in-process, and the Triton form (align,
grouped gate/up with SiLU-and-mul, grouped down with the routing weights, top-k sum) under
the Triton interpreter in a child process (see tests/test_attention_kernels.py for why a
child), at small shapes that exercise partial tiles, unpicked experts, one expert picked
by every token, and several blocks per expert."""

from __future__ import annotations

import pytest
import torch

from llmfast.kernels.moe.routing import select_experts
from llmfast.kernels.moe.torch_moe import fused_moe_torch
from tests.helpers.moe import moe_reference, random_moe_inputs

# Relative to the output's scale (|reference| ~ 1 here).
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}

# (tokens, experts, top_k, hidden, intermediate, every token on expert 0)
SHAPES = [
    (1, 4, 2, 32, 48, False),  # decode: one row per picked expert, partial column tiles
    (5, 8, 3, 40, 32, False),  # hidden not a multiple of the K tile; experts unpicked
    (40, 4, 2, 64, 64, False),  # several blocks per expert
    (17, 6, 1, 32, 16, True),  # top-1, every token on one expert
    (9, 3, 3, 16, 32, False),  # top_k == experts: every expert takes every token
]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.double() - want).abs().max().item()
    scale = want.abs().max().item()
    assert err <= TOL[dtype] * max(scale, 1.0), f"max error {err:.3g} at scale {scale:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_torch_form_matches_float64(shape, dtype):
    tokens, experts, top_k, hidden, inter, one = shape
    inputs = random_moe_inputs(tokens, experts, top_k, hidden, inter, dtype, one_expert=one)
    _close(fused_moe_torch(*inputs), moe_reference(*inputs), dtype)


def test_torch_form_decode_row_split():
    """64 rows and fewer take the CPU row-split GEMM (kernels/cpu/linear.py), more take
    F.linear: both against the oracle, with more than 64 rows on one expert."""
    inputs = random_moe_inputs(80, 4, 2, 64, 32, torch.float32, seed=3, one_expert=True)
    _close(fused_moe_torch(*inputs), moe_reference(*inputs), torch.float32)


@pytest.mark.parametrize("renormalize", [False, True])
def test_routing_matches_hf_qwen3_moe(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                            norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(0))
    logits, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(logits, 4, renormalize)
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32


def test_routing_matches_hf_mixtral():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
    router = MixtralTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(11, 32, generator=torch.Generator().manual_seed(1))
    logits, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(logits, 2, renormalize=True)
    assert torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(weights, hf_weights, rtol=0, atol=0)


# ------------------------------------------------------------------ Triton, interpreted


@pytest.fixture(scope="module")
def interpreter():
    from tests.test_attention_kernels import interpreter_child

    yield from interpreter_child(__file__)


def check_triton(shape: list, dtype: str) -> None:
    from llmfast.kernels.moe.triton_moe import fused_moe_triton

    tokens, experts, top_k, hidden, inter, one = shape
    dt = getattr(torch, dtype)
    inputs = random_moe_inputs(tokens, experts, top_k, hidden, inter, dt, seed=tokens,
                               one_expert=one)
    _close(fused_moe_triton(*inputs), moe_reference(*inputs), dt)


def check_align(tokens: int, experts: int, top_k: int, block_m: int) -> None:
    """The align kernel's grouping against a naive loop: each expert's pairs in pair
    order, padded to block_m with the pair count, its blocks named; unpicked experts get
    no block."""
    import triton

    from llmfast.kernels.moe import triton_kernels as kernels
    from llmfast.kernels.moe.triton_moe import max_padded_pairs

    ids = random_moe_inputs(tokens, experts, top_k, 8, 8, torch.float32, seed=7)[4]
    flat = ids.reshape(-1)
    pairs = flat.numel()
    padded = max_padded_pairs(pairs, experts, block_m)
    sorted_pairs = torch.full((padded,), -1, dtype=torch.int32)
    block_experts = torch.full((padded // block_m,), -1, dtype=torch.int32)
    num_padded = torch.zeros(1, dtype=torch.int32)
    kernels.moe_align_kernel[(experts,)](flat, sorted_pairs, block_experts, num_padded, pairs,
                                         BLOCK_M=block_m,
                                         BLOCK_E=triton.next_power_of_2(experts), BLOCK_P=16)
    want_pairs, want_blocks = [], []
    for e in range(experts):
        mine = [p for p in range(pairs) if int(flat[p]) == e]
        group = -(-len(mine) // block_m) * block_m
        want_pairs += mine + [pairs] * (group - len(mine))
        want_blocks += [e] * (group // block_m)
    assert int(num_padded) == len(want_pairs) <= padded
    assert sorted_pairs[:len(want_pairs)].tolist() == want_pairs
    assert block_experts[:len(want_blocks)].tolist() == want_blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_matches_float64(interpreter, shape, dtype):
    interpreter("check_triton", shape=list(shape), dtype=dtype)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"),
                         [(1, 4, 2, 16), (37, 8, 2, 16), (50, 5, 3, 32), (3, 64, 4, 16)])
def test_align_groups_pairs_by_expert(interpreter, tokens, experts, top_k, block_m):
    interpreter("check_align", tokens=tokens, experts=experts, top_k=top_k, block_m=block_m)


if __name__ == "__main__":  # the interpreter child (TRITON_INTERPRET=1)
    from tests.test_attention_kernels import _serve

    _serve(globals())
