"""`logit_bias` and `allowed_token_ids` through the engine: greedy tokens equal HF
transformers' argmax over the same edited logits, in a batch that mixes requests with
and without them, while rows finish and the batch moves the others (sync and async
scheduling); ids outside the vocabulary are refused with one line."""

from __future__ import annotations

import math

import pytest
import torch

from llmfast import LLM, SamplingParams
from llmfast.core.request import RequestRejected
from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint

VOCAB = 256


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("logit_rules") / "ckpt", vocab_size=VOCAB)


def _hf_greedy_with_rules(hf, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy by HF, editing each step's logits densely with the params' rules."""
    bias = torch.zeros(VOCAB)
    for token, value in (params.logit_bias or {}).items():
        bias[token] = value
    banned = torch.zeros(VOCAB, dtype=torch.bool)
    if params.allowed_token_ids is not None:
        banned[:] = True
        banned[list(params.allowed_token_ids)] = False
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(params.max_tokens):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1].float()
            out.append(int((logits.masked_fill(banned, -math.inf) + bias).argmax()))
    return out


GREEDY = dict(temperature=0.0, ignore_eos=True)
MIXED = [  # the first finishes first: the last row moves up into its place
    SamplingParams(max_tokens=2, **GREEDY),
    SamplingParams(max_tokens=8, logit_bias={17: 4.0, 200: 6.0, 31: -100.0}, **GREEDY),
    SamplingParams(max_tokens=8, allowed_token_ids=[5, 50, 99, 140], **GREEDY),
    SamplingParams(max_tokens=6, **GREEDY),
    SamplingParams(max_tokens=8, allowed_token_ids=[7, 8, 9], logit_bias={9: -1.5}, **GREEDY),
]
# Only the row that moves has rules: the batch must move its flag with it.
MOVED = [SamplingParams(max_tokens=2, **GREEDY), SamplingParams(max_tokens=8, **GREEDY),
         SamplingParams(max_tokens=8, allowed_token_ids=[11, 12], **GREEDY)]


@pytest.mark.parametrize("params", [MIXED, MOVED], ids=["mixed", "moved"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_with_logit_rules_matches_hf(ckpt, params, async_scheduling):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
               for n in (5, 9, 3, 12, 7)[: len(params)]]
    llm = LLM(str(ckpt), device="cpu", max_model_len=64, block_size=4,
              async_scheduling=async_scheduling)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    hf = load_hf_model(ckpt)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.outputs[0].token_ids == _hf_greedy_with_rules(hf, prompt, p), p
        if p.allowed_token_ids:
            assert set(out.outputs[0].token_ids) <= set(p.allowed_token_ids)
    assert llm.engine.stats().kv_cache_usage == 0.0


def test_a_strong_bias_forces_its_token_in_random_sampling(ckpt):
    llm = LLM(str(ckpt), device="cpu", max_model_len=64, block_size=4)
    out = llm.generate({"prompt_token_ids": [3, 4, 5]},
                       SamplingParams(max_tokens=6, seed=1, logit_bias={42: 100.0},
                                      ignore_eos=True))
    assert out[0].outputs[0].token_ids == [42] * 6


@pytest.mark.parametrize("params", [SamplingParams(logit_bias={VOCAB: 1.0}),
                                    SamplingParams(allowed_token_ids=[1, VOCAB + 5])])
def test_ids_outside_the_vocabulary_are_refused(ckpt, params):
    llm = LLM(str(ckpt), device="cpu", max_model_len=64, block_size=4)
    with pytest.raises(RequestRejected, match=r"outside the vocabulary \[0, 256\)") as exc:
        llm.engine.add_request({"prompt_token_ids": [3, 4]}, params)
    assert "\n" not in str(exc.value)
    assert not llm.engine.has_unfinished()
