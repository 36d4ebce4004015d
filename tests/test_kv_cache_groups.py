"""KV-cache groups (core/kv_cache_groups.py) and the hybrid KV-cache manager
(core/hybrid_kv_cache_manager.py), through the scheduler with a fake runner: Gemma 3's
grouping and page sizes, a sliding group's blocks bounded by its window while the global
group keeps all, the pool counting what is held, prefix hits valid in every group (a
naive oracle for the hit scan), and more long requests admitted at once than with every
layer keeping every block in the same bytes."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmfast.config import CacheConfig, ModelConfig, SchedulerConfig
from llmfast.core.hybrid_kv_cache_manager import (
    HybridKVCacheManager,
    first_in_window,
    longest_hit,
)
from llmfast.core.kv_cache_groups import kv_cache_groups
from llmfast.core.kv_cache_manager import SKIPPED, KVCacheManager
from llmfast.core.scheduler import Scheduler
from llmfast.core.scheduler_output import ModelRunnerOutput
from llmfast.models.sources.random_presets import RANDOM_PRESETS
from llmfast.worker.startup.kv_cache_sizing import kv_block_bytes
from tests.test_scheduler import make_request, run_step
from tests.test_scheduler_properties import FakeRunner, ops_strategy, run_workload

BS = 8  # tests/test_scheduler.py's block size
S, G = "sliding_attention", "full_attention"


def _config(layer_types, window=16) -> ModelConfig:
    return ModelConfig(hidden_size=8, num_hidden_layers=len(layer_types),
                       num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                       intermediate_size=8, vocab_size=8, sliding_window=window,
                       layer_types=tuple(layer_types))


def _scheduler(groups, num_blocks=64, budget=32, max_num_seqs=8, max_model_len=512,
               caching=True):
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        max_model_len=max_model_len),
        CacheConfig(block_size=BS, enable_prefix_caching=caching), num_blocks,
        kv_groups=groups)


# ---- grouping ------------------------------------------------------------------------


def test_gemma3_1b_groups_and_page_size():
    """The module doc's worked example."""
    config = RANDOM_PRESETS["gemma-3-1b"]
    groups = kv_cache_groups(config)
    assert groups.layers_per_block == 4
    assert [g.window for g in groups.groups] == [None] + [512] * 6
    assert [g.layers for g in groups.groups] == [
        (5, 11, 17, 23), (0, 1, 2, 3), (4, 6, 7, 8), (9, 10, 12, 13), (14, 15, 16, 18),
        (19, 20, 21, 22), (24, 25)]
    # Every layer in exactly one group; its page is its position there.
    slots, owner = groups.layer_slot(), groups.layer_group()
    for layer in range(26):
        assert groups.groups[owner[layer]].layers[slots[layer]] == layer
    bf16 = kv_block_bytes(config, 16, torch.bfloat16)
    assert bf16 == 4 * 2 * 16 * 1 * 256 * 2 == 64 * 1024
    # Decoding at 32768 tokens: 2048 global blocks + 6 x 33 sliding.
    assert groups.max_blocks_per_request(32768, 1, 16) == 2048 + 6 * 33


def test_one_kind_of_layer_is_one_group_of_every_layer():
    for config in (_config([G] * 4, None), _config([S] * 4), RANDOM_PRESETS["llama-3.2-1b"]):
        groups = kv_cache_groups(config)
        assert groups.num_groups == 1
        assert groups.layers_per_block == config.num_hidden_layers
        assert groups.layer_slot() == tuple(range(config.num_hidden_layers))


def test_near_equal_kinds_make_one_group_each():
    groups = kv_cache_groups(_config([S, G] * 8 + [S]))  # 9 sliding, 8 global
    assert groups.layers_per_block == 9  # the global group's last page is padding
    assert [g.layers for g in groups.groups] == [tuple(range(1, 17, 2)),
                                                 tuple(range(0, 17, 2))]
    assert kv_cache_groups(_config([S, G] * 4 + [S])).layers_per_block == 4  # 5 : 4


def test_max_tokens_inverts_max_blocks():
    groups = kv_cache_groups(_config([S, S, G, S, S, G, S]))
    for usable in (10, 37, 80):
        n = groups.max_tokens(usable, 16, 4, 10_000)
        assert groups.max_blocks_per_request(n, 16, 4) <= usable
        assert groups.max_blocks_per_request(n + 1, 16, 4) > usable


# ---- the hit scan against a naive oracle ----------------------------------------------


def _naive_longest_hit(cached, windows, max_blocks, bs):
    for k in range(max_blocks, -1, -1):
        ok = True
        for flags, window in zip(cached, windows):
            first = 0 if window is None else max(k * bs - window + 1, 0) // bs
            ok &= all(flags[i] for i in range(first, k))
        if ok:
            return k
    raise AssertionError("k = 0 is always a valid hit")


def test_longest_hit_matches_a_naive_scan():
    rng = random.Random(0)
    for _ in range(3000):
        windows = rng.choice([(None, 6), (None, 6, 6), (9,), (None, 3, 20), (5, 13)])
        bs = rng.choice([1, 2, 4])
        max_blocks = rng.randrange(0, 12)
        p = rng.random()
        cached = [[rng.random() < p for _ in range(max_blocks)] for _ in windows]
        assert longest_hit(cached, windows, max_blocks, bs) == _naive_longest_hit(
            cached, windows, max_blocks, bs), (cached, windows, bs)


def test_first_in_window():
    # bs 4, window 6: a query at 12 reads keys 7..12, blocks 1..3.
    assert first_in_window(12, 6, 4) == 1
    assert first_in_window(3, 6, 4) == 0


# ---- the manager through the scheduler ------------------------------------------------

GEMMA_LIKE = [S, S, G, S, S, G, S]  # 2 global, 5 sliding: 4 groups of 2 (one padded)


@pytest.mark.parametrize("window, budget", [(16, 32), (20, 7), (5, 64)])
def test_sliding_groups_stay_within_the_window_global_keeps_all(window, budget):
    groups = kv_cache_groups(_config(GEMMA_LIKE, window))
    assert groups.num_groups == 4 and groups.windows[0] is None
    sched = _scheduler(groups, num_blocks=200, budget=budget)
    kv = sched.kv_cache_manager
    assert isinstance(kv, HybridKVCacheManager)
    sched.add_request(make_request("a", n_prompt=30, max_tokens=150))
    sched.add_request(make_request("b", n_prompt=45, max_tokens=120, first=3000))
    bound = -(-window // BS) + 1
    decode_steps = 0
    while sched.requests:
        # What the step's allocation frees by: the tokens computed before it.
        before = {rid: r.num_computed_tokens for rid, r in sched.requests.items()}
        out, _ = run_step(sched)
        held_total = 0
        for rid, request in sched.requests.items():
            if rid not in kv.req_to_blocks:
                continue
            held = kv.num_held_blocks_per_group(rid)
            held_total += sum(held)
            lists = kv.req_to_blocks[rid]
            assert len({len(blocks) for blocks in lists}) == 1  # the lists grow together
            # The global group holds every block of the request's computed tokens.
            assert held[0] == len(lists[0]) == -(-request.num_computed_tokens // BS)
            # Every block the next query's window reaches is held; those before the
            # window of this step's first query are freed.
            first_key = max(0, request.num_computed_tokens - window + 1)
            freed = first_in_window(before[rid], window, BS)
            for blocks in lists[1:]:
                assert all(b is not SKIPPED for b in blocks[first_key // BS:])
                assert all(b is SKIPPED for b in blocks[:freed])
                assert blocks[freed] is not SKIPPED
            if out.num_scheduled_tokens.get(rid) == 1:
                decode_steps += 1
                assert max(held[1:]) <= bound, (request.num_computed_tokens, held)
        assert kv.get_num_free_blocks() == kv.num_usable_blocks - held_total
    assert decode_steps >= 200
    assert kv.get_num_free_blocks() == kv.num_usable_blocks


def test_new_block_ids_reach_the_runner_per_group():
    groups = kv_cache_groups(_config(GEMMA_LIKE))
    sched = _scheduler(groups, budget=64)
    kv = sched.kv_cache_manager
    sched.add_request(make_request("a", n_prompt=20, max_tokens=40))
    out, _ = run_step(sched)
    new = out.scheduled_new_reqs[0]
    assert isinstance(new.block_ids, tuple) and len(new.block_ids) == 4
    mirror = [list(ids) for ids in new.block_ids]
    while "a" in sched.requests:
        out, _ = run_step(sched)
        for rid, ids in zip(out.scheduled_cached_reqs.req_ids,
                            out.scheduled_cached_reqs.new_block_ids):
            if ids:
                for m, new_ids in zip(mirror, ids):
                    m.extend(new_ids)
        if "a" in kv.req_to_blocks:
            # The runner's rows equal the scheduler's lists except where a sliding
            # group freed blocks (SKIPPED there; the runner keeps the old ids).
            for m, blocks in zip(mirror, kv.req_to_blocks["a"]):
                assert len(m) == len(blocks)
                assert all(b is SKIPPED or b.block_id == i for b, i in zip(blocks, m))
    all_ids = [i for m in mirror for i in m]
    assert 0 not in all_ids


def _finish(sched):
    while sched.requests:
        run_step(sched)


def _after_a_60_token_request():
    """(scheduler, its KV-cache manager, request a) once a 60-token prompt has run
    through the groups of GEMMA_LIKE with a 16-token window."""
    sched = _scheduler(kv_cache_groups(_config(GEMMA_LIKE, 16)), num_blocks=200, budget=64)
    a = make_request("a", n_prompt=60, max_tokens=3)
    sched.add_request(a)
    _finish(sched)
    return sched, sched.kv_cache_manager, a


def test_prefix_hit_is_valid_in_every_group():
    sched, kv, _ = _after_a_60_token_request()
    sched.add_request(make_request("b", n_prompt=60, max_tokens=3))
    out, _ = run_step(sched)
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 56  # (60 - 1) // 8 blocks hit
    lists = kv.req_to_blocks["b"]
    first = first_in_window(56, 16, BS)  # keys 41.. : block 5 on
    assert first == 5
    assert all(b is not SKIPPED for b in lists[0])
    for blocks in lists[1:]:
        assert blocks[:first] == [SKIPPED] * first
        assert all(b is not SKIPPED for b in blocks[first:])
    # The hit's held blocks are counted: global 8 (7 hit + 1 new), sliding 3 each.
    assert kv.num_held_blocks_per_group("b") == [8, 3, 3, 3]


def _evict(kv, g, block_hash):
    """Drop group g's cached block of `block_hash` from the map, as reuse would."""
    block = kv.block_pool.cached_block_hash_to_block.pop((g, block_hash))
    block.block_hash = None


def test_a_sliding_group_missing_a_window_block_shortens_the_hit():
    sched, kv, a = _after_a_60_token_request()
    # Sliding group 2 loses block 6 (inside the window of a 7-block hit): the longest
    # hit whose window avoids it is 6 blocks (window at 48: blocks 4..5)...
    _evict(kv, 2, a.block_hashes[6])
    # ...and blocks before a window do not matter: group 1 loses blocks 0..3.
    for i in range(4):
        _evict(kv, 1, a.block_hashes[i])
    sched.add_request(make_request("b", n_prompt=60, max_tokens=3))
    out, _ = run_step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 48


def test_a_global_group_missing_a_block_ends_the_hit_before_it():
    sched, kv, a = _after_a_60_token_request()
    _evict(kv, 0, a.block_hashes[2])
    sched.add_request(make_request("d", n_prompt=60, max_tokens=3))
    out, _ = run_step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 16


def test_preemption_frees_every_group():
    groups = kv_cache_groups(_config(GEMMA_LIKE, 16))
    # 60 usable blocks: two 100-token requests decoding need 2 x (13 + 3 x 3) = 44, a
    # third preempts.
    sched = _scheduler(groups, num_blocks=61, budget=32)
    kv = sched.kv_cache_manager
    for i, rid in enumerate("abc"):
        sched.add_request(make_request(rid, n_prompt=40, max_tokens=100, first=1000 * (i + 1)))
    while sched.requests:
        out, _ = run_step(sched)
        held = sum(kv.num_held_blocks(r) for r in kv.req_to_blocks)
        assert kv.get_num_free_blocks() == kv.num_usable_blocks - held
        for rid in out.preempted_req_ids:
            assert rid not in kv.req_to_blocks and rid not in kv.num_skipped_blocks
    assert sched.num_preemptions > 0
    assert kv.get_num_free_blocks() == kv.num_usable_blocks


def test_more_long_requests_run_at_once_than_without_groups():
    """Gemma 3 1B's layers in the same KV-cache bytes: one group of 26-layer pages (every
    layer keeps every block) against the 7 groups of 4-layer pages."""
    config = RANDOM_PRESETS["gemma-3-1b"]
    bs, budget_tokens, n_prompt = 16, 512, 3000
    flat = dataclasses.replace(config, sliding_window=None, layer_types=())
    page_flat = kv_block_bytes(flat, bs, torch.bfloat16)
    page_groups = kv_block_bytes(config, bs, torch.bfloat16)
    assert page_flat == 26 * page_groups // 4
    kv_bytes = 3 * (-(-(n_prompt + 40) // bs)) * page_flat + page_flat  # 3 requests' worth

    def max_running(groups, page):
        sched = Scheduler(
            SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget_tokens,
                            max_model_len=4096),
            CacheConfig(block_size=bs), kv_bytes // page, kv_groups=groups)
        for i in range(12):
            sched.add_request(_long_request(f"r{i}", n_prompt, i))
        most = 0
        for _ in range(400):
            out, _ = run_step(sched)
            decoding = [r for r, n in out.num_scheduled_tokens.items() if n == 1]
            most = max(most, len(decoding))
        return most

    without = max_running(None, page_flat)
    with_groups = max_running(kv_cache_groups(config), page_groups)
    assert without == 3
    assert with_groups >= 2 * without, (with_groups, without)


def _long_request(rid, n_prompt, i):
    return make_request(rid, n_prompt=n_prompt, max_tokens=40, first=10_000 * (i + 1))


def test_single_group_models_keep_the_plain_manager():
    for config in (_config([G] * 3, None), _config([S] * 3)):
        sched = _scheduler(kv_cache_groups(config))
        assert type(sched.kv_cache_manager) is KVCacheManager
        sched.add_request(make_request("a", n_prompt=20))
        out, _ = run_step(sched)
        assert isinstance(out.scheduled_new_reqs[0].block_ids, list)


def test_cache_capacity_counts_the_groups():
    """max_model_len is cut to what one request can hold alone: the global group's
    blocks plus each sliding group's window and chunk."""
    groups = kv_cache_groups(_config(GEMMA_LIKE, 16))
    sched = _scheduler(groups, num_blocks=41, budget=32, max_model_len=10_000)
    usable = 40
    n = sched.max_model_len
    assert groups.max_blocks_per_request(n, 32, BS) <= usable
    assert groups.max_blocks_per_request(n + 1, 32, BS) > usable
    # A prompt that fits runs alone to the end of the cache's capacity, unpreempted.
    sched.add_request(make_request("a", n_prompt=n - 40, max_tokens=100))
    _finish(sched)
    assert sched.num_preemptions == 0
    with pytest.raises(Exception, match="KV-cache blocks"):
        sched.add_request(make_request("b", n_prompt=n))


def test_pairs_of_identical_prompts_share_global_blocks():
    """Two running requests with one prompt: the second takes the first's cached full
    blocks in every group (ref counts 2), and freeing both returns each block once."""
    groups = kv_cache_groups(_config(GEMMA_LIKE, 16))
    sched = _scheduler(groups, num_blocks=200, budget=64)
    kv = sched.kv_cache_manager
    sched.add_request(make_request("a", n_prompt=33, max_tokens=30))
    run_step(sched)
    sched.add_request(make_request("b", n_prompt=33, max_tokens=30))
    run_step(sched)
    shared = [b for b in itertools.chain.from_iterable(kv.req_to_blocks["b"])
              if b is not SKIPPED and b.ref_cnt == 2]
    assert len(shared) >= 4
    _finish(sched)
    assert kv.get_num_free_blocks() == kv.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks[1:])


# ---- random workloads against a fake runner that reads each group's window --------------


class GroupedFakeRunner(FakeRunner):
    """tests/test_scheduler_properties.py's fake runner with one KV store per group: each
    step writes the new tokens' prefix identity into every group's slot and reads back
    what each group's attention reads (a global group the whole context, a sliding one
    the window of the step's first query on). A false hit, a block freed or reused while
    a window still reads it, or a wrong per-group table shows as a mismatch."""

    windows: tuple = ()

    def execute(self, out) -> ModelRunnerOutput:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            assert self.state.pop(rid, None) is not None, rid
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.state and isinstance(new.block_ids, tuple)
            self.state[new.req_id] = {"tokens": new.prompt_token_ids + new.output_token_ids,
                                      "blocks": [list(ids) for ids in new.block_ids],
                                      "computed": new.num_computed_tokens}
        cached = out.scheduled_cached_reqs
        for rid, new_ids, computed in zip(cached.req_ids, cached.new_block_ids,
                                          cached.num_computed_tokens):
            st_ = self.state[rid]
            for blocks, ids in zip(st_["blocks"], new_ids or [[]] * len(self.windows)):
                blocks.extend(ids)
            assert st_["computed"] == computed
        bs = self.block_size
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            st_ = self.state[rid]
            tokens, start = st_["tokens"], st_["computed"]
            keys = self._prefix_keys(tokens[: start + n])
            for g, (blocks, window) in enumerate(zip(st_["blocks"], self.windows)):
                assert len(blocks) * bs >= start + n
                for pos in range(start, start + n):
                    block = blocks[pos // bs]
                    assert block != 0, (rid, g, pos)
                    self.kv[(g, block * bs + pos % bs)] = keys[pos]
                first = 0 if window is None else max(0, start - window + 1)
                for pos in range(first, start + n):
                    slot = (g, blocks[pos // bs] * bs + pos % bs)
                    assert self.kv.get(slot) == keys[pos], (rid, g, pos)
            st_["computed"] = start + n
            req_ids.append(rid)
            sampled.append(self.sample(tokens, start + n))
        return ModelRunnerOutput(req_ids, sampled)


@settings(max_examples=80, deadline=None)
@given(
    window=st.integers(1, 40),
    layer_types=st.sampled_from([GEMMA_LIKE, [S, G], [G, S, S, S, S, S]]),
    block_size=st.sampled_from([4, 8]),
    num_blocks=st.integers(4, 64),
    budget=st.integers(1, 48),
    max_num_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    chunked=st.booleans(),
    seed=st.integers(0, 2**16),
    ops=ops_strategy,
    async_scheduling=st.booleans(),
)
def test_random_workloads_with_groups(window, layer_types, block_size, num_blocks, budget,
                                      max_num_seqs, prefix_caching, chunked, seed, ops,
                                      async_scheduling):
    groups = kv_cache_groups(_config(layer_types, window))
    runner_cls = type("Runner", (GroupedFakeRunner,), {"windows": groups.windows})
    run_workload(block_size, num_blocks, budget, max_num_seqs, 96, prefix_caching, chunked,
                 seed, ops, async_scheduling, kv_groups=groups, runner_cls=runner_cls)


@settings(max_examples=150, deadline=None)
@given(window=st.integers(1, 24), num_blocks=st.integers(12, 48), budget=st.integers(4, 64),
       prefix_caching=st.booleans(), seed=st.integers(0, 2**32),
       async_scheduling=st.booleans())
def test_heavy_random_workloads_with_groups(window, num_blocks, budget, prefix_caching, seed,
                                            async_scheduling):
    """Many requests with shared prefixes and long outputs on a small cache: preemptions,
    prefix hits on freed sliding blocks, windows crossing block boundaries."""
    rng = random.Random(seed)
    ops: list = []
    for _ in range(rng.randrange(5, 25)):
        kind = rng.random()
        if kind < 0.45:
            ops.append(("add", rng.randrange(3), rng.choice([0, 8, 16, 24]),
                        [rng.randrange(3, 6) for _ in range(rng.randrange(12))],
                        rng.randrange(1, 60), rng.randrange(3), rng.random() < 0.5))
        elif kind < 0.9:
            ops.append(("step", rng.randrange(1, 6)))
        else:
            ops.append(("abort", rng.randrange(20)))
    groups = kv_cache_groups(_config(GEMMA_LIKE, window))
    runner_cls = type("Runner", (GroupedFakeRunner,), {"windows": groups.windows})
    run_workload(4, num_blocks, budget, 6, 96, prefix_caching, True, seed, ops,
                 async_scheduling, kv_groups=groups, runner_cls=runner_cls)
