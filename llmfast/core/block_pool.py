"""Physical KV-cache blocks, the LRU free-block queue and the prefix-cache hash map.

A block is free when no request holds it (ref_cnt 0). A free block may still carry the
hash of a full block it held: it stays findable in the hash map, and so reusable as a
cached prefix, until the free queue hands it out for new content. That is the whole
eviction policy: LRU over free blocks, evicting lazily at allocation time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Block 0 is never handed out: padding entries of block tables and slot mappings may
# point at it, so whatever a padded token writes lands there.
NULL_BLOCK_ID = 0


def hash_block_tokens(parent_value: int | None, token_ids: tuple[int, ...]) -> int:
    """The cheap part of a block hash; collisions are harmless (see `BlockHash.__eq__`).

    Module-level so that tests can replace it with a constant to force collisions.
    """
    return hash((parent_value, token_ids))


class BlockHash:
    """Identity of a full block's content: its token ids and, through `parent`, every
    token before it.

    `value` chains the parent's value with the block's tokens so that dict lookups are
    one integer hash. Equality then compares the tokens and walks the parent chain, so a
    hash collision can never produce a false prefix hit. The walk is short in practice:
    the KV cache manager re-points `parent` at the object stored in the map whenever it
    finds one, so the chain comparison stops at the first `is` match.
    """

    __slots__ = ("parent", "token_ids", "value")

    def __init__(self, parent: BlockHash | None, token_ids: tuple[int, ...]) -> None:
        self.parent = parent
        self.token_ids = token_ids
        self.value = hash_block_tokens(None if parent is None else parent.value, token_ids)

    def __hash__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockHash):
            return NotImplemented
        a: BlockHash | None = self
        b: BlockHash | None = other
        # Iterative, not recursive: prompts can be thousands of blocks deep.
        while a is not b:
            if a is None or b is None or a.value != b.value or a.token_ids != b.token_ids:
                return False
            a, b = a.parent, b.parent
        return True

    def __repr__(self) -> str:
        return f"BlockHash({self.value:#x}, {len(self.token_ids)} tokens)"


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "next_free_block", "prev_free_block", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block holds a full block that is in the hash map.
        self.block_hash: BlockHash | None = None
        # Free-queue links (None while the block is held).
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        hashed = self.block_hash is not None
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, hashed={hashed})"


class FreeKVCacheBlockQueue:
    """Doubly linked list threaded through the blocks themselves.

    Two sentinel blocks (ids -1) bound the list so that no operation has an edge case and
    none allocates: popleft, remove and append only rewrite links. The head is the next
    block to hand out (least recently freed); freed blocks go to the tail.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        self.head.next_free_block = self.tail
        self.tail.prev_free_block = self.head
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free_block
        if block is self.tail:
            raise ValueError("no free blocks")
        nxt = block.next_free_block
        self.head.next_free_block = nxt
        nxt.prev_free_block = self.head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.tail
        self.tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail; O(n), for tests and debugging."""
        out = []
        block = self.head.next_free_block
        while block is not self.tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockPool:
    """All blocks of the cache, the free queue and the hash -> block map.

    With `num_blocks` N, blocks 1..N-1 are usable; block 0 is the null block.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.num_usable_blocks = num_blocks - 1
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[NULL_BLOCK_ID]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # One block per content: a request that computed a duplicate of a cached block
        # keeps its copy unhashed, and that copy is freed as plain memory.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> KVCacheBlock:
        """Register a just-filled full block; returns the block now cached under that
        content (`block` itself, or an earlier block holding the same tokens)."""
        cached = self.cached_block_hash_to_block.setdefault(block_hash, block)
        if cached is block:
            block.block_hash = block_hash
        return cached

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` from the LRU head, evicting their cached content now."""
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {queue.num_free_blocks} free")
        popleft = queue.popleft
        cache = self.cached_block_hash_to_block
        out = []
        for _ in range(num_blocks):
            block = popleft()
            if block.block_hash is not None:
                # Evicted only now that its memory is needed, not when it was freed.
                del cache[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to cached blocks (prefix hits); a free one leaves the queue."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; those now unused go to the LRU tail in the
        given order, so pass a request's blocks tail first: its prefix blocks, the ones
        most likely shared by future requests, are then evicted last."""
        append = self.free_block_queue.append
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is held."""
        if self.free_block_queue.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True
