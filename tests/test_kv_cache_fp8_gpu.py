"""`--kv-cache-dtype fp8` on CUDA: the compiled (not interpreted) kernels over a
float8_e4m3fn cache at realistic shapes against the float64 reference on the
dequantized cache; the 1B random preset with an fp8 cache under CUDA graphs, its
logprobs close to a bf16 cache's.

Never run in a session without a GPU: `python -m pytest -m gpu tests/test_kv_cache_fp8_gpu.py`.
"""

from __future__ import annotations

import gc

import pytest
import torch

from llmfast import LLM, SamplingParams
from tests.test_attention_kernels import TOL, reference_out, run_triton_step
from llmfast.attention.triton import launch as attention
from tests.test_kv_cache_fp8_kernels import FP8, expected_fp8, fp8_batch, nan_keys, same_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _check(reqs, *, num_heads: int, num_kv_heads: int, head_dim: int, **kw) -> None:
    b = fp8_batch(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  block_size=16, dtype=torch.bfloat16, device="cuda", pad_tokens=3)
    out, k_cache, _ = run_triton_step(b, **kw)
    live = b["slot_mapping"] >= 0
    written = k_cache.float().view(-1, num_kv_heads, head_dim)[b["slot_mapping"][live]]
    assert same_bytes(written, expected_fp8(b["k"][: live.numel()][live]))
    n = int(b["query_start_loc"][-1])
    ref = reference_out(b)[:n]
    err = (out[:n].double() - ref).abs().max().item() / ref.abs().max().item()
    print(f"fp8 cache, head_dim {head_dim}, {num_heads}/{num_kv_heads} heads: rel err {err:.2e}")
    assert torch.isfinite(out[:n]).all() and err < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_keeps_nan(dtype):
    """A NaN key or value is stored as NaN, whatever its bits (the write puts back the
    NaN its clamp and rounding lose); the rest as the reference write stores them."""
    k = nan_keys(dtype, "cuda")
    v = k.flip(0)
    k_cache = torch.zeros(2, 4, 3, 8, dtype=FP8, device="cuda")
    v_cache = k_cache.clone()
    slots = torch.tensor([5, 0, 7, 2], device="cuda")
    attention.reshape_and_cache(k, v, k_cache, v_cache, slots)
    for cache, x in ((k_cache, k), (v_cache, v)):
        got = cache.view(-1, 3, 8)[slots].float()
        assert torch.equal(got.isnan(), x.isnan())
        assert same_bytes(cache.view(-1, 3, 8)[slots], expected_fp8(x))


@pytest.mark.parametrize("head_dim, num_heads, num_kv_heads", [(64, 32, 8), (128, 32, 8),
                                                               (128, 16, 2)])
def test_decode_attention(head_dim, num_heads, num_kv_heads):
    """Decode at batch 8 over contexts up to 3000 keys (the heuristic splits them)."""
    reqs = [(c, 1) for c in (3000, 1, 17, 511, 1024, 2047, 64, 900)]
    _check(reqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_attention_forced_splits(head_dim):
    _check([(2500, 1)], num_heads=32, num_kv_heads=8, head_dim=head_dim, num_splits=16)


@pytest.mark.parametrize("head_dim, reqs", [
    (64, [(0, 1024)]),  # one causal prefill
    (128, [(0, 1024)]),
    (128, [(700, 300), (1000, 1), (0, 77), (33, 1)]),  # mixed: chunks and decodes
])
def test_prefill_attention(head_dim, reqs):
    _check(reqs, num_heads=32, num_kv_heads=8, head_dim=head_dim)


PROMPT = [128000, 791, 6864, 315, 9822, 374, 12366, 13, 578, 6864, 315, 9635, 374]


def _engine(**kw) -> LLM:
    return LLM("random:llama-3.2-1b", dtype="bfloat16", kv_cache_memory="1GiB",
               max_model_len=512, **kw)


def test_1b_fp8_cache_generates_close_to_bf16_cache():
    """A bf16 cache's greedy 16 tokens with their logprobs (CUDA graphs, the default
    mode); an fp8 cache (CUDA graphs) generates and scores that continuation
    teacher-forced (prompt logprobs), from twice the blocks."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    llm = _engine()
    bf16 = llm.generate([{"prompt_token_ids": PROMPT}], greedy)[0].outputs[0]
    bf16_blocks = llm.engine.runner.num_blocks
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    tokens = bf16.token_ids

    llm = _engine(kv_cache_dtype="fp8")
    assert llm.engine.runner.kv_cache.dtype == FP8
    assert llm.engine.runner.num_blocks == 2 * bf16_blocks
    generated, scored = llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT + tokens}],
        [greedy, SamplingParams(max_tokens=1, prompt_logprobs=0)])
    assert len(generated.outputs[0].token_ids) == 16
    got = torch.tensor([scored.prompt_logprobs[len(PROMPT) + i][t]
                        for i, t in enumerate(tokens)])
    want = torch.tensor([lp[t] for lp, t in zip(bf16.logprobs, tokens)])
    diff = (got - want).abs()
    # Bars ~4x the noise: the same comparison on the CPU (eager, the CPU attention
    # path) measured max 0.20 / mean 0.08 in float32 and max 0.22 / mean 0.07 in
    # bfloat16 (random weights: logprobs ~ -8, a near-flat distribution). A wrong
    # conversion (fp8 bits read as bf16, a lost clamp: NaN) moves whole nats.
    print(f"fp8 vs bf16 KV cache logprobs: max |diff| {diff.max():.4f}, "
          f"mean {diff.mean():.4f}")
    assert torch.isfinite(got).all()
    assert diff.max() < MAX_DIFF and diff.mean() < MEAN_DIFF, (got, want)


MAX_DIFF, MEAN_DIFF = 1.0, 0.3
