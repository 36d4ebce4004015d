"""Scheduler rules: budgets, chunking, admission, preemption, stops, aborts, rejection."""

from __future__ import annotations

import pytest

from llmfast.config import CacheConfig, SchedulerConfig
from llmfast.core.request import Request, RequestRejected, RequestStatus
from llmfast.core.scheduler import Scheduler
from llmfast.core.scheduler_output import ModelRunnerOutput
from llmfast.sampling_params import SamplingParams

BS = 8
EOS = 2


def make_scheduler(num_blocks=64, budget=64, max_num_seqs=16, max_model_len=512, **kw):
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            **kw,
        ),
        CacheConfig(block_size=BS),
        num_blocks,
    )


def make_request(rid, n_prompt=10, max_tokens=16, first=1000, **params):
    return Request(
        rid,
        list(range(first, first + n_prompt)),
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=(EOS,),
    )


def run_step(sched, token=7, tokens=None):
    """schedule + fake runner + update. The runner samples only for requests whose
    scheduled tokens reach the end of their sequence, as a real runner does."""
    out = sched.schedule()
    req_ids, sampled = [], []
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        req_ids.append(rid)
        done = req.num_computed_tokens == req.num_tokens
        tok = tokens.get(rid, token) if tokens else token
        sampled.append([tok] if done else [])
    updates = sched.update(out, ModelRunnerOutput(req_ids, sampled))
    return out, {u.req_id: u for u in updates}


def test_chunked_prefill_across_steps():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", n_prompt=20))
    out, ups = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 8}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert ups == {}  # a prefill chunk short of the prompt's end yields nothing
    out, ups = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 8}
    assert out.scheduled_cached_reqs.num_computed_tokens == [8]  # before this step
    out, ups = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 4}
    assert ups["a"].new_token_ids == [7]
    out, ups = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1}
    assert sched.requests["a"].num_computed_tokens == 21


def test_running_first_then_waiting_share_the_budget():
    sched = make_scheduler(budget=10)
    sched.add_request(make_request("a", n_prompt=10))
    run_step(sched)
    sched.add_request(make_request("b", n_prompt=30, first=5000))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    assert out.total_num_scheduled_tokens == 10
    assert [r.req_id for r in out.scheduled_new_reqs] == ["b"]
    assert out.scheduled_cached_reqs.req_ids == ["a"]


def test_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", first=100 * i))
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert len(sched.waiting) == 1


def test_fifo_admission_stops_at_first_that_does_not_fit():
    sched = make_scheduler(num_blocks=9)  # 8 usable blocks
    sched.add_request(make_request("a", n_prompt=30, first=0))  # 4 blocks
    run_step(sched)
    sched.add_request(make_request("big", n_prompt=40, first=100))  # 5 blocks: no room
    sched.add_request(make_request("small", n_prompt=3, first=200))  # would fit
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {"a"}
    assert [r.request_id for r in sched.waiting] == ["big", "small"]


def test_new_and_cached_request_data():
    sched = make_scheduler(budget=64)
    sched.add_request(make_request("a", n_prompt=15))
    out, _ = run_step(sched)
    (new,) = out.scheduled_new_reqs
    assert new.prompt_token_ids == list(range(1000, 1015))
    assert new.output_token_ids == []
    assert new.block_ids == sched.kv_cache_manager.get_block_ids("a") and len(new.block_ids) == 2
    out, _ = run_step(sched)  # token 16 -> slot 15, still block 1
    assert out.scheduled_cached_reqs.new_block_ids == [()]  # none new (a shared tuple)
    assert out.scheduled_cached_reqs.num_computed_tokens == [15]
    out, _ = run_step(sched)  # slot 16 opens block 2
    (ids,) = out.scheduled_cached_reqs.new_block_ids
    assert len(ids) == 1 and sched.kv_cache_manager.get_block_ids("a")[2] == ids[0]


def fill_cache_scenario():
    # 9 usable blocks; three 24-token prompts (3 blocks each) fill the cache.
    sched = make_scheduler(num_blocks=10, budget=256)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", n_prompt=24, max_tokens=50, first=100 * i))
    out, _ = run_step(sched)
    assert set(out.num_scheduled_tokens) == {"r0", "r1", "r2"}
    assert sched.kv_cache_manager.get_num_free_blocks() == 0
    return sched


def test_preemption_takes_the_last_running_and_recomputes():
    sched = fill_cache_scenario()
    sched.add_request(make_request("late", n_prompt=3, first=900))
    # Each has 25 tokens; computing token 24 needs a 4th block each. r0 finds none
    # free and preempts the last running request, r2 (3 blocks back); r1 then fits.
    out, _ = run_step(sched, token=11)
    assert out.preempted_req_ids == {"r2"}
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    assert out.scheduled_new_reqs == []  # no admission in a step that preempted
    r2 = sched.requests["r2"]
    assert r2.status is RequestStatus.PREEMPTED
    assert r2.num_computed_tokens == 0 and r2.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["r2", "late"]  # front of the queue
    assert sched.get_stats().num_preemptions == 1
    assert r2.output_token_ids == [7]
    # Let the others go; r2 comes back as a new request with its outputs so far.
    sched.abort("r0")
    sched.abort("r1")
    out, _ = run_step(sched)
    assert out.finished_req_ids == {"r0", "r1"}
    new = {r.req_id: r for r in out.scheduled_new_reqs}
    assert list(new) == ["r2", "late"]
    assert new["r2"].output_token_ids == [7]
    assert new["r2"].prompt_token_ids == list(range(200, 224))
    # Its 3 full blocks were cached when it was freed (tail first), and r0 and r1 took
    # the two at the LRU head, its blocks 2 and 1: block 0 is still a hit.
    assert new["r2"].num_computed_tokens == 8
    assert out.num_scheduled_tokens["r2"] == 25 - 8


def test_preempting_a_chain_of_requests_keeps_their_order():
    sched = make_scheduler(num_blocks=8, budget=256)  # 7 usable
    sched.add_request(make_request("a", n_prompt=24, max_tokens=50, first=0))  # 3 blocks
    sched.add_request(make_request("b", n_prompt=8, max_tokens=50, first=100))  # 1 block
    sched.add_request(make_request("c", n_prompt=8, max_tokens=50, first=200))  # 1 block
    sched.add_request(make_request("d", n_prompt=16, max_tokens=50, first=300))  # 2 blocks
    run_step(sched)
    # Next step a needs 1 block (-> preempts d, 2 back), b needs 1, c needs 1 -> none
    # left: c is the last and preempts itself; scheduling of running stops.
    out, _ = run_step(sched)
    assert out.preempted_req_ids == {"d", "c"}
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    assert [r.request_id for r in sched.running] == ["a", "b"]


def test_self_preemption_when_request_is_last():
    sched = make_scheduler(num_blocks=7, budget=256)  # 6 usable
    sched.add_request(make_request("a", n_prompt=20, max_tokens=50, first=0))  # 3 blocks
    sched.add_request(make_request("b", n_prompt=24, max_tokens=50, first=500))  # 3 blocks
    run_step(sched)
    # a's next slot (20) is in its block 2; b's (24) needs a 4th block, none is free,
    # and b is the last running request: it preempts itself.
    out, _ = run_step(sched)
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert sched.requests["b"].status is RequestStatus.PREEMPTED
    # Its 3 computed full blocks stay cached (free) until their memory is needed.
    assert sched.kv_cache_manager.get_num_free_blocks() == 3
    assert len(sched.kv_cache_manager.block_pool.cached_block_hash_to_block) >= 3


def test_abort_in_every_state():
    sched = fill_cache_scenario()
    sched.add_request(make_request("w", n_prompt=5, first=800))
    # Abort while waiting.
    sched.abort("w")
    assert "w" not in sched.requests and all(r.request_id != "w" for r in sched.waiting)
    # Force a preemption, then abort the preempted one.
    out, _ = run_step(sched)
    assert out.preempted_req_ids == {"r2"}
    free_before = sched.kv_cache_manager.get_num_free_blocks()
    sched.abort("r2")
    assert sched.kv_cache_manager.get_num_free_blocks() == free_before
    assert not sched.waiting
    # Abort while running frees its blocks and tells the runner next step.
    held = len(sched.kv_cache_manager.get_block_ids("r1"))
    sched.abort("r1")
    assert sched.kv_cache_manager.get_num_free_blocks() == free_before + held
    assert [r.request_id for r in sched.running] == ["r0"]
    # Already finished / unknown: no-op.
    sched.abort("r1")
    sched.abort("nope")
    out, _ = run_step(sched)
    assert out.finished_req_ids == {"r1"}  # never-scheduled/preempted ids not sent
    assert sched.get_num_unfinished_requests() == 1


def test_finishing_many_at_once_equals_one_after_another():
    """finish_requests over a batch (running, preempted and waiting ids in any order,
    unknown and repeated ones) leaves the scheduler as one finish after another does:
    the same waiting queue in the same order, running list, statuses, free blocks and
    ids the runner is told about. (The batch removes from the waiting queue in one pass.)"""
    import random

    def scenario():
        sched = fill_cache_scenario()  # r0, r1 running; r2 gets preempted next step
        for i in range(12):
            sched.add_request(make_request(f"w{i}", n_prompt=5, first=800 + 10 * i))
        run_step(sched)
        return sched

    rng = random.Random(5)
    for trial in range(20):
        one_by_one, batch = scenario(), scenario()
        ids = [f"w{i}" for i in range(12)] + ["r0", "r1", "r2", "nope"]
        chosen = rng.sample(ids, rng.randint(2, len(ids))) + ["w3"]
        for rid in chosen:
            one_by_one.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
        batch.finish_requests(chosen, RequestStatus.FINISHED_ABORTED)
        for a, b in ((one_by_one, batch),):
            assert [r.request_id for r in a.waiting] == [r.request_id for r in b.waiting]
            assert [r.request_id for r in a.running] == [r.request_id for r in b.running]
            assert set(a.requests) == set(b.requests)
            assert a.finished_req_ids == b.finished_req_ids
            assert (a.kv_cache_manager.get_num_free_blocks()
                    == b.kv_cache_manager.get_num_free_blocks())
        assert all(r.status is RequestStatus.WAITING or r.status is RequestStatus.PREEMPTED
                   for r in batch.waiting)


def test_abort_between_schedule_and_update_drops_the_sample():
    sched = make_scheduler()
    sched.add_request(make_request("a"))
    out = sched.schedule()
    sched.abort("a")
    assert sched.update(out, ModelRunnerOutput(["a"], [[5]])) == []
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.get_num_free_blocks() == 63


def test_fully_cached_prompt_recomputes_last_token():
    sched = make_scheduler()
    sched.add_request(make_request("a", n_prompt=16, max_tokens=1))
    run_step(sched)
    assert not sched.has_unfinished_requests()
    sched.add_request(make_request("b", n_prompt=16, max_tokens=1))
    out, ups = run_step(sched)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 8  # capped at 15 tokens -> 1 full block
    assert out.num_scheduled_tokens == {"b": 8}
    assert ups["b"].finish_reason == "length"
    sched.add_request(make_request("c", n_prompt=17, max_tokens=1))
    out, _ = run_step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16
    assert out.num_scheduled_tokens == {"c": 1}
    stats = sched.get_stats()
    assert stats.prefix_cache_hits == 8 + 16
    assert stats.prefix_cache_queries == 16 + 16 + 17


def test_rejects_requests_that_can_never_fit():
    sched = make_scheduler(num_blocks=5, max_model_len=30)  # 4 usable blocks = 32 slots
    with pytest.raises(RequestRejected, match="max-model-len"):
        sched.add_request(make_request("a", n_prompt=30))
    sched.add_request(make_request("ok", n_prompt=29))  # room for one token
    with pytest.raises(RequestRejected, match="empty"):
        sched.add_request(make_request("e", n_prompt=0))
    with pytest.raises(RequestRejected, match="already"):
        sched.add_request(make_request("ok", n_prompt=3))
    small = make_scheduler(num_blocks=4, max_model_len=512)  # 3 usable blocks = 24 slots
    with pytest.raises(RequestRejected, match="KV-cache blocks"):
        small.add_request(make_request("b", n_prompt=24))  # 24 + 1 slots > 24
    small.add_request(make_request("c", n_prompt=20, max_tokens=100))
    assert isinstance(RequestRejected("x"), ValueError)
    # A request that fits stops at the cache's capacity (24 tokens) instead of starving.
    reasons = [run_step(small)[1]["c"].finish_reason for _ in range(4)]
    assert reasons == [None, None, None, "length"]
    assert not small.has_unfinished_requests()
    assert small.kv_cache_manager.get_num_free_blocks() == 3


@pytest.mark.parametrize(
    "params, tokens, reason, n_out",
    [
        ({}, [5, 5, EOS, 5], "stop", 3),
        ({"ignore_eos": True, "max_tokens": 4}, [5, EOS, EOS, 5], "length", 4),
        ({"min_tokens": 2}, [EOS, EOS, EOS, 5], "stop", 3),
        ({"stop_token_ids": (9,)}, [5, 9, 5, 5], "stop", 2),
        ({"max_tokens": 3}, [5, 5, 5, 5], "length", 3),
    ],
)
def test_stop_conditions(params, tokens, reason, n_out):
    sched = make_scheduler()
    sched.add_request(make_request("a", n_prompt=4, **{"max_tokens": 16, **params}))
    for tok in tokens:
        out, ups = run_step(sched, token=tok)
        if ups["a"].finish_reason:
            break
    assert ups["a"].finish_reason == reason
    assert "a" not in sched.requests
    out, _ = run_step(sched)
    assert out.finished_req_ids == {"a"}
    assert sched.kv_cache_manager.get_num_free_blocks() == 63


def test_max_model_len_finishes_with_length():
    sched = make_scheduler(max_model_len=12)
    sched.add_request(make_request("a", n_prompt=10, max_tokens=100))
    _, ups = run_step(sched)
    assert ups["a"].finish_reason is None
    _, ups = run_step(sched)
    assert ups["a"].finish_reason == "length"  # 12 tokens


def test_multi_token_update_truncates_at_stop_and_passes_logprobs():
    sched = make_scheduler()
    sched.add_request(make_request("a", n_prompt=4))
    out = sched.schedule()
    lp = [(-0.1, {5: -0.1}), (-0.2, {EOS: -0.2}), (-0.3, {6: -0.3})]
    (up,) = sched.update(out, ModelRunnerOutput(["a"], [[5, EOS, 6]], [lp]))
    assert up.new_token_ids == [5, EOS] and up.finish_reason == "stop"
    assert up.logprobs == lp[:2]


def test_finish_requests_from_engine_stop_string():
    sched = make_scheduler()
    sched.add_request(make_request("a"))
    sched.add_request(make_request("b", first=50))
    run_step(sched)
    sched.finish_requests(["a"], "stop")
    assert [r.request_id for r in sched.running] == ["b"]
    out, _ = run_step(sched)
    assert out.finished_req_ids == {"a"}
    with pytest.raises(ValueError):
        sched.finish_requests("b", RequestStatus.RUNNING)


def test_without_chunked_prefill_a_prompt_waits_for_the_whole_budget():
    sched = make_scheduler(budget=16, max_model_len=16, enable_chunked_prefill=False)
    sched.add_request(make_request("a", n_prompt=4))
    sched.add_request(make_request("a2", n_prompt=4, first=20))
    run_step(sched)
    sched.add_request(make_request("b", n_prompt=15, first=50))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "a2": 1}  # 15 > 16 - 2: not chunked
    sched.abort("a2")
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 15}


def test_stats_and_unfinished_counts():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a"))
    sched.add_request(make_request("b", first=50))
    run_step(sched)
    stats = sched.get_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (1, 1)
    assert stats.kv_cache_usage == pytest.approx(2 / 63)
    assert sched.get_num_unfinished_requests() == 2 and sched.has_unfinished_requests()
