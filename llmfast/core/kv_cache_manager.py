"""Per-request block lists on top of the block pool: allocation, prefix-cache lookup and
caching of full blocks.

Block i of a request holds the KV of its tokens [i * block_size, (i + 1) * block_size).
With block_size 16, a request with 40 computed tokens and 8 more scheduled needs
ceil(48 / 16) = 3 blocks; its full blocks 0 and 1 are cacheable, block 2 (tokens 32..47)
becomes cacheable once all 16 of its tokens are computed.

Sliding window (`sliding_window`: a model whose every layer attends to the last
`sliding_window` keys only): a block all of whose keys are before the window of the
request's next query is never read again (the attention skips it), so it goes back to
the pool at once. Its place in the request's list (block i still holds tokens
[i * bs, (i + 1) * bs)) is taken by `SKIPPED`, a stand-in no pool owns, whose id (the
null block's) the runner's block table may keep or not: the attention never reads it.
With block_size 16 and a window of 32, a request with 100 computed tokens holds blocks
4..6 (its next query, at position 100, sees keys 69..100): ceil(32 / 16) + 1 at most.
A freed block keeps its hash while it is free, so other requests still hit it. (Models
with both global and sliding layers have several KV-cache groups: the hybrid manager,
core/hybrid_kv_cache_manager.py, keeps one block list per group.)
"""

from __future__ import annotations

from dataclasses import dataclass

from llmfast.core.block_pool import NULL_BLOCK_ID, BlockHash, BlockPool, KVCacheBlock
from llmfast.core.request import Request

# What allocate_slots returns when a request needs no new block (most decode steps):
# one shared list, never mutated.
_NO_NEW_BLOCKS: list[KVCacheBlock] = []
# A request's block that left the sliding window and went back to the pool (module doc).
SKIPPED = KVCacheBlock(NULL_BLOCK_ID)


@dataclass
class PrefixCacheStats:
    """Counted once per admission (a new or resumed request), in tokens."""

    num_queries: int = 0  # admissions looked up
    queries: int = 0  # tokens of those requests
    hits: int = 0  # tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # The groups each position takes a block in (the hybrid manager has several),
        # and whether blocks that left a window are freed.
        self.num_groups = 1
        self.frees_outside_window = sliding_window is not None
        # Per request: how many leading blocks are SKIPPED (sliding window only).
        self.num_skipped_blocks: dict[str, int] = {}
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Per request: the tokens its blocks hold (block_size per position), what
        # allocate_slots' hot path checks, whatever the shape of its block lists.
        self.num_slots: dict[str, int] = {}
        # How many leading blocks of each request are already dealt with for caching
        # (hashed into the map, or found there); the next caching pass starts after them.
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_usable_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    @staticmethod
    def block_ids_of(new_blocks: list[KVCacheBlock]) -> list[int]:
        """The ids of `allocate_slots`' new blocks (what the runner's table appends)."""
        return [b.block_id for b in new_blocks]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds from the pool (its SKIPPED ones not counted)."""
        blocks = self.req_to_blocks.get(request_id, ())
        return len(blocks) - self.num_skipped_blocks.get(request_id, 0)

    # ---- prefix cache --------------------------------------------------------------

    def _block_hash(self, request: Request, i: int, parent: BlockHash | None) -> BlockHash:
        """Hash of the request's full block i, computed once and kept on the request."""
        hashes = request.block_hashes
        if i < len(hashes):
            block_hash = hashes[i]
            if parent is not None and block_hash.parent is not parent:
                # `parent` is an equal-content object taken from the map; pointing at it
                # keeps later equality checks to one `is` instead of a chain walk. Safe
                # even if block_hash is a map key: its value and equality are unchanged.
                block_hash.parent = parent
            return block_hash
        bs = self.block_size
        tokens = tuple(request.all_token_ids[i * bs : (i + 1) * bs])
        if len(tokens) != bs:  # a placeholder's value is unknown: it must never be hashed
            raise RuntimeError(f"request {request.request_id}: block {i} is not all known")
        block_hash = BlockHash(parent, tokens)
        hashes.append(block_hash)
        return block_hash

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks: (blocks, num_computed_tokens).

        At most num_tokens - 1 tokens count as computed: the last token must run through
        the model to produce logits. E.g. block_size 16, a 32-token prompt fully cached:
        (32 - 1) // 16 = 1 block hits, and the second block is recomputed.
        A request that wants prompt logprobs takes no hits (as in vLLM): it needs the
        logits of every prompt position, and cached tokens are not computed.
        """
        if not self.enable_caching or _scores_prompt(request):
            return [], 0
        max_blocks = (len(request.all_token_ids) - 1) // self.block_size
        lookup = self.block_pool.cached_block_hash_to_block.get
        hashes = request.block_hashes
        computed: list[KVCacheBlock] = []
        parent = None
        for i in range(max_blocks):
            block_hash = self._block_hash(request, i, parent)
            block = lookup(block_hash)
            if block is None:
                break
            # Adopt the map's object so the next block's parent is identical to the
            # cached child's parent.
            parent = block.block_hash
            hashes[i] = parent
            computed.append(block)
        return computed, len(computed) * self.block_size

    def _cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_full: int
    ) -> None:
        rid = request.request_id
        self._cache_blocks(request, blocks, self.num_cached_blocks[rid], num_full, None)
        self.num_cached_blocks[rid] = num_full

    def _cache_blocks(self, request: Request, blocks: list[KVCacheBlock], start: int,
                      num_full: int, group: int | None) -> None:
        """Put the request's full blocks start..num_full-1 in the hash map: under their
        hash, or with several KV-cache groups under (group, hash)."""
        hashes = request.block_hashes
        parent = hashes[start - 1] if start else None
        cache_block = self.block_pool.cache_block
        for i in range(start, num_full):
            block = blocks[i]
            if block is SKIPPED:  # left the window uncached: hashed for the chain only
                parent = self._block_hash(request, i, parent)
                continue
            if block.block_hash is not None:  # a prefix hit: already in the map
                parent = block.block_hash if group is None else block.block_hash[1]
                continue
            block_hash = self._block_hash(request, i, parent)
            cached = cache_block(block, block_hash if group is None else (group, block_hash))
            # If another request cached this content first, `block` stays a private,
            # unhashed copy; the chain continues from the cached object.
            parent = cached.block_hash if group is None else cached.block_hash[1]
            hashes[i] = parent

    # ---- allocation ----------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` (prefix hits from `get_computed_blocks`, passed on
        admission, possibly empty) are taken before the new tokens. Returns the newly
        allocated blocks, or None, with nothing changed, if the free blocks don't
        suffice. Also caches the request's full blocks whose tokens are computed by now
        (before this step: the ones scheduled now are not computed yet). The hybrid
        manager runs this too, over its groups' lists (its hooks: `_num_hit_blocks`,
        `_num_free_hits`, `_take_blocks`, `_free_outside_window`, `_cache_full_blocks`).
        """
        rid = request.request_id
        num_computed = request.num_computed_tokens
        num_slots = self.num_slots.get(rid)
        if self.frees_outside_window and num_slots is not None:
            self._free_outside_window(request, self.req_to_blocks[rid], num_computed)
        if (new_computed_blocks is None and num_slots is not None
                and num_computed + num_new_tokens <= num_slots):
            # Hot path: a running request whose new tokens fit in its blocks (a decode
            # step, but one in block_size). The shared empty list: no new object per
            # request and step.
            new_blocks: list[KVCacheBlock] = _NO_NEW_BLOCKS
        else:
            num_hit = self._num_hit_blocks(new_computed_blocks) if new_computed_blocks else 0
            new_blocks = self._allocate(request, num_new_tokens, new_computed_blocks,
                                        num_hit, num_slots)
            if new_blocks is None:
                return None
            num_computed += num_hit * self.block_size
            if new_computed_blocks is not None and self.enable_caching:
                self._count_admission(request, num_hit)
        if self.enable_caching:
            # Only blocks whose token values are all known: a placeholder (a token still in
            # flight, see Request) must never be hashed.
            num_full = min(num_computed, len(request.all_token_ids)) // self.block_size
            if num_full > self.num_cached_blocks[rid]:
                self._cache_full_blocks(request, self.req_to_blocks[rid], num_full)
        return new_blocks

    def _count_admission(self, request: Request, num_hit: int) -> None:
        """Prefix-cache stats of one admission: its tokens, and the `num_hit` blocks'
        found cached."""
        stats = self.stats
        stats.num_queries += 1
        stats.queries += len(request.all_token_ids)
        stats.hits += num_hit * self.block_size

    def _allocate(self, request: Request, num_new_tokens: int,
                  new_computed_blocks: list[KVCacheBlock] | None, num_hit: int,
                  num_slots: int | None) -> list[KVCacheBlock] | None:
        """allocate_slots' general case: take the `num_hit` prefix hits, then the new
        blocks the tokens need (in every group); None, with nothing changed, if the free
        blocks don't suffice. `num_slots`: the request's, None before its admission."""
        rid = request.request_id
        bs = self.block_size
        num_computed = request.num_computed_tokens + num_hit * bs
        num_have = num_hit + (0 if num_slots is None else num_slots // bs)
        # ceil((num_computed + num_new_tokens) / bs) blocks needed in all (per group).
        num_new_blocks = (num_computed + num_new_tokens + bs - 1) // bs - num_have
        if num_new_blocks <= 0 and not num_hit and num_slots is not None:
            return _NO_NEW_BLOCKS  # fits (admission with no hits)
        num_new_blocks = max(num_new_blocks, 0)
        num_free = self.block_pool.free_block_queue.num_free_blocks
        if num_hit:
            # Touching a free cached hit takes it out of the free queue too.
            num_free -= self._num_free_hits(new_computed_blocks)
        if num_new_blocks * self.num_groups > num_free:
            return None
        new_blocks = self._take_blocks(rid, self.req_to_blocks.get(rid), new_computed_blocks,
                                       num_hit, num_new_blocks)
        self.num_slots[rid] = (num_have + num_new_blocks) * bs
        return new_blocks

    @staticmethod
    def _num_hit_blocks(hits: list[KVCacheBlock]) -> int:
        """The positions `get_computed_blocks`' hits cover."""
        return len(hits)

    def _num_free_hits(self, hits: list[KVCacheBlock]) -> int:
        """How many of the prefix hits are free (in the free queue)."""
        return sum(1 for b in hits if b.ref_cnt == 0)

    def _take_blocks(self, rid: str, req_blocks: list[KVCacheBlock] | None,
                     hits: list[KVCacheBlock] | None, num_hit: int,
                     num_new_blocks: int) -> list[KVCacheBlock]:
        """`_allocate` once the pool has room: the hits, then `num_new_blocks` new blocks,
        onto the request's list (made on admission); the new blocks."""
        pool = self.block_pool
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
            self.num_cached_blocks[rid] = 0
        if num_hit:
            pool.touch(hits)
            req_blocks.extend(hits)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        return new_blocks

    def _free_outside_window(self, request: Request, req_blocks: list[KVCacheBlock],
                             num_computed: int) -> None:
        """Return the blocks before the window of the request's next query (position
        num_computed: it sees keys num_computed - window + 1 on) to the pool, newest
        first as `free` does; cached first (those whose tokens are all known), so that
        they stay findable while free."""
        rid = request.request_id
        first_needed = min((num_computed - self.sliding_window + 1) // self.block_size,
                           len(req_blocks))
        skipped = self.num_skipped_blocks.get(rid, 0)
        if first_needed <= skipped:  # (every step but one in block_size)
            return
        if self.enable_caching:
            known = min(num_computed, len(request.all_token_ids)) // self.block_size
            if min(first_needed, known) > self.num_cached_blocks[rid]:
                self._cache_full_blocks(request, req_blocks, min(first_needed, known))
        leaving = req_blocks[skipped:first_needed]
        req_blocks[skipped:first_needed] = [SKIPPED] * len(leaving)
        self.num_skipped_blocks[rid] = first_needed
        self.block_pool.free_blocks(reversed(leaving))

    def free(self, request: Request) -> None:
        """Release the request's blocks, caching its computed full blocks first.

        Blocks are released tail first, so that the request's later blocks are evicted
        before its prefix (see BlockPool.free_blocks).
        """
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        if blocks is None:
            return
        num_slots = self.num_slots.pop(rid)
        if self.enable_caching:
            num_known = min(request.num_computed_tokens, len(request.all_token_ids), num_slots)
            num_full = num_known // self.block_size
            if num_full > self.num_cached_blocks[rid]:
                self._cache_full_blocks(request, blocks, num_full)
        del self.num_cached_blocks[rid]
        self._release(rid, blocks)

    def _release(self, rid: str, blocks: list[KVCacheBlock]) -> None:
        """`free`'s last part: the held blocks back to the pool, the last first."""
        skipped = self.num_skipped_blocks.pop(rid, 0)
        self.block_pool.free_blocks(reversed(blocks[skipped:]))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()


def _scores_prompt(request: Request) -> bool:
    """The request still needs its prompt's logits: it wants prompt logprobs and has
    generated nothing (resumed after preemption with tokens out, its prompt was scored)."""
    return request.sampling_params.prompt_logprobs is not None and not request.output_token_ids
