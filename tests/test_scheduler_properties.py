"""Property tests: random add / step / abort sequences against a fake model runner.

The fake runner keeps its own state from the SchedulerOutputs alone (as the real one
must) and a fake KV cache whose slots hold the identity of the whole prefix ending at
that token. Every step it "attends" over each scheduled request's context and checks
each slot holds that request's prefix: a false prefix-cache hit, a block reused while
still needed, or a wrong block table shows up as a mismatch.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

from hypothesis import event, given, settings
from hypothesis import strategies as st

from llmfast.config import CacheConfig, SchedulerConfig
from llmfast.core.kv_cache_manager import SKIPPED
from llmfast.core.request import Request, RequestRejected, RequestStatus
from llmfast.core.scheduler import Scheduler
from llmfast.core.scheduler_output import ModelRunnerOutput
from llmfast.sampling_params import SamplingParams

EOS = 2


class FakeRunner:
    def __init__(self, block_size: int, rng: random.Random) -> None:
        self.block_size = block_size
        self.rng = rng
        self.kv: dict[int, int] = {}  # slot -> prefix id
        self.prefix_ids: dict[tuple[int, int], int] = {}  # (parent prefix id, token) -> id
        self.state: dict[str, dict] = {}

    def _prefix_keys(self, tokens: list[int]) -> list[int]:
        keys, parent = [], -1
        for t in tokens:
            parent = self.prefix_ids.setdefault((parent, t), len(self.prefix_ids))
            keys.append(parent)
        return keys

    def execute(self, out) -> ModelRunnerOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            assert self.state.pop(rid, None) is not None, rid
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.state
            self.state[new.req_id] = {
                "tokens": new.prompt_token_ids + new.output_token_ids,
                "blocks": list(new.block_ids),
                "computed": new.num_computed_tokens,
            }
        cached = out.scheduled_cached_reqs
        for rid, new_ids, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            st_ = self.state[rid]
            st_["blocks"].extend(new_ids)
            assert st_["computed"] == computed
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        bs = self.block_size
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            st_ = self.state[rid]
            tokens, blocks, start = st_["tokens"], st_["blocks"], st_["computed"]
            assert n > 0 and start + n <= len(tokens)
            assert len(blocks) * bs >= start + n and 0 not in blocks
            keys = self._prefix_keys(tokens[: start + n])
            for pos in range(start, start + n):  # write the new tokens' KV
                self.kv[blocks[pos // bs] * bs + pos % bs] = keys[pos]
            for pos in range(start + n):  # attention reads the whole context
                assert self.kv.get(blocks[pos // bs] * bs + pos % bs) == keys[pos], (rid, pos)
            st_["computed"] = start + n
            req_ids.append(rid)
            sampled.append(self.sample(tokens, start + n))
        return ModelRunnerOutput(req_ids, sampled)

    def sample(self, tokens: list[int], computed: int) -> list[int]:
        """A random token appended where the step reached the end of `tokens`."""
        if computed != len(tokens):
            return []
        tok = self.rng.randrange(2, 9)
        tokens.append(tok)
        return [tok]


def check_invariants(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    assert pool.null_block.ref_cnt == 0
    holders = Counter()
    for rid, blocks in kv.req_to_blocks.items():
        lists = blocks if blocks and isinstance(blocks[0], list) else [blocks]  # groups
        ids = [b.block_id for group in lists for b in group if b is not SKIPPED]
        assert len(set(ids)) == len(ids) and 0 not in ids
        holders.update(ids)
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.get_num_free_blocks()
    assert len(free) + len(holders) == pool.num_usable_blocks
    assert {b.block_id for b in free} == {b.block_id for b in pool.blocks[1:] if b.ref_cnt == 0}
    for block in pool.blocks[1:]:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == holders[block.block_id]
        if holders[block.block_id] > 1:  # only a cached prefix block is shared
            assert block.block_hash is not None
    for h, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash is h
    assert set(kv.req_to_blocks) == {r.request_id for r in sched.running}
    assert len(sched.running) <= sched.max_num_seqs
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        # With one step in flight a request may compute its placeholder's position.
        assert r.num_computed_tokens <= r.num_tokens_with_placeholders
        assert r.num_computed_tokens <= sched.max_model_len - 1
    for r in sched.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0


add_op = st.tuples(
    st.just("add"),
    st.integers(0, 3),  # which shared prefix
    st.sampled_from([0, 3, 8, 12, 16, 20]),  # its length
    st.lists(st.integers(3, 5), max_size=16),  # own suffix, small vocab: repeats happen
    st.integers(1, 40),  # max_tokens
    st.integers(0, 3),  # min_tokens
    st.booleans(),  # ignore_eos
)
ops_strategy = st.lists(
    st.one_of(
        add_op,
        add_op,
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 20)),
    ),
    min_size=4,
    max_size=30,
)


@settings(max_examples=120, deadline=None)
@given(
    block_size=st.sampled_from([8, 8, 16]),
    num_blocks=st.integers(2, 16),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    max_model_len=st.one_of(st.integers(2, 96), st.just(2048)),
    prefix_caching=st.booleans(),
    chunked=st.booleans(),
    seed=st.integers(0, 2**16),
    ops=ops_strategy,
    async_scheduling=st.booleans(),
)
def test_random_workloads(
    block_size, num_blocks, budget, max_num_seqs, max_model_len, prefix_caching, chunked, seed, ops,
    async_scheduling,
):
    run_workload(
        block_size, num_blocks, budget, max_num_seqs, max_model_len, prefix_caching, chunked,
        seed, ops, async_scheduling,
    )


@settings(max_examples=100, deadline=None)
@given(
    num_blocks=st.integers(6, 24),
    budget=st.integers(4, 64),
    max_num_seqs=st.integers(2, 8),
    prefix_caching=st.booleans(),
    seed=st.integers(0, 2**32),
    async_scheduling=st.booleans(),
)
def test_heavy_random_workloads(num_blocks, budget, max_num_seqs, prefix_caching, seed,
                                async_scheduling):
    """Many requests on a small cache: shared prefixes, long outputs, preemptions.

    The operation list comes from a seeded generator rather than hypothesis
    strategies, which keep examples small and so rarely reach memory pressure.
    """
    rng = random.Random(seed)
    ops = []
    for _ in range(rng.randrange(5, 25)):
        kind = rng.random()
        if kind < 0.45:
            ops.append(
                (
                    "add",
                    rng.randrange(3),
                    rng.choice([0, 8, 16, 24]),
                    [rng.randrange(3, 6) for _ in range(rng.randrange(12))],
                    rng.randrange(1, 48),
                    rng.randrange(3),
                    rng.random() < 0.5,
                )
            )
        elif kind < 0.9:
            ops.append(("step", rng.randrange(1, 6)))
        else:
            ops.append(("abort", rng.randrange(20)))
    run_workload(8, num_blocks, budget, max_num_seqs, 96, prefix_caching, True, seed, ops,
                 async_scheduling)


def run_workload(
    block_size, num_blocks, budget, max_num_seqs, max_model_len, prefix_caching, chunked, seed, ops,
    async_scheduling=False, kv_groups=None, runner_cls=None,
):
    """With `async_scheduling` each step's outputs reach `update()` one schedule later, as
    in the engine's pipeline: the fake runner (the device) knows its sampled tokens at
    once, the scheduler only through placeholders until then. `kv_groups` (several
    KV-cache groups) with `runner_cls`: a fake runner that reads and writes each group's
    blocks (tests/test_kv_cache_groups.py)."""
    if not chunked:
        budget = max(budget, max_model_len)
    sched = Scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=chunked,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching),
        num_blocks, kv_groups=kv_groups,
    )
    runner = (runner_cls or FakeRunner)(block_size, random.Random(seed))
    accepted: dict[str, Request] = {}
    outputs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    counter = itertools.count()

    in_flight = []

    def step():
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= budget
        result = runner.execute(out)
        if async_scheduling:  # as LLMEngine.step: read the previous step, keep this one
            done = in_flight.pop() if in_flight else None
            if out.total_num_scheduled_tokens:
                in_flight.append((out, result))
            if done is None:
                check_invariants(sched)
                return
        else:
            done = (out, result)
        done, runner_out = done
        for u in sched.update(done, runner_out):
            outputs[u.req_id] += u.new_token_ids
            if u.finish_reason is not None:
                reasons[u.req_id] = u.finish_reason
        check_invariants(sched)
        for rid, st_ in runner.state.items():
            if rid in sched.requests:
                req = sched.requests[rid]
                known = req.all_token_ids
                assert st_["tokens"][: len(known)] == list(known)
                # The tokens the scheduler has not seen yet are its placeholders.
                assert len(st_["tokens"]) - len(known) <= req.num_output_placeholders

    for op in ops:
        if op[0] == "add":
            _, which, plen, suffix, max_tokens, min_tokens, ignore_eos = op
            prompt = [100 * (which + 1) + i for i in range(plen)] + suffix
            rid = f"r{next(counter)}"
            req = Request(
                rid,
                prompt,
                SamplingParams(
                    max_tokens=max_tokens,
                    min_tokens=min(min_tokens, max_tokens),
                    ignore_eos=ignore_eos,
                ),
                eos_token_ids=(EOS,),
            )
            n = len(prompt)
            blocks_needed = (-(-(n + 1) // block_size) if sched.kv_groups is None else
                             kv_groups.max_blocks_per_request(n + 1, budget, block_size))
            never_fits = n == 0 or n >= max_model_len or blocks_needed > num_blocks - 1
            try:
                sched.add_request(req)
            except RequestRejected:
                assert never_fits
                continue
            assert not never_fits
            accepted[rid] = req
            outputs[rid] = []
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        else:
            ids = list(accepted)
            if ids:
                rid = ids[op[1] % len(ids)]
                sched.abort(rid)
                reasons.setdefault(rid, "abort")
                check_invariants(sched)

    for _ in range(5000):
        if not sched.has_unfinished_requests() and not in_flight:
            break
        step()
    assert not sched.has_unfinished_requests()
    runner.execute(sched.schedule())  # the last finished ids reach the runner
    assert runner.state == {}

    stats = sched.get_stats()
    event(f"preemptions: {min(stats.num_preemptions, 3)}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    event(f"accepted: {min(len(accepted), 5)}")
    pool = sched.kv_cache_manager.block_pool
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    for rid, req in accepted.items():
        reason = reasons[rid]
        assert req.is_finished and req.finish_reason == reason
        assert outputs[rid] == req.output_token_ids
        n_out = req.num_output_tokens
        if reason == "stop":
            assert req.output_token_ids[-1] in req.stop_token_set and n_out > req.min_tokens
        elif reason == "length":
            assert n_out == req.max_tokens or req.num_tokens == sched.max_model_len
            assert all(
                t not in req.stop_token_set for t in req.output_token_ids[req.min_tokens :]
            )
