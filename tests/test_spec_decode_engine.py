"""Speculative decoding end to end on tiny random checkpoints: greedy output equals HF
transformers' (each prompt alone) with n-gram drafts, for Llama, Qwen2 and Qwen3, in
batches, under chunked prefill, preemption and prefix-cache hits; a proposer that
replays the target's own greedy tokens is accepted in full; stops mid-way through the
emitted tokens; requests that get no drafts share the steps of those that do."""

# ruff: noqa: F811 (the tests take test_engine_families' fixture `family_env` by name)
from __future__ import annotations

import random
import shutil

import pytest
import torch

from llmfast import LLM, SamplingParams
from llmfast.worker.spec_decode.replay_proposer import ReplayProposer
from tests.test_engine_families import family_env  # noqa: F401  (fixture)

FAMILIES = ("llama", "qwen2", "qwen3")


def copy_workload(seed: int, shared_prefix: int = 0, num: int = 12):
    """Prompts that repeat a short random pattern (with a few edits), behind a shared
    prefix: n-gram lookup finds drafts, some right and some wrong. Output lengths 4-29."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 256) for _ in range(shared_prefix)]
    prompts = []
    for _ in range(num):
        pattern = [rng.randrange(3, 256) for _ in range(rng.randrange(2, 9))]
        body = (pattern * 10)[:rng.randrange(6, 36)]
        for _ in range(rng.randrange(0, 3)):
            body[rng.randrange(len(body))] = rng.randrange(3, 256)
        prompts.append(prefix + body)
    lengths = [rng.randrange(4, 30) for _ in range(num)]
    return prompts, lengths


def _llm(ckpt, **kw):
    args = dict(device="cpu", max_model_len=128, block_size=4, seed=0,
                speculative_method="ngram", num_speculative_tokens=3)
    args.update(kw)
    return LLM(str(ckpt), **args)


def _generate(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0] for o in outs]


def _greedy(lengths, **kw):
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)
            for n in lengths]


def _check(llm, prompts, lengths, oracle):
    outs = _generate(llm, prompts, _greedy(lengths))
    for p, n, out in zip(prompts, lengths, outs):
        assert out.finish_reason == "length"
        assert out.token_ids == oracle(p, n)
    stats = llm.engine.stats()
    # Drafts were verified, some accepted and some rejected: both paths ran.
    assert stats.spec_num_verify_steps > 0
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    assert stats.kv_cache_usage == 0.0
    return stats


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_greedy_matches_hf(family_env, family):
    ckpt, oracle = family_env(family)
    prompts, lengths = copy_workload(0)
    _check(_llm(ckpt), prompts, lengths, oracle)


@pytest.mark.parametrize("k", [1, 5])
def test_chunked_prefill_preemption_prefix_hits(family_env, k):
    """A 16-token budget (chunks; drafts cut by the budget), 40 blocks of 4 for 12
    prompts of up to 55 tokens (preemption), a 20-token shared prefix (hits)."""
    ckpt, oracle = family_env("llama")
    prompts, lengths = copy_workload(1, shared_prefix=20)
    llm = _llm(ckpt, max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=40,
               num_speculative_tokens=k)
    stats = _check(llm, prompts, lengths, oracle)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_cached_blocks_hold_accepted_tokens_only(family_env):
    """A second request whose prompt is the first's prompt and output hits the blocks the
    first cached; were a rejected draft's KV cached, its output would differ from HF's."""
    ckpt, oracle = family_env("qwen3")
    prompts, lengths = copy_workload(2, num=8)
    llm = _llm(ckpt)
    first = _generate(llm, prompts, _greedy(lengths))
    assert llm.engine.stats().spec_num_accepted_tokens < llm.engine.stats().spec_num_draft_tokens
    again = [p + o.token_ids for p, o in zip(prompts, first)]
    hits_before = llm.engine.stats().prefix_cache_hits
    outs = _generate(llm, again, _greedy([8] * len(again)))
    assert llm.engine.stats().prefix_cache_hits - hits_before >= 8 * 4
    for p, out in zip(again, outs):
        assert out.token_ids == oracle(p, 8)


def test_forced_acceptance(family_env):
    ckpt, oracle = family_env("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(3, 20))] for _ in range(6)]
    lengths = [rng.randrange(10, 25) for _ in prompts]
    expected = [oracle(p, n) for p, n in zip(prompts, lengths)]
    llm = _llm(ckpt, num_speculative_tokens=4)
    llm.engine.runner.spec.proposer = ReplayProposer(4, [p + e for p, e in zip(prompts, expected)])
    outs = _generate(llm, prompts, _greedy(lengths))
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens  # acceptance 1.0
    # Mean accepted length: up to 5 tokens per verify step (the last steps are cut by
    # max_tokens), far more than a plain decode's 1.
    steps = stats.spec_num_verify_steps
    assert (stats.spec_num_accepted_tokens + steps) / steps > 3.0


def test_stop_mid_way(family_env):
    """A stop token inside a verify step's emitted tokens ends the request there, as it
    does without speculation."""
    ckpt, oracle = family_env("llama")
    prompts, lengths = copy_workload(4, num=8)
    stops = []
    for p, n in zip(prompts, lengths):
        out = oracle(p, n)
        stops.append(out[len(out) // 2])
    params = [SamplingParams(temperature=0.0, max_tokens=n, stop_token_ids=(s,), ignore_eos=True)
              for n, s in zip(lengths, stops)]
    llm = _llm(ckpt, num_speculative_tokens=5)
    outs = _generate(llm, prompts, params)
    for p, n, s, out in zip(prompts, lengths, stops, outs):
        full = oracle(p, n)
        assert out.token_ids == full[:full.index(s) + 1]
        assert out.finish_reason == "stop"
    assert llm.engine.stats().spec_num_verify_steps > 0
    assert llm.engine.stats().kv_cache_usage == 0.0


def test_penalties_min_tokens_and_logprobs_with_drafts(family_env):
    """Requests with penalties, min_tokens or logprobs draft too (the rejection sampler
    applies them per draft position): their tokens and logprobs are what they are without
    speculation, beside plain greedy requests in the same steps."""
    ckpt, oracle = family_env("qwen2")
    prompts, lengths = copy_workload(5, num=8)
    params = _greedy(lengths)
    for i in range(0, len(params), 2):
        params[i] = SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True,
                                   repetition_penalty=1.3, presence_penalty=0.2,
                                   frequency_penalty=0.1, logprobs=3)
    params[1] = SamplingParams(temperature=0.0, max_tokens=lengths[1], min_tokens=lengths[1],
                               stop_token_ids=tuple(range(3, 256, 2)))
    plain = _generate(LLM(str(ckpt), device="cpu", max_model_len=128, block_size=4, seed=0),
                      prompts, params)
    llm = _llm(ckpt)
    spec = _generate(llm, prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for i in range(0, len(params), 2):
        assert len(spec[i].logprobs) == len(spec[i].token_ids)
        for got, want in zip(spec[i].logprobs, plain[i].logprobs):
            assert got.keys() == want.keys()
            for t in got:
                assert got[t] == pytest.approx(want[t], abs=1e-4)
    stats = llm.engine.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def _perturbed(ckpt, path):
    """The checkpoint's weights plus small noise: a draft that agrees on some argmaxes."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(ckpt, path)
    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    save_file({k: v + 0.005 * torch.randn(v.shape, generator=g) for k, v in weights.items()},
              path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("draft", ["same", "perturbed"])
def test_draft_model_greedy_matches_hf(family_env, tmp_path_factory, draft):
    """--speculative-method draft through the engine: a draft model with its own KV
    cache in the target's blocks, under chunked prefill and preemption. The target's own
    weights as the draft accept (nearly) every draft; perturbed ones some."""
    ckpt, oracle = family_env("llama")
    path = ckpt if draft == "same" else _perturbed(
        ckpt, tmp_path_factory.mktemp("draft") / "ckpt")
    prompts, lengths = copy_workload(6, num=8)
    llm = _llm(ckpt, speculative_method="draft", speculative_model=str(path),
               max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=24,
               max_model_len=88)
    outs = _generate(llm, prompts, _greedy(lengths))
    for p, n, out in zip(prompts, lengths, outs):
        assert out.token_ids == oracle(p, n)
    stats = llm.engine.stats()
    assert stats.spec_num_verify_steps > 0 and stats.kv_cache_usage == 0.0
    assert stats.num_preemptions > 0
    if draft == "same":
        assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens
    else:
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens


def test_seeded_sampling_with_drafts_is_batch_independent(family_env):
    """A seeded random request draws the same tokens alone and beside others: its drafts
    come from its own tokens and the verify step's noise from its seed and positions."""
    ckpt, _ = family_env("llama")
    prompts, lengths = copy_workload(8, num=6)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True,
                            seed=1234)
    # One-token suffixes: sampled text repeats fewer pairs than greedy text does.
    alone = _generate(_llm(ckpt, ngram_prompt_lookup_min=1), prompts[:1], [seeded])[0].token_ids
    llm = _llm(ckpt, ngram_prompt_lookup_min=1)
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in lengths]
    batched = _generate(llm, prompts, [seeded] + others[1:])[0].token_ids
    assert batched == alone and len(alone) == 24
    assert llm.engine.stats().spec_num_verify_steps > 0


def test_draft_model_samples_its_drafts_for_random_requests(family_env):
    """Random requests: the draft model draws its drafts with the row's temperature and
    the verify step gets their distributions (draft_probs). With the target's own
    weights as the draft, q = p, so min(1, p/q) accepts (nearly) every draft; treated as
    point masses they would be accepted with probability p(x) only."""
    ckpt, _ = family_env("llama")
    prompts, _ = copy_workload(9, num=4)
    params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=i)
              for i in range(len(prompts))]
    llm = _llm(ckpt, speculative_method="draft", speculative_model=str(ckpt))
    outs = _generate(llm, prompts, params)
    assert all(len(o.token_ids) == 20 for o in outs)
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens
