"""Structured outputs through the engine on a tiny random model (a byte-level BPE
tokenizer): every output of a JSON schema validates with `jsonschema`, a regex output
matches it, a choice is one of the list, a grammar's output is in its language, at
temperature 0 and 1, with sync and async scheduling; unconstrained rows mixed in the same
batch give exactly the tokens they give alone; preemption (recompute) rebuilds the
matcher; a constraint that does not compile is refused with one line."""

from __future__ import annotations

import json
import logging
import re

import jsonschema
import pytest
import torch

from llmfast import LLM, SamplingParams
from llmfast.core.request import RequestRejected
from llmfast.structured_params import StructuredOutputs, StructuredOutputsError
from llmfast.worker.sampling.grammar_bitmask import apply_grammar_bitmask
from tests.helpers.chat_model import make_chat_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                 "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "ok"],
    "additionalProperties": False,
}
POINTS = {"type": "array", "minItems": 2, "maxItems": 4,
          "items": {"type": "object", "properties": {
              "x": {"type": "integer", "minimum": -5, "maximum": 5},
              "y": {"type": "integer", "exclusiveMinimum": 0, "maximum": 9}},
              "required": ["x", "y"], "additionalProperties": False}}
REGEX = r"[a-f]{2,6}-[0-9]{1,3}"
CHOICES = ("yes", "no", "it depends")
EBNF = 'root ::= "(" num ("+" num){0,3} ")"\nnum ::= [1-9] [0-9]?'
LARK = 'start: "<" WORD ">"\nWORD: /[a-z]{1,5}/'
PROMPTS = ["hello there", "The capital of France is", "Tell me a story", "you are"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("structured") / "tiny")


def _llm(model_dir, async_scheduling=True, **kw):
    args = dict(device="cpu", max_model_len=512, block_size=16, seed=0)
    args.update(kw)
    return LLM(str(model_dir), async_scheduling=async_scheduling, **args)


def _params(spec: StructuredOutputs, temperature: float, seed: int | None = None,
            max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured=spec)


def _check(spec: StructuredOutputs, text: str) -> None:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), json.loads(spec.json))
    elif spec.json_object:
        assert isinstance(json.loads(text), dict)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice
    elif spec.grammar == EBNF:
        assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?){0,3}\)", text), text
    else:
        assert re.fullmatch(r"<[a-z]{1,5}>", text), text


SPECS = [StructuredOutputs(json=PERSON), StructuredOutputs(json=POINTS),
         StructuredOutputs(regex=REGEX), StructuredOutputs(choice=CHOICES),
         StructuredOutputs(grammar=EBNF), StructuredOutputs(grammar=LARK)]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_follows_its_constraint(model_dir, temperature, async_scheduling,
                                             caplog):
    llm = _llm(model_dir, async_scheduling)
    prompts, params = [], []
    for i, spec in enumerate(SPECS):
        for j, prompt in enumerate(PROMPTS):
            prompts.append(prompt)
            params.append(_params(spec, temperature, seed=None if j % 2 else 10 * i + j))
    outs = llm.generate(prompts, params)
    for p, out in zip(params, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (p.structured, c.text)
        _check(p.structured, c.text)
    # Random rows explore: the outputs differ (the mask does not force one answer).
    if temperature:
        assert len({o.outputs[0].text for o in outs[:4]}) > 1
    assert llm.engine.stats().kv_cache_usage == 0.0
    # No matcher fell back to unconstrained (a refused token, a failed compile).
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_ended_grammar_allows_only_its_stop_token(model_dir, async_scheduling):
    """With ignore_eos the request runs to max_tokens: past the grammar's end it can only
    repeat the stop token, so its text stays what the grammar accepted."""
    llm = _llm(model_dir, async_scheduling)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=150, ignore_eos=True,
                             structured=spec)
              for t, s, spec in ((0.0, None, SPECS[3]), (1.0, 4, SPECS[2]),
                                 (1.0, 5, SPECS[0]))]
    for p, out in zip(params, llm.generate(PROMPTS[:3], params)):
        c = out.outputs[0]
        assert len(c.token_ids) == 150 and c.token_ids[-1] == 2  # <|im_end|>
        _check(p.structured, c.text)


def test_grammars_are_compiled_once_per_constraint(model_dir):
    from llmfast.structured.compiler import GrammarCache
    from llmfast.tokenizer import load_tokenizer

    loads = []

    def load():
        loads.append(1)
        return load_tokenizer(model_dir).hf

    cache = GrammarCache(load, 320, (2,))
    a = cache.submit(StructuredOutputs(json={"type": "object"}))
    b = cache.submit(StructuredOutputs(json='{"type":  "object"}'))
    c = cache.submit(StructuredOutputs(regex="x+"))
    assert a is b and a is not c
    assert a.result() is b.result() and c.result() is not None
    assert loads == [1]  # the vocabulary's table is built once
    cache.shutdown()


def test_json_object_gives_an_object(model_dir):
    llm = _llm(model_dir)
    spec = StructuredOutputs(json_object=True)
    params = [_params(spec, 1.0, seed=i, max_tokens=200) for i in range(8)]
    outs = llm.generate(PROMPTS * 2, params)
    done = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert done  # a random model may nest deep: the ones that finished must parse
    for c in done:
        _check(spec, c.text)
    for o in outs:  # the unfinished ones are a prefix of an object
        assert o.outputs[0].text.startswith("{")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_unconstrained_rows_are_untouched_by_constrained_neighbours(model_dir,
                                                                    async_scheduling):
    llm = _llm(model_dir, async_scheduling)
    plain = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)]
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], plain)]
    mixed_params = [_params(SPECS[0], 0.0), plain[0], _params(SPECS[2], 1.0, seed=1),
                    plain[1], _params(SPECS[3], 1.0)]
    mixed = llm.generate(PROMPTS[:1] * 2 + PROMPTS[1:2] * 2 + PROMPTS[2:3], mixed_params)
    assert mixed[1].outputs[0].token_ids == alone[0]
    assert mixed[3].outputs[0].token_ids == alone[1]
    for i in (0, 2, 4):
        _check(mixed_params[i].structured, mixed[i].outputs[0].text)


def test_preemption_rebuilds_the_matcher(model_dir):
    """Greedy constrained outputs under a cache so small that requests are preempted and
    recomputed equal those of a roomy cache, and all validate."""
    prompts = [p + f" {i}" for i in range(3) for p in PROMPTS]
    params = [_params(SPECS[i % 3], 0.0) for i in range(len(prompts))]
    roomy = _llm(model_dir).generate(prompts, params)
    small = _llm(model_dir, num_gpu_blocks_override=14, max_model_len=160)
    tight = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    for p, a, b in zip(params, roomy, tight):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        _check(p.structured, b.outputs[0].text)


@pytest.mark.parametrize("spec, cause", [
    (dict(json={"type": "object", "properties": {"a": {"type": 5}}}), "invalid JSON schema"),
    (dict(regex="[a-"), "invalid regex: .*Unclosed"),
    (dict(grammar="root ::= ("), "invalid grammar: EBNF parser error"),
    (dict(grammar="start: ("), "invalid grammar: Lark error"),
])
def test_a_constraint_that_does_not_compile_is_refused(model_dir, spec, cause):
    llm = _llm(model_dir)
    with pytest.raises(RequestRejected, match=cause) as exc:
        llm.engine.add_request("hi", SamplingParams(structured=StructuredOutputs(**spec)))
    assert "\n" not in str(exc.value)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs, cause", [
    (dict(), "exactly one of"), (dict(regex="a", choice=["b"]), "exactly one of"),
    (dict(choice="abc"), "list of strings"), (dict(choice=[]), "non-empty"),
    (dict(json="{not json"), "not valid JSON"), (dict(regex=""), "non-empty string"),
])
def test_structured_outputs_checks_its_shape(kwargs, cause):
    with pytest.raises(StructuredOutputsError, match=cause):
        StructuredOutputs(**kwargs)


def test_same_schema_spaced_two_ways_is_one_key():
    a = StructuredOutputs(json={"type": "object", "required": ["a"]})
    b = StructuredOutputs(json='{ "type":"object",\n  "required": [ "a" ] }')
    assert a.key == b.key and hash(a) == hash(b)
    # Property order is the output's: not the same grammar.
    assert StructuredOutputs(json='{"required": ["a"], "type": "object"}').key != a.key


def test_bitmask_apply_matches_a_naive_loop():
    """The one-kernel apply against bit-by-bit reading of the words."""
    g = torch.Generator().manual_seed(0)
    n, vocab = 5, 70  # 3 words a row, the last partly used
    logits = torch.randn(n, vocab, generator=g)
    bitmask = torch.randint(-2**31, 2**31 - 1, (n, 3), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    expected = logits.clone()
    for r in range(n):
        for t in range(vocab):
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    apply_grammar_bitmask(logits, bitmask)
    assert torch.equal(logits, expected)
