"""The benchmark library: size specs, statistics, workloads and the runners on a tiny
random model (CPU)."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llmfast.bench import (
    BenchError,
    bench_params,
    parse_sizes,
    poisson_arrivals,
    random_requests,
    request_latencies,
    run_latency,
    run_sweep,
    run_throughput,
    shared_prefix_requests,
    summarize,
)


@pytest.fixture(scope="module")
def llm():
    from llmfast import LLM

    return LLM("random:tiny", device="cpu", max_model_len=256, seed=0)


# ---------------------------------------------------------------------- sizes


@pytest.mark.parametrize("spec, expected", [
    ("1..512", [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]),
    ("1..8", [1, 2, 4, 8]),
    ("3..20", [3, 6, 12]),
    ("8..32:8", [8, 16, 24, 32]),
    ("1,8,64", [1, 8, 64]),
    ("64, 1 ,8,8", [1, 8, 64]),
    ("1,2,8..32:8", [1, 2, 8, 16, 24, 32]),
    ("7", [7]),
    ("5..5", [5]),
])
def test_parse_sizes(spec, expected):
    assert parse_sizes(spec) == expected


@pytest.mark.parametrize("spec, fragment", [
    ("0..8", ">= 1"),
    ("8..1", "backwards"),
    ("a..b", "cannot parse"),
    ("1..100000", "above the limit"),
    ("1..10000000000000:1", "above the limit"),
    ("", "empty"),
    ("1,,2", "cannot parse"),
    ("0", ">= 1"),
    ("1..8:0", "step"),
    ("-1..8", "cannot parse"),
    ("1.5", "cannot parse"),
])
def test_parse_sizes_errors(spec, fragment):
    with pytest.raises(BenchError, match=fragment):
        parse_sizes(spec)


def test_parse_sizes_custom_limit():
    with pytest.raises(BenchError, match="limit 8"):
        parse_sizes("1..16", limit=8)


# ---------------------------------------------------------------------- statistics


def test_summarize_matches_numpy():
    values = [0.5, 0.1, 0.3, 0.2, 0.4, 1.0, 0.05]
    s = summarize(values)
    assert s.count == 7
    assert s.mean == pytest.approx(np.mean(values))
    assert s.median == pytest.approx(0.3)
    assert s.p90 == pytest.approx(np.percentile(values, 90))
    assert s.p99 == pytest.approx(np.percentile(values, 99))
    assert (s.min, s.max) == (0.05, 1.0)
    assert summarize([]) is None
    one = summarize([2.0])
    assert one.median == one.p99 == 2.0


def test_request_latencies_vllm_definitions():
    # Arrived at 10.0; tokens at 10.5, 10.7, 11.0, 11.6; finished at 11.6.
    metrics = SimpleNamespace(first_token_time=10.5, finish_time=11.6,
                              token_times=[10.5, 10.7, 11.0, 11.6])
    lat = request_latencies(metrics, arrival=10.0, output_len=4)
    assert lat["ttft"] == pytest.approx(0.5)
    assert lat["e2e"] == pytest.approx(1.6)
    assert lat["tpot"] == pytest.approx((1.6 - 0.5) / 3)
    assert lat["itl"] == pytest.approx([0.2, 0.3, 0.6])
    single = request_latencies(SimpleNamespace(first_token_time=1.0, finish_time=1.0,
                                               token_times=[1.0]), 0.0, 1)
    assert single["tpot"] is None and single["itl"] == []


def test_poisson_arrivals():
    assert poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]
    a = poisson_arrivals(2000, 50.0, seed=1)
    assert a == poisson_arrivals(2000, 50.0, seed=1)
    assert all(x < y for x, y in itertools.pairwise(a))
    assert np.mean(np.diff(a)) == pytest.approx(1 / 50, rel=0.1)
    with pytest.raises(BenchError):
        poisson_arrivals(3, 0.0)
    with pytest.raises(BenchError, match="at most 3600 s"):  # would wait ~2000 years
        poisson_arrivals(64, 1e-9)
    assert len(poisson_arrivals(64, 64 / 3600)) == 64  # an hour on average is allowed


# ---------------------------------------------------------------------- workloads


def test_random_requests_seeded_and_in_range():
    a = random_requests(50, 100, 20, vocab_size=512, range_ratio=0.5, seed=3)
    assert a == random_requests(50, 100, 20, vocab_size=512, range_ratio=0.5, seed=3)
    assert a != random_requests(50, 100, 20, vocab_size=512, range_ratio=0.5, seed=4)
    assert all(50 <= len(r.prompt_token_ids) <= 150 for r in a)
    assert all(10 <= r.output_len <= 30 for r in a)
    assert len({len(r.prompt_token_ids) for r in a}) > 5
    assert all(0 <= t < 512 for r in a for t in r.prompt_token_ids)
    fixed = random_requests(4, 16, 8, vocab_size=512)
    assert {len(r.prompt_token_ids) for r in fixed} == {16}
    assert {r.output_len for r in fixed} == {8}
    with pytest.raises(BenchError):
        random_requests(4, 16, 8, vocab_size=512, range_ratio=1.0)


def test_shared_prefix_requests():
    reqs = shared_prefix_requests(4, prefix_len=32, suffix_len=8, output_len=4, vocab_size=512)
    assert {tuple(r.prompt_token_ids[:32]) for r in reqs} == {tuple(reqs[0].prompt_token_ids[:32])}
    assert len({tuple(r.prompt_token_ids[32:]) for r in reqs}) == 4


def test_bench_params_are_greedy_fixed_length():
    p = bench_params(7)
    assert p.greedy and p.ignore_eos and p.max_tokens == 7


# ---------------------------------------------------------------------- runners


def test_run_sweep(llm):
    points = run_sweep(llm.engine, [1, 4], context_len=20, steps=4)
    assert [p.batch_size for p in points] == [1, 4]
    for p in points:
        assert p.all_decode
        assert len(p.step_latencies_s) == 4 and p.step_latency.count == 4
        assert p.step_latency.min <= p.step_latency.median <= p.step_latency.p99
        assert p.decode_tokens_per_s == pytest.approx(p.batch_size * 4 / sum(p.step_latencies_s))
        assert p.prefill_tokens == p.batch_size * 20 and p.prefill_tokens_per_s > 0
    assert not llm.engine.has_unfinished()  # everything aborted and freed


def test_run_sweep_is_pure_decode_after_a_chunked_prefill():
    from llmfast import LLM

    # 4 prompts x 16 tokens over a 32-token budget: 2 prompts, then 2 decodes + 1.9
    # prompts, then the rest: the first prompts decode 2 steps ahead of the last, and
    # none may finish inside the timed steps.
    llm = LLM("random:tiny", device="cpu", max_model_len=128, max_num_batched_tokens=32, seed=0)
    (point,) = run_sweep(llm.engine, [4], context_len=16, steps=4)
    assert point.prefill_steps == 3
    assert point.all_decode
    assert not llm.engine.has_unfinished()


def test_run_sweep_rejects_too_big(llm):
    with pytest.raises(BenchError, match="max-num-seqs"):
        run_sweep(llm.engine, [1, 100000], context_len=8, steps=2)
    with pytest.raises(BenchError, match="max-model-len"):
        run_sweep(llm.engine, [1], context_len=250, steps=8)


def test_run_throughput_counts_tokens(llm):
    reqs = random_requests(6, 12, 5, vocab_size=512, range_ratio=0.5, seed=2)
    seen = []
    r = run_throughput(llm.engine, reqs, progress=lambda done, total: seen.append((done, total)))
    assert r.num_requests == 6
    assert r.output_tokens == sum(q.output_len for q in reqs)
    assert r.input_tokens == sum(len(q.prompt_token_ids) for q in reqs)
    assert r.output_tokens_per_s == pytest.approx(r.output_tokens / r.elapsed_s)
    assert seen[-1] == (6, 6)


def test_run_latency(llm):
    reqs = random_requests(5, 10, 4, vocab_size=512, seed=5)
    r = run_latency(llm.engine, reqs, request_rate=200.0, seed=1)
    assert r.num_requests == 5 and len(r.per_request) == 5
    assert r.ttft.count == 5 and r.e2e.count == 5 and r.tpot.count == 5
    assert r.itl.count == 5 * 3
    assert all(row["e2e"] >= row["ttft"] > 0 for row in r.per_request)
    burst = run_latency(llm.engine, reqs, request_rate=math.inf)
    assert burst.num_requests == 5


def test_hf_baseline_same_weights_same_tokens(llm):
    from llmfast.bench.hf import load_hf_model, run_hf_baseline

    model = load_hf_model(llm.engine)
    reqs = random_requests(3, 10, 6, vocab_size=512, range_ratio=0.3, seed=7)
    ours = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs],
                        [bench_params(r.output_len) for r in reqs])
    for r, out in zip(reqs, ours):
        ids = torch.tensor([r.prompt_token_ids])
        hf = model.generate(input_ids=ids, max_new_tokens=r.output_len, do_sample=False,
                            min_new_tokens=r.output_len, pad_token_id=0)
        assert hf[0, ids.shape[1]:].tolist() == out.outputs[0].token_ids
    result = run_hf_baseline(model, reqs, batch_size=2)
    assert result.output_tokens == sum(r.output_len for r in reqs)
    assert result.num_requests == 3 and result.output_tokens_per_s > 0
