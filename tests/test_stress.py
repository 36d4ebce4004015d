"""Randomised stress: many requests with random lengths, sampling params and aborts on a
tiny KV cache. Nothing crashes, every request ends with a valid reason, no block leaks."""

from __future__ import annotations

import random

import pytest

from llmfast import LLM, SamplingParams


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.5]),
        top_k=rng.choice([0, 1, 5, 50]),
        top_p=rng.choice([1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.05]),
        repetition_penalty=rng.choice([1.0, 1.2]),
        presence_penalty=rng.choice([0.0, 0.5]),
        frequency_penalty=rng.choice([0.0, -0.3]),
        seed=rng.choice([None, rng.randrange(1000)]),
        max_tokens=rng.randrange(1, 24),
        min_tokens=rng.choice([0, 1]),
        stop_token_ids=rng.choice([(), (7, 9)]),
        ignore_eos=rng.random() < 0.5,
        logprobs=rng.choice([None, 0, 3]),
    )


def _run(num_requests: int, seed: int, async_scheduling: bool = False) -> None:
    rng = random.Random(seed)
    llm = LLM("random:tiny", device="cpu", max_model_len=96, block_size=4,
              num_gpu_blocks_override=60, max_num_batched_tokens=48, max_num_seqs=16, seed=seed,
              async_scheduling=async_scheduling)
    engine = llm.engine
    live: set[str] = set()
    finished: dict[str, str] = {}
    aborted: set[str] = set()
    submitted = 0
    steps = 0
    while submitted < num_requests or engine.has_unfinished():
        for _ in range(rng.randrange(0, 4)):
            if submitted < num_requests:
                prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(1, 60))]
                live.add(engine.add_request({"prompt_token_ids": prompt}, _random_params(rng)))
                submitted += 1
        if live and rng.random() < 0.1:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
            live.discard(victim)
            aborted.add(victim)
        for out in engine.step():
            comp = out.outputs[0]
            assert len(comp.token_ids) >= 0
            if out.finished:
                assert comp.finish_reason in ("stop", "length")
                assert out.request_id not in aborted
                finished[out.request_id] = comp.finish_reason
                live.discard(out.request_id)
                if comp.finish_reason == "length":
                    assert len(comp.token_ids) >= 1
        steps += 1
        assert steps < 50 * num_requests, "engine made no progress"
    assert not live
    assert len(finished) + len(aborted) == num_requests
    stats = engine.stats()
    assert stats.kv_cache_usage == 0.0
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    # Every block is back in the free pool.
    manager = engine.scheduler.kv_cache_manager
    assert manager.get_num_free_blocks() == manager.num_usable_blocks


def test_stress_small():
    _run(num_requests=200, seed=0)


def test_stress_small_async():
    """One step in flight: aborts and stops land while the next step runs."""
    _run(num_requests=80, seed=1, async_scheduling=True)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(1, 6))
def test_stress_large(seed, async_scheduling):
    _run(num_requests=2000, seed=seed, async_scheduling=async_scheduling)
