"""The benchmark library: statistics, workloads and the runners on a tiny
random model (CPU)."""

from __future__ import annotations

import gc

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from llmfast.bench import (
    BenchError,
    bench_params,
    poisson_arrivals,
    random_requests,
    request_latencies,
    run_latency,
    run_sweep,
    run_throughput,
    shared_prefix_requests,
    summarize,
    sweep_engine_limits,
)
from llmfast.bench.bandwidth import peak_bandwidth
from llmfast.models.weight_bytes import decode_weight_bytes


@pytest.fixture(scope="module")
def llm():
    from llmfast import LLM

    return LLM("random:tiny", device="cpu", max_model_len=256, seed=0)


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


def test_median_call_ms_times_only_the_timed_calls(monkeypatch):
    """A fake clock: call k takes durations[k] seconds; warm-up calls are not timed."""
    from llmfast.bench import stats

    durations = [9.0, 9.0, 0.004, 0.001, 0.003, 0.002, 0.010]  # two warm-up calls first
    clock = {"now": 0.0, "calls": 0}

    def call():
        clock["now"] += durations[clock["calls"]]
        clock["calls"] += 1

    monkeypatch.setattr(stats.time, "perf_counter", lambda: clock["now"])
    got = stats.median_call_ms(call, iters=5, warmup=2)
    assert clock["calls"] == 7
    assert got == pytest.approx(3.0)  # median of 4, 1, 3, 2, 10 ms


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
    result = run_sweep(llm.engine, [1, 4], context_len=20, steps=4)
    points = result.points
    assert [p.batch_size for p in points] == [1, 4] and result.skipped == []
    assert result.bandwidth is None  # CPU: no HBM limit
    for p in points:
        assert p.hbm_fraction is None
        assert p.weight_bytes == decode_weight_bytes(llm.engine.runner.model)
        assert p.weight_stream_bytes_per_s == pytest.approx(p.weight_bytes / p.step_latency.median)
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
    (point,) = run_sweep(llm.engine, [4], context_len=16, steps=4).points
    assert point.prefill_steps == 3
    assert point.all_decode
    assert not llm.engine.has_unfinished()
    # 64 decodes do not fit in a 32-token step: refused, not timed as split steps.
    with pytest.raises(BenchError, match="max-num-batched-tokens 32"):
        run_sweep(llm.engine, [64], context_len=4, steps=2)


def test_run_sweep_leaves_out_a_size_the_kv_cache_cannot_hold():
    from llmfast import LLM

    # 8 usable blocks of 16 tokens: batch 2 at context 40 (+ decode room) needs 2 x 4
    # blocks; batch 4 needs 16 and would be preempted, so it must not become a row.
    probe = LLM("random:tiny", device="cpu", max_model_len=128, num_gpu_blocks_override=9)
    assert probe.engine.runner.num_blocks == 9
    result = run_sweep(probe.engine, [1, 2, 4], context_len=40, steps=4)
    assert [p.batch_size for p in result.points] == [1, 2]
    assert all(p.all_decode for p in result.points)
    ((skip),) = result.skipped
    assert skip.batch_size == 4 and "KV blocks" in skip.reason
    assert not probe.engine.has_unfinished()


def test_sweep_engine_limits_fit_the_largest_batch_in_one_step():
    cpu = (256, 2048)
    assert sweep_engine_limits(8, None, None, cpu) == {"max_num_seqs": 256,
                                                        "max_num_batched_tokens": 2048}
    assert sweep_engine_limits(512, None, None, cpu) == {"max_num_seqs": 512,
                                                          "max_num_batched_tokens": 2048}
    assert sweep_engine_limits(4096, None, None, cpu) == {"max_num_seqs": 4096,
                                                           "max_num_batched_tokens": 4096}
    assert sweep_engine_limits(512, None, None, (512, 8192)) == {
        "max_num_seqs": 512, "max_num_batched_tokens": 8192}
    assert sweep_engine_limits(64, 64, None, cpu) == {"max_num_batched_tokens": 2048}
    with pytest.raises(BenchError, match="--max-num-batched-tokens 128"):
        sweep_engine_limits(256, None, 128, cpu)


def test_peak_bandwidth_by_device_name():
    assert peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert peak_bandwidth("NVIDIA H200") == 4.8e12
    assert peak_bandwidth("NVIDIA GH200 480GB") == 4.0e12
    assert peak_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert peak_bandwidth("NVIDIA A10") == 0.6e12
    assert peak_bandwidth("NVIDIA L40") == 0.864e12
    assert peak_bandwidth("Some Future GPU") is None


def test_decode_weight_bytes_counts_a_tied_head_once_and_skips_an_untied_embedding():
    from dataclasses import replace

    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import ModelSource, resolve_model
    from llmfast.models.weight_bytes import weight_bytes

    untied = build_model(resolve_model("random:tiny"), torch.float32, "cpu", max_positions=16)
    embed = untied.model.embed_tokens.weight
    assert decode_weight_bytes(untied) == weight_bytes(untied) - embed.numel() * 4
    cfg = resolve_model("random:tiny").config
    tied = build_model(ModelSource("t", None, replace(cfg, tie_word_embeddings=True)),
                       torch.float32, "cpu", max_positions=16)
    assert decode_weight_bytes(tied) == weight_bytes(tied)
    assert weight_bytes(tied) == weight_bytes(untied) - embed.numel() * 4


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
    # The warm-up and start-up left nothing for the timed run to compile.
    assert r.triton_compiles["watched"] and r.triton_compiles["count"] == 0


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


def test_hf_batch_candidates():
    from llmfast.bench.hf import hf_batch_candidates

    assert hf_batch_candidates(100) == [8, 16, 32, 64, 100]
    assert hf_batch_candidates(256) == [8, 16, 32, 64, 128, 256]
    assert hf_batch_candidates(4) == [4]
    assert hf_batch_candidates(2000) == [8, 16, 32, 64, 128, 256, 512, 2000]


def test_tune_hf_batch_size_picks_the_fastest_probe(llm):
    from llmfast.bench.hf import load_hf_model, tune_hf_batch_size

    model = load_hf_model(llm.engine)
    reqs = random_requests(8, 6, 3, vocab_size=512, seed=3)
    seen = []
    best, probes, whole = tune_hf_batch_size(model, reqs, [1, 2, 4, 8],
                                             progress=lambda done, total: seen.append(done))
    # The best probe is the baseline run itself only when it ran all 8 requests.
    if best == 8:
        assert whole is not None and whole.output_tokens_per_s == probes[8]
        assert whole.num_requests == 8
    else:
        assert whole is None
    sizes = list(probes)
    assert sizes == [1, 2, 4, 8][: len(sizes)] and len(sizes) >= 2  # ascending, a prefix
    rates = [probes[s] for s in sizes]
    assert all(r is not None and r > 0 for r in rates)
    assert best in probes and probes[best] == max(rates)
    # It stops at the first probe slower than its predecessor, and only there.
    for i in range(1, len(rates) - 1):
        assert rates[i] > rates[i - 1]
    assert len(sizes) == 4 or rates[-1] <= rates[-2]
    assert seen == list(range(1, len(sizes) + 1))
    best, probes, whole = tune_hf_batch_size(model, reqs, [8])  # one probe, of all 8
    assert best == 8 and whole.num_requests == 8
    assert whole.output_tokens_per_s == probes[8]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_sweep_on_cuda_reports_the_hbm_fraction(backend):
    """In process, and with the runner in one mp worker (the copy is then measured by
    this process on the worker's GPU, by its name)."""
    from llmfast import LLM
    from tests.helpers.weight_bytes import expected_decode_weight_bytes

    llm = LLM("random:smollm2-135m", device="cuda", max_model_len=512, seed=0,
              gpu_memory_utilization=0.5, distributed_executor_backend=backend)
    result = run_sweep(llm.engine, [1, 8], context_len=32, steps=8)
    bw = result.bandwidth
    assert bw is not None and bw.measured_copy_bytes_per_s > 1e11  # any GPU: > 100 GB/s
    assert bw.name == torch.cuda.get_device_name(0)
    # bf16; the smollm2 preset ties its embeddings: the head is read whole.
    assert result.weight_bytes_per_rank == [
        expected_decode_weight_bytes(llm.engine.config.model, element_size=2)]
    assert bw.limit_bytes_per_s == (bw.peak_bytes_per_s or bw.measured_copy_bytes_per_s)
    assert [p.batch_size for p in result.points] == [1, 8] and result.skipped == []
    for p in result.points:
        assert p.hbm_fraction == pytest.approx(
            p.weight_bytes / p.step_latency.median / bw.limit_bytes_per_s)
        assert 0 < p.hbm_fraction < 1.5
    llm.engine.shutdown()  # the worker's GPU memory, for the next tests
    # In process, the caching allocator keeps what the engine held: an mp worker started
    # next would count it as another process's memory and find no room for its KV cache.
    del llm, result
    gc.collect()
    torch.cuda.empty_cache()
