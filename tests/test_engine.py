"""Engine equivalence: batched greedy generation equals HF transformers on each prompt
alone, under chunked prefill, preemption, prefix caching and staggered arrivals."""

from __future__ import annotations

import gc

import pytest

from llmfast import LLM, SamplingParams
from llmfast.core.request import Request, RequestRejected
from llmfast.kernels.cpu.linear import Linear
from tests.helpers.workloads import NUM_PROMPTS, greedy_params, random_workload


def _check(llm, prompts, lengths, oracle):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(lengths))
    for p, n, out in zip(prompts, lengths, outs):
        assert out.prompt_token_ids == p
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == oracle(p, n)
    return outs


def _llm(ckpt, **kw):
    args = dict(device="cpu", max_model_len=128, block_size=4, seed=0)
    args.update(kw)
    return LLM(str(ckpt), **args)


def test_batched_greedy_matches_hf(ckpt, oracle):
    prompts, lengths = random_workload(0)
    llm = _llm(ckpt)
    # Eager CPU runs the oneDNN-prepacked projections (and the row split at 1-2 rows).
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None for m in linears)
    _check(llm, prompts, lengths, oracle)


def test_chunked_prefill_budget_8(ckpt, oracle):
    prompts, lengths = random_workload(1)
    _check(_llm(ckpt, max_num_batched_tokens=8, max_num_seqs=8), prompts, lengths, oracle)


def test_preemption_under_tiny_cache(ckpt, oracle):
    prompts, lengths = random_workload(2)
    llm = _llm(ckpt, num_gpu_blocks_override=40, max_model_len=64)
    _check(llm, prompts, lengths, oracle)
    assert llm.engine.stats().num_preemptions > 0


def test_shared_prefix_hits(ckpt, oracle):
    prompts, lengths = random_workload(3, shared_prefix=20)
    llm = _llm(ckpt, max_num_batched_tokens=64)
    outs = _check(llm, prompts, lengths, oracle)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    assert sum(o.num_cached_tokens for o in outs) > 0
    # A second round of the same prompts is served almost entirely from the cache.
    before = llm.engine.stats().prefix_cache_hits
    _check(llm, prompts, lengths, oracle)
    assert llm.engine.stats().prefix_cache_hits - before >= NUM_PROMPTS * 16


def test_requests_added_while_others_run(ckpt, oracle):
    prompts, lengths = random_workload(4)
    llm = _llm(ckpt, max_num_batched_tokens=32)
    engine = llm.engine
    params = greedy_params(lengths)
    pending = list(range(NUM_PROMPTS))
    ids: dict[str, int] = {}
    results: dict[int, list[int]] = {}
    steps = 0
    while pending or engine.has_unfinished():
        if pending and steps % 2 == 0:  # two new arrivals every other step
            for _ in range(2):
                if pending:
                    i = pending.pop(0)
                    ids[engine.add_request({"prompt_token_ids": prompts[i]}, params[i])] = i
        for out in engine.step():
            if out.finished:
                results[ids[out.request_id]] = out.outputs[0].token_ids
        steps += 1
    for i in range(NUM_PROMPTS):
        assert results[i] == oracle(prompts[i], lengths[i])


def test_all_blocks_free_after_run(ckpt):
    prompts, lengths = random_workload(5)
    llm = _llm(ckpt, num_gpu_blocks_override=40, max_model_len=64)
    llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(lengths))
    assert llm.engine.stats().kv_cache_usage == 0.0


def test_engine_start_freezes_long_lived_objects(ckpt):
    gc.unfreeze()
    llm = _llm(ckpt)
    # The model's modules were alive at start-up, so the collector no longer scans them.
    assert gc.get_freeze_count() > 1000
    assert not any(obj is llm.engine.runner.model for obj in gc.get_objects())


def test_prompt_too_long_is_rejected(ckpt):
    llm = _llm(ckpt, max_model_len=32)
    with pytest.raises(RequestRejected) as e:
        llm.generate({"prompt_token_ids": list(range(3, 40))})
    assert "max-model-len" in str(e.value) and "\n" not in str(e.value)
    # The scheduler, asked directly, rejects it in the same words.
    with pytest.raises(RequestRejected) as direct:
        llm.engine.scheduler.add_request(
            Request("direct", list(range(3, 40)), SamplingParams(), eos_token_ids=()))
    assert str(direct.value) == str(e.value)
    with pytest.raises(RequestRejected) as empty:
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(RequestRejected) as direct:
        llm.engine.scheduler.add_request(Request("empty", [], SamplingParams(), eos_token_ids=()))
    assert str(direct.value) == str(empty.value) == "the prompt is empty"
    # The engine is still usable afterwards.
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3))
    assert len(out[0].outputs[0].token_ids) <= 3


def test_seeded_sampling_reproducible_across_batches(ckpt):
    llm = _llm(ckpt)
    p = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, p)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [9, 10 + i]} for i in range(5)]
    batch = llm.generate(others[:2] + [{"prompt_token_ids": [5, 6, 7, 8]}] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=7)] * 2 + [p]
                         + [SamplingParams(temperature=0.0, max_tokens=3)] * 3)
    assert batch[2].outputs[0].token_ids == alone


def test_huge_counts_mean_what_they_say_and_fail_nothing(ckpt):
    """top_k past the vocabulary, max/min_tokens past the context and stop ids past the
    vocabulary (any size: JSON integers reach the engine through the server) run as their
    in-range meaning, in a batch with an ordinary request, instead of overflowing the
    per-request arrays and failing the step for everyone."""
    llm = _llm(ckpt, max_model_len=24)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    seeded = dict(temperature=0.9, seed=7, max_tokens=6, ignore_eos=True)
    huge = [SamplingParams(**seeded, top_k=2**40),
            SamplingParams(temperature=0.0, max_tokens=2**65, min_tokens=2**63),
            SamplingParams(**seeded, stop_token_ids=(2**70, 10**6))]
    same = [SamplingParams(**seeded),
            SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24),
            SamplingParams(**seeded)]
    ordinary = SamplingParams(temperature=0.0, max_tokens=4)
    got = llm.generate([prompt] * 4, [*huge, ordinary])
    want = llm.generate([prompt] * 4, [*same, ordinary])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert len(got[1].outputs[0].token_ids) == 24 - 4  # to the end of the context
    assert got[1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("budget", [2048, 8])
def test_compiled_engine_matches_hf(ckpt, oracle, budget):
    """The same equivalence through the piecewise-compiled model (Inductor on CPU), with
    one Dynamo graph for every batch shape the run produces."""
    prompts, lengths = random_workload(6)
    llm = _llm(ckpt, compile=True, max_num_batched_tokens=budget, max_num_seqs=8)
    _check(llm, prompts, lengths, oracle)
    # One trace (or the saved trace of an earlier start, loaded), no recompile.
    assert llm.engine.runner.compiled.stats.one_graph
