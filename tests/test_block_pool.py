"""Block pool: free-queue links, LRU order, lazy eviction, the null block."""

from __future__ import annotations

import tracemalloc

import pytest

from llmfast.core import block_pool as bp
from llmfast.core.block_pool import (
    NULL_BLOCK_ID,
    BlockHash,
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)


def ids(blocks):
    return [b.block_id for b in blocks]


def test_block_has_slots():
    block = KVCacheBlock(3)
    with pytest.raises(AttributeError):
        block.something = 1  # type: ignore[attr-defined]
    assert (block.block_id, block.ref_cnt, block.block_hash) == (3, 0, None)


def test_queue_popleft_remove_append():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 5
    assert q.popleft() is blocks[0]
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4]
    q.append(blocks[2])
    q.append(blocks[0])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 2, 0]
    q.remove(blocks[0])  # the tail
    q.remove(blocks[1])  # the head
    assert ids(q.get_all_free_blocks()) == [3, 4, 2]
    assert q.num_free_blocks == 3
    for _ in range(3):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft()
    with pytest.raises(ValueError):
        q.remove(blocks[3])  # not in the queue any more


def test_queue_ops_allocate_nothing():
    blocks = [KVCacheBlock(i) for i in range(64)]
    q = FreeKVCacheBlockQueue(blocks)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(200):
            b = q.popleft()
            q.append(b)
            q.remove(blocks[10])
            q.append(blocks[10])
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    grown = [
        s
        for s in after.compare_to(before, "filename")
        if s.traceback[0].filename == bp.__file__ and s.size_diff > 0
    ]
    assert grown == []


def test_null_block_reserved():
    pool = BlockPool(4)
    assert pool.num_usable_blocks == 3
    assert pool.get_num_free_blocks() == 3
    got = pool.get_new_blocks(3)
    assert NULL_BLOCK_ID not in ids(got)
    assert pool.null_block.block_id == NULL_BLOCK_ID
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        BlockPool(1)


def test_lru_order_after_frees():
    pool = BlockPool(9)  # blocks 1..8
    a = pool.get_new_blocks(3)  # 1 2 3
    b = pool.get_new_blocks(3)  # 4 5 6
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [7, 8]
    # A request frees tail first, so its prefix blocks sit closest to the LRU tail.
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [7, 8, 3, 2, 1, 6, 5, 4]
    # Allocation pops from the head: the never-used blocks, then a's tail.
    assert ids(pool.get_new_blocks(4)) == [7, 8, 3, 2]
    assert pool.get_usage() == pytest.approx(4 / 8)


def test_touch_and_shared_ref_counts():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    pool.touch(blocks)
    assert [b.ref_cnt for b in blocks] == [2, 2]
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 2  # still held once
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 4
    # Touching a free block takes it out of the free queue.
    pool.touch([blocks[1]])
    assert blocks[1] not in pool.free_block_queue.get_all_free_blocks()
    assert pool.get_num_free_blocks() == 3


def test_eviction_is_lazy():
    pool = BlockPool(4)  # blocks 1..3
    (block,) = pool.get_new_blocks(1)
    h = BlockHash(None, (1, 2, 3))
    assert pool.cache_block(block, h) is block
    pool.free_blocks([block])
    # Free but still findable: freeing evicts nothing.
    assert pool.get_cached_block(BlockHash(None, (1, 2, 3))) is block
    assert block.block_hash is h
    pool.get_new_blocks(2)  # the two never-used blocks come first
    assert pool.get_cached_block(h) is block
    (again,) = pool.get_new_blocks(1)  # now its memory is needed
    assert again is block
    assert block.block_hash is None and pool.get_cached_block(h) is None


def test_cache_block_keeps_first_copy():
    pool = BlockPool(4)
    b1, b2 = pool.get_new_blocks(2)
    assert pool.cache_block(b1, BlockHash(None, (5,))) is b1
    assert pool.cache_block(b2, BlockHash(None, (5,))) is b1
    assert b2.block_hash is None  # the duplicate stays plain memory


def test_block_hash_equality_is_exact_under_collisions(monkeypatch):
    monkeypatch.setattr(bp, "hash_block_tokens", lambda parent, tokens: 0)
    a0, b0 = BlockHash(None, (1, 2)), BlockHash(None, (9, 9))
    a1, b1 = BlockHash(a0, (3, 4)), BlockHash(b0, (3, 4))
    assert hash(a1) == hash(b1) == 0
    assert a1 != b1  # same last tokens, different prefix
    assert a1 == BlockHash(BlockHash(None, (1, 2)), (3, 4))
    assert a0 != a1  # different depth


def test_deep_chain_equality_does_not_recurse():
    a = b = None
    for i in range(5000):
        a, b = BlockHash(a, (i,)), BlockHash(b, (i,))
    assert a == b


def test_reset_prefix_cache():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, BlockHash(None, (1,)))
    assert not pool.reset_prefix_cache()  # held
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.cached_block_hash_to_block == {} and block.block_hash is None
