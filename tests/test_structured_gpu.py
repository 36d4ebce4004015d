"""Structured outputs on a CUDA device: the bitmask's copy and xgrammar's Triton apply
kernel against the CPU one, and constrained outputs that validate with async scheduling
and CUDA graphs on."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from llmfast import LLM, SamplingParams
from llmfast.structured_params import StructuredOutputs
from llmfast.worker.sampling.grammar_bitmask import apply_grammar_bitmask
from tests.helpers.chat_model import make_chat_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 99}, "c": {"enum": ["x", "y"]},
    "s": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
    "required": ["n", "c", "s"], "additionalProperties": False}


def test_apply_on_cuda_matches_cpu():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (64, 1536), generator=g,
                            dtype=torch.int64).to(torch.int32)
    cpu = logits.clone()
    apply_grammar_bitmask(cpu, bitmask)
    dev = logits.cuda()
    apply_grammar_bitmask(dev, bitmask.cuda())
    assert torch.equal(dev.cpu(), cpu)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_outputs_on_cuda(tmp_path, temperature):
    model = make_chat_model(tmp_path / "tiny")
    llm = LLM(str(model), device="cuda", max_model_len=512)
    specs = [StructuredOutputs(json=SCHEMA), StructuredOutputs(regex=r"[a-c]{2}-[0-9]"),
             StructuredOutputs(choice=["left", "right"])] * 8
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=100, structured=s)
              for i, s in enumerate(specs)] + [SamplingParams(max_tokens=20, ignore_eos=True)]
    outs = llm.generate(["hello there"] * len(params), params)
    for p, o in zip(params, outs):
        text = o.outputs[0].text
        if p.structured is None:
            assert len(o.outputs[0].token_ids) == 20
        elif p.structured.json is not None:
            jsonschema.validate(json.loads(text), SCHEMA)
        elif p.structured.regex is not None:
            assert re.fullmatch(r"[a-c]{2}-[0-9]", text), text
        else:
            assert text in ("left", "right")
