"""The fused MoE layer and the mixtures of experts on CUDA: the Triton layer against the
per-expert form in float64 at the presets' layer shapes; captured once in a CUDA graph
and replayed on other routings (no host sync, no routing-dependent shape); the engine's
greedy tokens equal HF's (fp32) in every execution mode, CUDA graphs included.

Never run without a GPU; `python -m pytest -m gpu tests/test_moe_gpu.py` on a CUDA
machine (scripts/gpu_check.py's `moe` step runs the benchmark beside it)."""

from __future__ import annotations

import pytest
import torch

from llmfast import LLM
from llmfast.kernels.moe.torch_moe import fused_moe_torch
from llmfast.kernels.moe.triton_moe import fused_moe_triton
from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.workloads import greedy_params, random_workload
from tests.test_engine_gpu import MODES, hf_greedy_on_gpu

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


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_env(request, tmp_path_factory):
    family = request.param
    path = make_hf_checkpoint(tmp_path_factory.mktemp(f"gpu-{family}") / "ckpt",
                              family=family, hidden_size=256, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64)
    prompts, lengths = random_workload(12, shared_prefix=20)
    return path, prompts, lengths, hf_greedy_on_gpu(load_hf_model(path).cuda(), prompts,
                                                    lengths)


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_matches_hf_on_gpu(moe_env, mode):
    path, prompts, lengths, tokens = moe_env
    llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=128, block_size=16,
              max_num_batched_tokens=32, max_num_seqs=8, num_gpu_blocks_override=10,
              **MODES[mode])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(lengths))
    assert [o.outputs[0].token_ids for o in outs] == tokens
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
