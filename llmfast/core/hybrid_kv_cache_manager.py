"""The KV-cache manager of a model with several KV-cache groups (core/kv_cache_groups.py:
Gemma 3's global and sliding layers): one block pool, per request one block list per
group, all of the same length (block i holds tokens [i * bs, (i + 1) * bs) in each).

A global group keeps every block. A sliding group of window W gives back, as the
single-group manager does for a model whose every layer slides, the blocks that no later
query reads: at a step whose first query is at position p (= num_computed_tokens) the
keys before p - W + 1 are out of every window, so blocks [0, (p - W + 1) // bs) go back
to the pool and their list entries become `SKIPPED`. With W 16, bs 8 and p 40: keys
25.. are read, blocks 0..2 leave (3 = (40 - 16 + 1) // 8), blocks 3..4 stay.

The scheduler sees the same interface as KVCacheManager's; only the block ids differ in
shape: per request a tuple of one id list per group (`get_block_ids`, and the new ids of
`allocate_slots` through `block_ids_of`). Admission and preemption count the pool's
free blocks, so what a request needs is its new blocks in every group: G x the new
blocks of one list, after its sliding groups have freed what left their windows.

Prefix caching: each group caches its own full blocks under the key (group, hash); the
hash chain (Request.block_hashes) is the request's, computed once for all groups. A hit
of k blocks (the first uncomputed token at position n = k * bs) must be valid in every
group: a global group needs blocks 0..k-1 cached; a sliding group only the blocks its
window at n reaches, [(n - W + 1) // bs, k), the earlier ones entering its list as
`SKIPPED` (the scan: `longest_hit`, with a naive oracle in the tests). Freeing a request
releases its blocks position by position from the tail, all groups at each position, so
that the LRU evicts the tail of every group before the prefix of any.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from llmfast.core.block_pool import BlockHash, KVCacheBlock
from llmfast.core.kv_cache_manager import SKIPPED, KVCacheManager, _scores_prompt
from llmfast.core.request import Request

_NO_HITS: tuple = ()  # get_computed_blocks' blocks when nothing hits


def first_in_window(position: int, window: int, block_size: int) -> int:
    """The first block a query at `position` reads in a window of `window` keys (keys
    position - window + 1 .. position): 0 near the start."""
    return max(position - window + 1, 0) // block_size


def longest_hit(cached: Sequence[Sequence[bool]], windows: Sequence[int | None],
                max_blocks: int, block_size: int) -> int:
    """The most leading blocks k <= max_blocks that are a valid prefix hit in every group:
    `cached[g][i]` says whether group g has block i cached (for i < max_blocks); a
    global group (window None) needs blocks 0..k-1, a sliding one blocks
    first_in_window(k * bs) .. k-1. One pass per group, from the run of consecutive
    cached blocks ending at each block.

    Example, bs 4, window 6, max_blocks 5, a global group cached [T T T T F], a sliding
    group [F T T F T]: global allows k <= 4; sliding at k = 4 needs blocks 1..3 (block 3
    missing), at k = 3 blocks 1..2 (cached): k = 3."""
    limit = max_blocks
    for flags, window in zip(cached, windows):
        if window is None:
            k = 0
            while k < limit and flags[k]:
                k += 1
            limit = k
    valid = [True] * (limit + 1)  # valid[k]: a hit of k blocks is valid in every group
    for flags, window in zip(cached, windows):
        if window is None:
            continue
        run = 0  # cached blocks ending at block k - 1
        for k in range(1, limit + 1):
            run = run + 1 if flags[k - 1] else 0
            if valid[k] and k - first_in_window(k * block_size, window, block_size) > run:
                valid[k] = False
    k = limit
    while not valid[k]:
        k -= 1
    return k


class HybridKVCacheManager(KVCacheManager):
    """`windows`: per group (core/kv_cache_groups.py's order: group 0 the global or
    widest), its sliding window or None. `allocate_slots` and `free` are
    KVCacheManager's; the hooks below give them the per-group lists."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 windows: Sequence[int | None]) -> None:
        super().__init__(num_blocks, block_size, enable_caching)
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        # The sliding groups by window: groups of one window free in lockstep, so one
        # check per window and step (each group's own count is kept all the same).
        by_window: dict[int, list[int]] = {}
        for g, window in enumerate(self.windows):
            if window is not None:
                by_window.setdefault(window, []).append(g)
        self.sliding = tuple((w, tuple(gs)) for w, gs in by_window.items())
        self.frees_outside_window = bool(self.sliding)
        # Per request: per group, its leading SKIPPED blocks, and its leading blocks dealt
        # with for caching. `num_cached_blocks` holds the positions that every group has
        # dealt with (group 0's count, the least: it frees nothing early, or frees
        # latest), so a step tests that one alone.
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}  # type: ignore[assignment]
        self.num_skipped_blocks: dict[str, list[int]] = {}  # type: ignore[assignment]
        self.num_cached_per_group: dict[str, list[int]] = {}

    # ---- queries -------------------------------------------------------------------

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:  # type: ignore[override]
        lists = self.req_to_blocks.get(request_id)
        if lists is None:
            return tuple([] for _ in range(self.num_groups))
        return tuple([b.block_id for b in blocks] for blocks in lists)

    @staticmethod
    def block_ids_of(new_blocks: list[list[KVCacheBlock]]) -> tuple[list[int], ...]:
        """The ids of `allocate_slots`' new blocks, per group."""
        return tuple([b.block_id for b in blocks] for blocks in new_blocks)

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds from the pool, over all groups."""
        return sum(self.num_held_blocks_per_group(request_id))

    def num_held_blocks_per_group(self, request_id: str) -> list[int]:
        lists = self.req_to_blocks.get(request_id)
        if lists is None:
            return [0] * self.num_groups
        skipped = self.num_skipped_blocks[request_id]
        return [len(blocks) - s for blocks, s in zip(lists, skipped)]

    # ---- prefix cache --------------------------------------------------------------

    def get_computed_blocks(self, request: Request  # type: ignore[override]
                            ) -> tuple[list[list[KVCacheBlock]] | tuple, int]:
        """The longest prefix hit valid in every group (module doc): (per group its
        blocks, SKIPPED before a sliding group's window; num_computed_tokens)."""
        if not self.enable_caching or _scores_prompt(request):
            return _NO_HITS, 0
        bs = self.block_size
        max_blocks = (len(request.all_token_ids) - 1) // bs
        lookup = self.block_pool.cached_block_hash_to_block.get
        hashes = request.block_hashes
        windows = self.windows
        # Hashes as far as group 0 hits (all of them if it is sliding: its hits need
        # not be contiguous), adopting the map's objects (see KVCacheManager).
        found: list[list[KVCacheBlock | None]] = [[] for _ in windows]
        parent: BlockHash | None = None
        for i in range(max_blocks):
            block_hash = self._block_hash(request, i, parent)
            block = lookup((0, block_hash))
            if block is None and windows[0] is None:
                break
            if block is not None:
                block_hash = block.block_hash[1]
                hashes[i] = block_hash
            found[0].append(block)
            parent = block_hash
        num = len(found[0])
        for g in range(1, len(windows)):
            found[g] = [lookup((g, hashes[i])) for i in range(num)]
        k = longest_hit([[b is not None for b in blocks] for blocks in found], windows,
                        num, bs)
        if k == 0:
            return _NO_HITS, 0
        hits: list[list[KVCacheBlock]] = []
        for blocks, window in zip(found, windows):
            first = 0 if window is None else first_in_window(k * bs, window, bs)
            hits.append([SKIPPED] * first + blocks[first:k])  # type: ignore[list-item]
        return hits, k * bs

    def _cache_group(self, request: Request, g: int, blocks: list[KVCacheBlock],
                     num_full: int) -> None:
        """Cache group g's full blocks up to `num_full` under (g, hash)."""
        counts = self.num_cached_per_group[request.request_id]
        if num_full > counts[g]:
            self._cache_blocks(request, blocks, counts[g], num_full, g)
            counts[g] = num_full

    def _cache_full_blocks(self, request: Request,  # type: ignore[override]
                           lists: list[list[KVCacheBlock]], num_full: int) -> None:
        """Every group's full blocks up to `num_full` cached."""
        for g, blocks in enumerate(lists):
            self._cache_group(request, g, blocks, num_full)
        self.num_cached_blocks[request.request_id] = num_full

    # ---- allocation (KVCacheManager.allocate_slots, over the groups) ------------------

    @staticmethod
    def _num_hit_blocks(hits: list[list[KVCacheBlock]]) -> int:  # type: ignore[override]
        return len(hits[0])

    def _num_free_hits(self, hits: list[list[KVCacheBlock]]) -> int:  # type: ignore[override]
        return sum(1 for blocks in hits for b in blocks if b is not SKIPPED and b.ref_cnt == 0)

    def _take_blocks(self, rid: str,  # type: ignore[override]
                     lists: list[list[KVCacheBlock]] | None,
                     hits: list[list[KVCacheBlock]] | tuple | None, num_hit: int,
                     per_group: int) -> list[list[KVCacheBlock]]:
        """The hits (a sliding group's leading SKIPPED ones held by no pool), then
        `per_group` new blocks in each group; the new blocks per group."""
        pool = self.block_pool
        if lists is None:
            lists = self.req_to_blocks[rid] = [[] for _ in range(self.num_groups)]
            self.num_cached_blocks[rid] = 0
            self.num_cached_per_group[rid] = [0] * self.num_groups
            self.num_skipped_blocks[rid] = [0] * self.num_groups
        if num_hit:
            skipped = self.num_skipped_blocks[rid]
            for g, (blocks, hit) in enumerate(zip(lists, hits)):
                first = 0
                while first < num_hit and hit[first] is SKIPPED:
                    first += 1
                pool.touch(hit[first:])
                blocks.extend(hit)
                skipped[g] = first
        if not per_group:
            return [[] for _ in range(self.num_groups)]
        new_blocks = [pool.get_new_blocks(per_group) for _ in range(self.num_groups)]
        for blocks, new in zip(lists, new_blocks):
            blocks.extend(new)
        return new_blocks

    def _free_outside_window(self, request: Request,  # type: ignore[override]
                             lists: list[list[KVCacheBlock]], num_computed: int) -> None:
        """Each sliding group returns the blocks before the window of the request's next
        query (module doc) to the pool, caching the full ones first so that they stay
        findable while free."""
        rid = request.request_id
        bs = self.block_size
        skipped = self.num_skipped_blocks[rid]
        for window, groups in self.sliding:
            first_needed = min(first_in_window(num_computed, window, bs), len(lists[0]))
            if first_needed <= skipped[groups[0]]:  # (every step but one in bs)
                continue
            known = min(num_computed, len(request.all_token_ids)) // bs
            for g in groups:
                blocks = lists[g]
                start = skipped[g]
                if first_needed <= start:
                    continue
                if self.enable_caching:
                    self._cache_group(request, g, blocks, min(first_needed, known))
                leaving = blocks[start:first_needed]
                blocks[start:first_needed] = [SKIPPED] * len(leaving)
                skipped[g] = first_needed
                self.block_pool.free_blocks(reversed(leaving))

    def _release(self, rid: str, lists: list[list[KVCacheBlock]]) -> None:  # type: ignore[override]
        """`free`'s last part: tail positions first, all groups at each (module doc)."""
        del self.num_cached_per_group[rid]
        self.block_pool.free_blocks(_tail_first(lists, self.num_skipped_blocks.pop(rid)))


def _tail_first(lists: list[list[KVCacheBlock]], skipped: list[int]) -> Iterator[KVCacheBlock]:
    """The held blocks by position from the last, every group's at each position."""
    for i in range(len(lists[0]) - 1, -1, -1):
        for blocks, s in zip(lists, skipped):
            if i >= s:
                yield blocks[i]
