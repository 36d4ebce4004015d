"""`--quantization fp8` on CUDA: torch._scaled_mm with row-wise scales (sm_89+) against
the float64 fake-quant oracle; the 1B random preset generates with fp8 projections
under CUDA graphs and its logits stay close to bf16's.

Never run in a session without a GPU; `python -m pytest -m gpu tests/test_fp8_gpu.py`."""

from __future__ import annotations

import gc

import pytest
import torch

from llmfast import LLM, SamplingParams
from llmfast.kernels.cpu.linear import Linear
from llmfast.kernels.fp8_linear import scaled_mm_out_dtype
from llmfast.models.quantization.fp8 import Fp8Linear
from llmfast.models.weight_bytes import decode_weight_bytes
from tests.test_fp8 import reference_fp8_linear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _has_fp8_tensor_cores() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_scaled_mm_layer_matches_float64_fake_quant(num_tokens):
    if not _has_fp8_tensor_cores():
        pytest.skip("row-wise _scaled_mm needs sm_89+")
    assert scaled_mm_out_dtype("cuda", torch.bfloat16) == torch.bfloat16
    torch.manual_seed(0)
    layer = Linear(2048, 512, bias=True).to("cuda", torch.bfloat16).requires_grad_(False)
    weight, bias = layer.weight.clone(), layer.bias.clone()
    fp8 = Fp8Linear.from_linear(layer)
    assert fp8.mm_out_dtype == torch.bfloat16  # _scaled_mm, not the fallback
    x = torch.randn(num_tokens, 2048, device="cuda", dtype=torch.bfloat16)
    out = fp8(x)
    want = reference_fp8_linear(x, weight, bias)
    torch.testing.assert_close(out.double(), want, rtol=2**-8,
                               atol=2**-8 * want.abs().max().item())
    # The fallback (dequantized float32) computes the same.
    fp8.mm_out_dtype = None
    torch.testing.assert_close(fp8(x), out, rtol=2**-7, atol=2**-7 * out.abs().max().item())


PROMPT = [128000, 791, 6864, 315, 9822, 374, 12366, 13, 578, 6864, 315, 9635, 374]


def _engine(**kw) -> LLM:
    return LLM("random:llama-3.2-1b", dtype="bfloat16", kv_cache_memory="1GiB",
               max_model_len=512, **kw)


def test_1b_fp8_generates_close_to_bf16():
    """bf16 (eager) greedy 16 tokens with their logprobs; fp8 (CUDA graphs, the default
    mode) generates, and scores bf16's continuation teacher-forced (prompt logprobs)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=0)
    llm = _engine(enforce_eager=True)
    bf16 = llm.generate([{"prompt_token_ids": PROMPT}], greedy)[0].outputs[0]
    bf16_bytes = decode_weight_bytes(llm.engine.runner.model)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    tokens = bf16.token_ids

    llm = _engine(quantization="fp8")
    generated, scored = llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT + tokens}],
        [greedy, SamplingParams(max_tokens=1, prompt_logprobs=0)])
    assert len(generated.outputs[0].token_ids) == 16
    # Projections halved; embedding, lm_head and norms not (1B: ~0.6 of the bytes left).
    assert decode_weight_bytes(llm.engine.runner.model) < 0.65 * bf16_bytes
    got = torch.tensor([scored.prompt_logprobs[len(PROMPT) + i][t]
                        for i, t in enumerate(tokens)])
    want = torch.tensor([lp[t] for lp, t in zip(bf16.logprobs, tokens)])
    diff = (got - want).abs()
    # fp8 noise on the decode logprobs. Random weights give a near-flat distribution
    # (every logprob ~ -8), so it is large next to a real model's: the same fp8 math on
    # the CPU (its float32 fallback) measured max 0.56, mean 0.23. A wrong scale or
    # layout moves them by whole nats.
    print(f"fp8 vs bf16 logprobs: max |diff| {diff.max():.4f}, mean {diff.mean():.4f}")
    assert diff.max() < 1.5 and diff.mean() < 0.5, (got, want)
