"""The fused MoE layer and the mixtures of experts on CUDA: the Triton layer against the
per-expert form in float64 at the presets' layer shapes; captured once in a CUDA graph
and replayed on other routings (no host sync, no routing-dependent shape). The engine's
greedy tokens against HF's in every execution mode: tests/test_families_gpu.py.

Never run without a GPU; `python -m pytest -m gpu tests/test_moe_gpu.py` on a CUDA
machine (scripts/gpu_check.py's `moe` step runs the benchmark beside it)."""

from __future__ import annotations

import pytest
import torch

from llmfast.kernels.moe.torch_moe import fused_moe_torch
from llmfast.kernels.moe.triton_moe import fused_moe_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (experts, top_k, hidden, intermediate): Qwen3-30B-A3B's layer, Mixtral's with a
# narrower intermediate (its float64 oracle's memory), a TP=4 shard of Qwen's.
SHAPES = [(128, 8, 2048, 768), (8, 2, 4096, 2048), (128, 8, 2048, 192)]


def _inputs(tokens, experts, top_k, hidden, inter, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen)
           * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen)
          * inter**-0.5).to(dtype)
    return x, w13, w2, *_routing(tokens, experts, top_k, dtype, gen)


def _routing(tokens, experts, top_k, dtype, gen):
    weights, ids = torch.topk(torch.rand(tokens, experts, device="cuda", generator=gen),
                              top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(dtype), ids.to(torch.int32)


def _oracle(x, w13, w2, weights, ids):
    return fused_moe_torch(x.double(), w13.double(), w2.double(), weights.double(), ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 64, 512])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_matches_float64(shape, tokens, dtype):
    args = _inputs(tokens, *shape, dtype, seed=tokens)
    want = _oracle(*args)
    got = fused_moe_triton(*args)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    err = (got.double() - want).abs().max().item()
    assert err <= tol * max(want.abs().max().item(), 1.0), err


@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_fused_replays_from_a_cuda_graph(tokens):
    """Captured on one routing, replayed on three others (written into the captured
    inputs), each equal to a fresh eager call on the same routing."""
    experts, top_k, hidden, inter = SHAPES[0]
    x, w13, w2, weights, ids = _inputs(tokens, *SHAPES[0], torch.bfloat16, seed=1)
    fused_moe_triton(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w13, w2, weights, ids)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(3):
        new_weights, new_ids = _routing(tokens, experts, top_k, torch.bfloat16, gen)
        if tokens > 1:
            new_ids[: tokens // 2] = torch.arange(top_k, device="cuda", dtype=torch.int32)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        x.normal_(generator=gen)
        graph.replay()
        torch.testing.assert_close(out, fused_moe_triton(x, w13, w2, weights, ids),
                                   rtol=0, atol=0)
