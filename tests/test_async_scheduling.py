"""Async scheduling (one step in flight) against the synchronous loop on the same engine
settings: identical greedy and seeded outputs under staggered arrivals, stop tokens,
max_tokens, min_tokens, penalties, logprobs, aborts mid-flight, preemption on a tiny KV
cache and prefix-cache hits; nothing computed past a stop is streamed or counted; every
KV block is free at the end. On CPU the forward runs synchronously, but the pipeline is
the same code: the host schedules step N+1 before it has read step N's tokens, and the
device fills them in (a wrong fill would change the outputs or fail on the placeholder).
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest

from llmfast import LLM, SamplingParams
from llmfast.worker.input_batch import PLACEHOLDER_TOKEN_ID
from tests.helpers.chat_model import make_chat_model
from tests.helpers.interpreted import run_interpreted
from tests.helpers.engine_config import engine_config


def _engine(async_scheduling: bool, **kw):
    args = {"device": "cpu", "max_model_len": 96, "block_size": 4,
            "num_gpu_blocks_override": 48, "max_num_batched_tokens": 40, "max_num_seqs": 12,
            "seed": 0}
    args.update(kw)
    return LLM("random:tiny", async_scheduling=async_scheduling, **args).engine


def _workload(seed: int):
    """(arrival step, prompt, params, abort after this many emitted tokens or None)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 500) for _ in range(12)] for _ in range(3)]
    items = []
    for i in range(28):
        prompt = rng.choice(prefixes)[: rng.randrange(0, 13)] + [
            rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))]
        kind = i % 4
        params = SamplingParams(
            temperature=0.0 if kind < 2 else 0.8,
            seed=None if kind < 2 else 1000 + i,
            top_k=0 if kind < 3 else 20,
            repetition_penalty=1.0 if kind != 1 else 1.3,
            frequency_penalty=0.0 if kind != 2 else 0.4,
            max_tokens=rng.randrange(1, 24),
            min_tokens=2 if kind == 3 else 0,
            # Frequent ids of random:tiny: some requests stop early, at different steps.
            stop_token_ids=tuple(rng.randrange(3, 500) for _ in range(40)) if i % 3 else (),
            logprobs=2 if i % 5 == 0 else None,
        )
        abort_after = rng.randrange(1, 6) if i % 7 == 3 else None
        items.append((rng.randrange(0, 20), prompt, params, abort_after))
    return items


def _run(engine, items):
    """Drive the engine step by step; returns per request: (token ids, finish reason,
    streamed token ids, logprobs, number of token timestamps)."""
    by_step = defaultdict(list)
    for i, item in enumerate(items):
        by_step[item[0]].append(i)
    ids: dict[str, int] = {}
    streamed: dict[int, list[int]] = defaultdict(list)
    results: dict[int, tuple] = {}
    step = 0
    while step < 20 or engine.has_unfinished():
        for i in by_step.get(step, []):
            _, prompt, params, _ = items[i]
            ids[engine.add_request({"prompt_token_ids": prompt}, params)] = i
        for out in engine.step():
            i = ids[out.request_id]
            comp = out.outputs[0]
            assert i not in results, "an output after the request finished"
            streamed[i] += comp.delta_token_ids
            abort_after = items[i][3]
            if out.finished:
                results[i] = (list(comp.token_ids), comp.finish_reason, comp.logprobs,
                              len(out.metrics.token_times))
            elif abort_after is not None and len(comp.token_ids) >= abort_after:
                engine.abort(out.request_id)
                results[i] = (list(comp.token_ids), "abort", comp.logprobs,
                              len(out.metrics.token_times))
        step += 1
        assert step < 2000, "no progress"
    return results, streamed


@pytest.fixture(scope="module")
def runs():
    items = _workload(0)
    out = {}
    for mode in (False, True):
        engine = _engine(mode)
        results, streamed = _run(engine, items)
        out[mode] = (engine, results, streamed)
    return items, out


def test_async_outputs_equal_sync(runs):
    items, out = runs
    sync, async_ = out[False][1], out[True][1]
    assert len(sync) == len(items) == len(async_)
    for i, (tokens, reason, logprobs, num_times) in sync.items():
        assert (tokens, reason, num_times) == (async_[i][0], async_[i][1], async_[i][3]), i
        if logprobs is not None:  # batch composition differs: float rounding may too
            other = async_[i][2]
            assert [d.keys() for d in logprobs] == [d.keys() for d in other]
            for a, b in zip(logprobs, other):
                assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-5)
    reasons = {r[1] for r in sync.values()}
    assert reasons == {"stop", "length", "abort"}  # the workload exercises all three


def test_async_workload_preempts_and_hits_prefix_cache(runs):
    _, out = runs
    for mode in (False, True):
        stats = out[mode][0].stats()
        assert stats.num_preemptions > 0, mode
        assert stats.prefix_cache_hits > 0, mode


def test_nothing_past_a_stop_is_streamed_or_counted(runs):
    items, out = runs
    for mode in (False, True):
        _, results, streamed = out[mode]
        for i, (tokens, reason, logprobs, num_times) in results.items():
            params = items[i][2]
            assert streamed[i] == tokens  # streamed exactly what the final output holds
            assert num_times == len(tokens)  # one timestamp per kept token
            assert len(tokens) <= params.max_tokens
            if logprobs is not None:
                assert len(logprobs) == len(tokens)
            if reason == "stop":
                assert tokens[-1] in params.stop_token_ids
            stops = [t for t in tokens[params.min_tokens:-1] if t in params.stop_token_ids]
            assert not stops, "a token after a stop token"


def test_all_blocks_free_and_runner_empty_at_the_end(runs):
    _, out = runs
    for mode in (False, True):
        engine = out[mode][0]
        manager = engine.scheduler.kv_cache_manager
        assert manager.get_num_free_blocks() == manager.num_usable_blocks
        assert not engine.scheduler.requests and not engine.output_processor.states
        engine.step()  # hands the last finished ids to the runner
        engine.step()
        assert engine.runner.input_batch.num_reqs == 0 and not engine.runner.requests


def test_host_prepares_the_next_step_before_reading_tokens():
    """The pipeline is real: step N+1 is launched before step N's ids are read, and its
    decode inputs hold placeholders on the host (the device fills them)."""
    engine = _engine(True, num_gpu_blocks_override=None)
    runner = engine.runner
    events: list[str] = []
    placeholders_at_launch: list[int] = []
    launch, collect = runner.execute_async, runner.collect

    def traced_launch(out):
        batch = runner.input_batch
        n = batch.num_reqs
        placeholders_at_launch.append(
            int((batch.token_ids[:n][range(n), batch.num_tokens[:n] - 1]
                 == PLACEHOLDER_TOKEN_ID).sum()) if n else 0)
        pending = launch(out)
        events.append("launch" if pending is not None else "empty")
        return pending

    def traced_collect(pending):
        events.append("collect")
        return collect(pending)

    runner.execute_async, runner.collect = traced_launch, traced_collect
    for i in range(3):
        engine.add_request({"prompt_token_ids": [5 + i] * 7},
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    outputs = []
    while engine.has_unfinished():
        outputs.append(len(engine.step()))
    assert outputs[0] == 0  # the first call launches and returns before any token
    assert events[:4] == ["launch", "launch", "collect", "launch"]
    assert max(placeholders_at_launch) == 3  # all three decode from device-filled ids


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_device_fills_placeholders_only_with_a_step_in_flight(async_scheduling):
    """The synchronous loop has read every token before the next step: nothing to fill
    into the input ids or gather for the penalties on the device (a gather per step for
    nothing). With a step in flight both happen, and the outputs are the same."""
    engine = _engine(async_scheduling, num_gpu_blocks_override=None)
    runner = engine.runner
    calls = {"fill": 0, "gather": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    dst, staged = runner.placeholders.placeholder_dst, runner.sampling_staging.pending_src
    dst.copy_to_gpu = counted("fill", dst.copy_to_gpu)
    staged.stage = counted("gather", staged.stage)
    params = SamplingParams(temperature=0.7, seed=3, frequency_penalty=0.5, max_tokens=8,
                            ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": [7 + i] * 5}, params) for i in range(3)]
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    assert all(len(tokens[i]) == 8 for i in ids)
    if async_scheduling:
        assert calls["fill"] > 0 and calls["gather"] > 0
    else:
        assert calls == {"fill": 0, "gather": 0}


def test_stop_strings_one_step_late(tmp_path):
    path = make_chat_model(tmp_path / "model")
    got = {}
    for mode in (False, True):
        llm = LLM(str(path), device="cpu", max_model_len=256, block_size=8,
                  async_scheduling=mode)
        greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        full = llm.generate("hello there", greedy)[0].outputs[0]
        stop = full.text[6:9]
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
        deltas, last = [], None
        for out in llm.stream("hello there", params):
            deltas.append(out.outputs[0].delta_text)
            last = out
        comp = last.outputs[0]
        assert comp.text == "".join(deltas) == full.text[: full.text.index(stop)]
        assert comp.finish_reason == "stop" and comp.stop_reason == stop
        # The token that completed the stop string is the last one kept.
        assert comp.token_ids == full.token_ids[: len(comp.token_ids)]
        assert len(comp.token_ids) < len(full.token_ids)
        manager = llm.engine.scheduler.kv_cache_manager
        assert manager.get_num_free_blocks() == manager.num_usable_blocks
        got[mode] = (comp.text, comp.token_ids)
    assert got[False] == got[True]


def test_async_scheduling_defaults_off_on_cpu_and_can_be_forced():
    from llmfast.engine.args import EngineArgs

    default, _ = engine_config(EngineArgs(model="random:tiny", device="cpu"))
    forced, _ = engine_config(EngineArgs(model="random:tiny", device="cpu",
                                         async_scheduling=True))
    assert not default.scheduler.async_scheduling and forced.scheduler.async_scheduling


# Run in a child with TRITON_INTERPRET=1: the model's Triton kernels (the path CUDA
# takes) instead of the CPU's torch ops, async scheduling against the synchronous loop.
_TRITON_ASYNC_CHILD = """
import json, sys
from llmfast import LLM, SamplingParams
from llmfast.attention.triton import launch as attention

calls = []
launch = attention.unified_attention

def recording(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *args, **kw):
    calls.append((q.shape[0], seq_lens.shape[0], kw.get("uniform_decode", False)))
    return launch(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, *args, **kw)

attention.unified_attention = recording

def run(async_scheduling):
    engine = LLM("random:tiny", device="cpu", max_model_len=64, block_size=4,
                 num_gpu_blocks_override=48, max_num_batched_tokens=32, max_num_seqs=8,
                 seed=0, async_scheduling=async_scheduling).engine
    ids = {}
    for i, (prompt, n) in enumerate((([5, 6, 7], 2), ([8, 9, 10], 6), ([11, 12, 13], 6),
                                     ([1, 2], 3))):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        ids[engine.add_request({"prompt_token_ids": prompt}, params)] = i
    tokens = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                tokens[ids[out.request_id]] = list(out.outputs[0].token_ids)
    return tokens

result = {"async": run(True)}
# Uniform decode launches with fewer tokens than rows: a request whose last token was
# in flight got none.
result["zero_row_decodes"] = sum(1 for t, r, uniform in calls if uniform and t < r)
result["sync"] = run(False)
print(json.dumps(result))
"""


def test_triton_kernels_under_async_scheduling_match_the_synchronous_loop():
    """A decode step in which a row has no token (its last token still in flight) is
    uniform decode with fewer tokens than rows: the fused decode + RoPE kernel serves it
    (it once refused it: a key per row, not per token, was asked for)."""
    result = run_interpreted(_TRITON_ASYNC_CHILD, timeout_s=300)
    assert result["zero_row_decodes"] > 0
    assert result["async"] == result["sync"]
    assert [len(result["sync"][str(i)]) for i in range(4)] == [2, 6, 6, 3]
