"""The KV-cache manager frees the blocks that leave a sliding window (a model whose every
layer slides): a request's held blocks stay within ceil(window / block_size) + 1 through a
long generation, the freed ones go back to the pool (admission counts them free), they
keep their prefix-cache hashes, and the engine's tokens stay HF's."""

from __future__ import annotations

import pytest

from llmfast.config import CacheConfig, ModelConfig, SchedulerConfig
from llmfast.core.block_pool import NULL_BLOCK_ID
from llmfast.core.kv_cache_manager import SKIPPED
from llmfast.core.scheduler import Scheduler
from tests.test_scheduler import make_request, run_step

BS = 8  # tests/test_scheduler.py's block size


def _scheduler(window, num_blocks=32, budget=64, caching=True):
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=512),
        CacheConfig(block_size=BS, enable_prefix_caching=caching), num_blocks, window)


@pytest.mark.parametrize("window, budget", [(20, 64), (16, 64), (5, 12), (24, 7)])
def test_held_blocks_stay_within_the_window(window, budget):
    sched = _scheduler(window, budget=budget)
    kv = sched.kv_cache_manager
    sched.add_request(make_request("a", n_prompt=30, max_tokens=200))
    bound = -(-window // BS) + 1
    decode_steps = 0
    while sched.requests:
        out, _ = run_step(sched)
        request = sched.requests.get("a")
        if request is None:
            break
        held = kv.num_held_blocks("a")
        blocks = kv.req_to_blocks["a"]
        # Every block the next query's window reaches is held, and nothing older.
        first_key = max(0, request.num_computed_tokens - window + 1)
        assert all(b is not SKIPPED for b in blocks[first_key // BS:])
        if out.num_scheduled_tokens["a"] == 1:  # a decode step
            decode_steps += 1
            assert held <= bound, (request.num_computed_tokens, held)
        # The pool counts the freed blocks free: what is held is what is missing.
        assert kv.get_num_free_blocks() == kv.num_usable_blocks - held
    assert decode_steps >= 150
    assert kv.get_num_free_blocks() == kv.num_usable_blocks  # all back at the end


def test_without_a_window_every_block_is_kept():
    sched = _scheduler(None)
    sched.add_request(make_request("a", n_prompt=30, max_tokens=60))
    for _ in range(40):
        run_step(sched)
    request = sched.requests["a"]
    assert sched.kv_cache_manager.num_held_blocks("a") == -(-request.num_computed_tokens // BS)


def test_a_long_generation_runs_in_fewer_blocks_than_it_spans():
    """32 usable blocks hold 256 tokens: with a window of 16 a 400-token sequence runs
    in them, never preempted."""
    sched = _scheduler(16, num_blocks=33)
    sched.add_request(make_request("a", n_prompt=20, max_tokens=380))
    while sched.requests:
        run_step(sched)
    assert sched.num_preemptions == 0


def test_freed_blocks_stay_prefix_hits():
    sched = _scheduler(16)
    kv = sched.kv_cache_manager
    sched.add_request(make_request("a", n_prompt=40, max_tokens=30))
    while sched.requests:
        run_step(sched)
    # The same prompt again: its full blocks are found, freed or not.
    sched.add_request(make_request("b", n_prompt=40, max_tokens=5))
    out, _ = run_step(sched)
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 32  # (40 - 1) // 8 blocks hit
    assert NULL_BLOCK_ID not in new.block_ids
    run_step(sched)  # its next step frees what left b's window
    assert kv.req_to_blocks["b"][0] is SKIPPED


def test_only_models_whose_every_layer_slides_free_blocks():
    base = dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, head_dim=4, intermediate_size=8, vocab_size=8)
    assert ModelConfig(**base, sliding_window=16).kv_sliding_window == 16
    assert ModelConfig(**base).kv_sliding_window is None
    hybrid = ModelConfig(**base, sliding_window=16,
                         layer_types=("sliding_attention", "full_attention"))
    assert hybrid.kv_sliding_window is None  # one block id serves both kinds of layer
    sliding = ModelConfig(**base, sliding_window=16, layer_types=("sliding_attention",) * 2)
    assert sliding.kv_sliding_window == 16


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_frees_blocks_and_matches_hf(tmp_path, async_scheduling):
    """Mistral with a 16-token window through the engine: HF's tokens, and at every
    step each running request holds at most ceil(16 / 4) + 1 blocks once decoding; also
    scheduling one step ahead (the freed blocks' last reader may still be in flight: a
    later step's writes to them come after it)."""
    from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
    from tests.helpers.hf_oracle import greedy_oracle
    from tests.test_engine import _llm
    from tests.test_sliding_models import long_workload
    from tests.helpers.workloads import greedy_params

    path = make_hf_checkpoint(tmp_path / "ckpt", family="mistral", sliding_window=16)
    oracle = greedy_oracle(load_hf_model(path))
    prompts, lengths = long_workload(7)
    llm = _llm(path, max_num_batched_tokens=64, max_num_seqs=4,
               async_scheduling=async_scheduling)
    scheduler = llm.engine.scheduler
    kv = scheduler.kv_cache_manager
    assert kv.sliding_window == 16
    schedule, held = scheduler.schedule, []

    def checked_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        held.extend(kv.num_held_blocks(rid) for rid, n in out.num_scheduled_tokens.items()
                    if n == 1)
        return out

    scheduler.schedule = checked_schedule
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(lengths))
    for p, n, out in zip(prompts, lengths, outs):
        assert out.outputs[0].token_ids == oracle(p, n)
    assert len(held) > 100 and max(held) <= -(-16 // 4) + 1
