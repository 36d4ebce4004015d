"""The scheduler under speculative decoding: drafts scheduled as 1 + K tokens inside the
budget and max_model_len / max_tokens, the rejected ones rolled back, stop conditions on
each emitted token, acceptance counted, drafts dropped on preemption, and only accepted
(known) tokens hashed into the prefix cache."""

from __future__ import annotations

from llmfast.config import CacheConfig, SchedulerConfig
from llmfast.core.request import Request, RequestStatus
from llmfast.core.scheduler import Scheduler
from llmfast.core.scheduler_output import ModelRunnerOutput
from llmfast.sampling_params import SamplingParams

BS = 4
EOS = 2


def make_scheduler(num_blocks=64, budget=64, max_model_len=256, lookahead=0):
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len),
                     CacheConfig(block_size=BS), num_blocks, num_lookahead_slots=lookahead)


def make_request(rid, n_prompt=6, max_tokens=32, **params):
    return Request(rid, list(range(100, 100 + n_prompt)),
                   SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(EOS,))


def step(sched, emitted, proposals=None):
    """schedule, then a fake runner that emits `emitted[rid]` for each sampling request
    and proposes `proposals[rid]`."""
    out = sched.schedule()
    req_ids, sampled, spec = [], [], []
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        req_ids.append(rid)
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append(list(emitted.get(rid, [7])) if done else [])
        spec.append(list((proposals or {}).get(rid, [])) if done else [])
    updates = sched.update(out, ModelRunnerOutput(req_ids, sampled, spec_token_ids=spec))
    return out, {u.req_id: u for u in updates}


def test_drafts_scheduled_and_rejected_rolled_back():
    sched = make_scheduler()
    sched.add_request(make_request("a"))
    out, ups = step(sched, {"a": [50]}, {"a": [51, 52, 53]})  # prefill: 6 tokens
    assert out.num_scheduled_tokens == {"a": 6} and not out.scheduled_spec_decode_tokens
    req = sched.requests["a"]
    assert req.spec_token_ids == [51, 52, 53] and req.num_computed_tokens == 6
    # Verify: 1 + 3 tokens; the target accepts 51, rejects 52 and emits 60 instead.
    out, ups = step(sched, {"a": [51, 60]}, {"a": [61]})
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.total_num_scheduled_tokens == 4
    assert out.scheduled_spec_decode_tokens == {"a": [51, 52, 53]}
    assert ups["a"].new_token_ids == [51, 60]
    # 9 tokens known (6 + 50 51 60); computed: 6 + 50 51 = 8 (60 is computed next).
    assert req.num_tokens == 9 and req.num_computed_tokens == 8
    assert req.spec_token_ids == [61]
    stats = sched.get_stats()
    assert (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
            stats.spec_num_verify_steps) == (3, 1, 1)
    # All accepted: 1 draft + bonus.
    out, ups = step(sched, {"a": [61, 62]})
    assert out.num_scheduled_tokens == {"a": 2}
    assert req.num_tokens == 11 and req.num_computed_tokens == 10
    assert req.spec_token_ids == []
    out, ups = step(sched, {"a": [63]})  # no drafts: a plain decode
    assert out.num_scheduled_tokens == {"a": 1} and not out.scheduled_spec_decode_tokens


def test_drafts_cut_by_budget_and_max_tokens_and_model_len():
    sched = make_scheduler(budget=3)
    sched.add_request(make_request("a", n_prompt=2, max_tokens=32))
    step(sched, {"a": [50]}, {"a": [11, 12, 13, 14, 15]})
    out, _ = step(sched, {"a": [11, 12, 13]})
    assert out.num_scheduled_tokens == {"a": 3}  # the budget: 1 + 2 drafts
    assert out.scheduled_spec_decode_tokens == {"a": [11, 12]}
    # max_tokens 3 with 1 generated: at most 1 draft (the step emits up to 2 tokens).
    sched = make_scheduler()
    sched.add_request(make_request("b", n_prompt=2, max_tokens=3))
    step(sched, {"b": [50]}, {"b": [9, 9, 9]})
    out, ups = step(sched, {"b": [9, 9]})
    assert out.scheduled_spec_decode_tokens == {"b": [9]}
    assert ups["b"].finish_reason == "length"
    # max_model_len 8 with 4 tokens known (3 computed): at most 8 - 1 - 3 = 4 tokens
    # scheduled, i.e. 3 drafts, and the emitted ones fill the length exactly.
    sched = make_scheduler(max_model_len=8)
    sched.add_request(make_request("c", n_prompt=3))
    step(sched, {"c": [50]}, {"c": [9, 9, 9, 9, 9]})
    out, ups = step(sched, {"c": [9, 9, 9, 9]})
    assert out.num_scheduled_tokens == {"c": 4}
    assert ups["c"].finish_reason == "length" and sched.requests == {}


def test_stop_token_mid_way_truncates_emitted():
    sched = make_scheduler()
    sched.add_request(make_request("a"))
    step(sched, {"a": [50]}, {"a": [51, EOS, 53]})
    out, ups = step(sched, {"a": [51, EOS, 53, 54]})
    assert ups["a"].new_token_ids == [51, EOS]
    assert ups["a"].finish_reason == "stop"
    assert "a" not in sched.requests and sched.kv_cache_manager.usage == 0.0
    # min_tokens keeps the request going past an early EOS (the stop is not taken).
    sched = make_scheduler()
    sched.add_request(make_request("b", min_tokens=3))
    step(sched, {"b": [50]}, {"b": [EOS, 52]})
    out, ups = step(sched, {"b": [EOS, 52, EOS]})
    assert ups["b"].new_token_ids == [EOS, 52, EOS] and ups["b"].finish_reason == "stop"


def test_preemption_drops_drafts():
    # 5 usable blocks of 4: a and b take 2 each for their prefill, 3 for a verify.
    sched = make_scheduler(num_blocks=6)
    sched.add_request(make_request("a", n_prompt=7))
    sched.add_request(make_request("b", n_prompt=7))
    step(sched, {"a": [50], "b": [50]}, {"a": [11, 12, 13], "b": [11, 12, 13]})
    # a needs positions 7..10 (block 2); b the same: one of them must go.
    out, ups = step(sched, {"a": [11, 12, 13, 14], "b": [11, 12, 13, 14]})
    assert out.preempted_req_ids == {"b"}
    b = sched.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.spec_token_ids == []
    assert b.num_computed_tokens == 0


def test_only_accepted_tokens_are_hashed():
    sched = make_scheduler()
    sched.add_request(make_request("a", n_prompt=6))
    step(sched, {"a": [50]}, {"a": [51, 52, 53]})
    # Positions 6..9 computed with 50 51 52 53; only 51 accepted -> 8 tokens computed.
    step(sched, {"a": [51, 60]}, {"a": [61, 62]})
    req = sched.requests["a"]
    assert req.num_computed_tokens == 8
    # Next schedule caches the computed full blocks: 2 (tokens 0..7), not block 2.
    step(sched, {"a": [61, 62, 63]})
    kv = sched.kv_cache_manager
    assert kv.num_cached_blocks["a"] == 2
    assert [h.token_ids for h in req.block_hashes[:2]] == [
        (100, 101, 102, 103), (104, 105, 50, 51)]
    assert len(req.block_hashes) == 2


def test_lookahead_slots_allocated():
    sched = make_scheduler(lookahead=3)
    sched.add_request(make_request("a", n_prompt=4))
    step(sched, {"a": [50]}, {"a": [11, 12, 13]})
    # Prefill of 4 tokens + 3 lookahead slots: 2 blocks.
    assert sched.kv_cache_manager.num_held_blocks("a") == 2
    step(sched, {"a": [11, 12, 13, 14]})
    # 4 computed + 4 scheduled + 3 lookahead = 11 slots: 3 blocks.
    assert sched.kv_cache_manager.num_held_blocks("a") == 3
