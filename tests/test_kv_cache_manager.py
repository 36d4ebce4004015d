"""KV cache manager: allocation, prefix-cache lookup and caching, sharing, eviction, stats."""

from __future__ import annotations

import pytest

from llmfast.core import block_pool as bp
from llmfast.core.kv_cache_manager import KVCacheManager
from llmfast.core.request import Request
from llmfast.sampling_params import SamplingParams

BS = 4


def make_request(rid, tokens):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8))


def run_prefill(mgr, req, computed_blocks=None, num_cached=0):
    """Admit `req` with its prefix hits and compute its whole prompt in one step."""
    if computed_blocks is None:
        computed_blocks, num_cached = mgr.get_computed_blocks(req)
    blocks = mgr.allocate_slots(req, req.num_tokens - num_cached, computed_blocks)
    assert blocks is not None
    req.num_computed_tokens = req.num_tokens
    return blocks


def ids(blocks):
    return [b.block_id for b in blocks]


def test_allocate_counts_blocks_and_grows():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", range(6))
    new = mgr.allocate_slots(req, 6, [])
    assert len(new) == 2  # ceil(6 / 4)
    req.num_computed_tokens = 6
    req.append_output_token_ids([100])
    assert mgr.allocate_slots(req, 1) == []  # slot 6 is in block 1
    req.num_computed_tokens = 7
    req.append_output_token_ids([101])
    assert mgr.allocate_slots(req, 1) == []  # slot 7
    req.num_computed_tokens = 8
    req.append_output_token_ids([102])
    assert len(mgr.allocate_slots(req, 1)) == 1  # slot 8 opens block 2
    assert len(mgr.get_block_ids("a")) == 3
    assert mgr.get_num_free_blocks() == 9 - 3
    assert mgr.usage == pytest.approx(3 / 9)


def test_allocate_failure_leaves_state_unchanged():
    mgr = KVCacheManager(num_blocks=5, block_size=BS)  # 4 usable
    a = make_request("a", range(8))
    run_prefill(mgr, a)
    a.append_output_token_ids([9])
    mgr.allocate_slots(a, 1)  # a's 2 computed blocks get cached; a holds 3 blocks
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8 and ids(hits) == mgr.get_block_ids("a")[:2]
    # 2 hit blocks (held by a) + 2 new blocks needed, 1 free.
    assert mgr.allocate_slots(b, b.num_tokens - n, hits) is None
    assert mgr.get_num_free_blocks() == 1
    assert [blk.ref_cnt for blk in hits] == [1, 1]
    assert "b" not in mgr.req_to_blocks
    assert mgr.stats.num_queries == 1  # only a's admission counted


def test_prefix_hit_after_free_and_caching_only_of_computed_blocks():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", range(10))
    mgr.allocate_slots(a, 10, [])
    # Nothing computed yet: nothing cached.
    assert mgr.block_pool.cached_block_hash_to_block == {}
    a.num_computed_tokens = 10
    a.append_output_token_ids([7])
    mgr.allocate_slots(a, 1)  # next step: blocks 0 and 1 (tokens 0..7) are computed
    assert len(mgr.block_pool.cached_block_hash_to_block) == 2
    a_ids = mgr.get_block_ids("a")
    mgr.free(a)
    b = make_request("b", list(range(10)) + [99])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 8 and ids(hits) == a_ids[:2]


def test_free_caches_full_computed_blocks_and_lru_keeps_prefix():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", range(12))
    run_prefill(mgr, a)
    a_ids = mgr.get_block_ids("a")
    mgr.free(a)
    # All three full blocks are cached; freed tail first.
    assert len(mgr.block_pool.cached_block_hash_to_block) == 3
    free_ids = ids(mgr.block_pool.free_block_queue.get_all_free_blocks())
    assert free_ids[-3:] == a_ids[::-1]


def test_shared_prefix_stored_once_with_right_ref_counts():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    prefix = list(range(100, 108))  # two full blocks
    first = make_request("r0", prefix + [0, 1])
    run_prefill(mgr, first)
    first.append_output_token_ids([5])
    mgr.allocate_slots(first, 1)  # caches its computed full blocks
    shared = mgr.get_block_ids("r0")[:2]
    others = []
    for i in range(1, 5):
        req = make_request(f"r{i}", prefix + [i, i])
        hits, n = mgr.get_computed_blocks(req)
        assert n == 8 and ids(hits) == shared
        run_prefill(mgr, req, hits, n)
        others.append(req)
    for i in range(5):
        assert mgr.get_block_ids(f"r{i}")[:2] == shared
    assert [mgr.block_pool.blocks[b].ref_cnt for b in shared] == [5, 5]
    # 2 shared blocks + one private tail block each.
    assert mgr.get_num_free_blocks() == 19 - 2 - 5
    for req in others:
        mgr.free(req)
    assert [mgr.block_pool.blocks[b].ref_cnt for b in shared] == [1, 1]
    mgr.free(first)
    assert mgr.get_num_free_blocks() == 19
    assert all(b.ref_cnt == 0 for b in mgr.block_pool.blocks)
    assert mgr.stats.hits == 4 * 8
    assert mgr.stats.queries == 10 * 5
    assert mgr.stats.hit_rate == pytest.approx(32 / 50)


def test_cached_block_evicted_only_when_memory_needed():
    mgr = KVCacheManager(num_blocks=7, block_size=BS)  # 6 usable
    a = make_request("a", range(8))
    run_prefill(mgr, a)
    mgr.free(a)
    # Two cached free blocks; 4 other free blocks get used first.
    b = make_request("b", range(50, 66))
    run_prefill(mgr, b)
    assert len(mgr.get_block_ids("b")) == 4
    c = make_request("c", list(range(8)) + [1])
    hits, n = mgr.get_computed_blocks(c)
    assert n == 8  # a's blocks survived
    # Now a request that needs more memory than the never-used blocks.
    mgr.free(b)
    d = make_request("d", range(200, 222))  # 6 blocks: everything, cached ones too
    run_prefill(mgr, d)
    hits, n = mgr.get_computed_blocks(c)
    assert n == 0 and hits == []
    assert len(mgr.block_pool.cached_block_hash_to_block) == 0


def test_touching_cached_free_block_removes_it_from_free_queue():
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", range(8))
    run_prefill(mgr, a)
    mgr.free(a)
    assert mgr.get_num_free_blocks() == 5
    b = make_request("b", list(range(8)) + [9])
    hits, n = mgr.get_computed_blocks(b)
    run_prefill(mgr, b, hits, n)
    queue = mgr.block_pool.free_block_queue.get_all_free_blocks()
    assert not set(ids(hits)) & set(ids(queue))
    assert mgr.get_num_free_blocks() == 5 - 3


def test_fully_cached_prompt_recomputes_last_token():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", range(8))
    run_prefill(mgr, a)
    mgr.free(a)
    b = make_request("b", range(8))
    hits, n = mgr.get_computed_blocks(b)
    # Capped at num_tokens - 1 = 7 tokens -> one full block; block 1 is recomputed.
    assert n == 4 and len(hits) == 1
    c = make_request("c", range(9))
    hits, n = mgr.get_computed_blocks(c)
    assert n == 8 and len(hits) == 2


def test_hash_collision_gives_no_false_hit(monkeypatch):
    # Every block hash value collides: only the exact comparison separates them.
    monkeypatch.setattr(bp, "hash_block_tokens", lambda parent, tokens: 42)
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    run_prefill(mgr, a)
    a_ids = mgr.get_block_ids("a")
    b = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])
    run_prefill(mgr, b)
    mgr.free(a)
    mgr.free(b)
    assert len(mgr.block_pool.cached_block_hash_to_block) == 4
    # First block differs from a's and b's: no hit at all.
    c = make_request("c", [1, 2, 3, 5, 5, 6, 7, 8, 0])
    assert mgr.get_computed_blocks(c) == ([], 0)
    # b's first block, then a's second block's tokens: only the first block is a hit,
    # although a block with key value 42 and tokens 5 6 7 8 exists (a's, under 1 2 3 4).
    d = make_request("d", [9, 9, 9, 9, 5, 6, 7, 9, 0])
    hits, n = mgr.get_computed_blocks(d)
    assert n == 4
    e = make_request("e", [1, 2, 3, 4, 5, 6, 7, 8, 1])
    hits, n = mgr.get_computed_blocks(e)
    assert n == 8 and ids(hits) == a_ids[:2]
    assert hits[1].block_hash.token_ids == (5, 6, 7, 8)
    assert hits[1].block_hash.parent.token_ids == (1, 2, 3, 4)


def test_duplicate_content_computed_concurrently_is_cached_once():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    a = make_request("a", range(9))
    b = make_request("b", range(9))
    run_prefill(mgr, a, [], 0)
    run_prefill(mgr, b, [], 0)  # admitted before a's blocks were cached
    mgr.free(a)
    mgr.free(b)
    cached = mgr.block_pool.cached_block_hash_to_block
    assert len(cached) == 2
    assert all(blk.block_hash is not None for blk in cached.values())
    assert sum(blk.block_hash is not None for blk in mgr.block_pool.blocks) == 2
    c = make_request("c", range(9))
    hits, n = mgr.get_computed_blocks(c)
    assert n == 8


def test_block_hashes_kept_on_request_not_recomputed(monkeypatch):
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    a = make_request("a", range(12))
    run_prefill(mgr, a)
    mgr.free(a)
    b = make_request("b", range(13))
    mgr.get_computed_blocks(b)
    assert len(b.block_hashes) == 3
    calls = []
    real = bp.hash_block_tokens
    monkeypatch.setattr(bp, "hash_block_tokens", lambda p, t: calls.append(t) or real(p, t))
    hits, n = mgr.get_computed_blocks(b)
    assert n == 12 and calls == []


def test_caching_disabled():
    mgr = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    a = make_request("a", range(8))
    run_prefill(mgr, a)
    mgr.free(a)
    assert mgr.block_pool.cached_block_hash_to_block == {}
    assert mgr.get_computed_blocks(make_request("b", range(9))) == ([], 0)
    assert mgr.stats.queries == 0


def test_free_unknown_request_is_noop():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    mgr.free(make_request("x", [1]))
    assert mgr.get_num_free_blocks() == 3
