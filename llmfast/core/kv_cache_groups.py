"""KV-cache groups: the model's layers partitioned by attention spec (global, or a
sliding window of W tokens), so that a sliding layer's blocks can leave the cache while
a global layer's stay.

Every group's blocks come from one pool, and each request holds one block list per
group; block i of every list holds the keys of tokens [i * block_size, (i + 1) *
block_size), so all lists of a request grow together. A global group keeps every block;
a sliding group gives back (core/hybrid_kv_cache_manager.py) the blocks every later
query's window has left.

Page layout (chosen so that a block id means the same bytes in every group): every group
holds the same number of layers, `layers_per_block`; the cache is one tensor
`[layers_per_block, 2, num_blocks, block_size, kv_heads, head_dim]`, and the layer at
position j of its group reads and writes `cache[j]` at its group's block ids. A block id
is then `layers_per_block` layers' K and V, whichever group holds it, and the pool needs
no per-group partition: what one group frees, any other can take, however the mix of
long and short requests moves. The price is padding: the last group of a kind may have
fewer layers than `layers_per_block`, and its unused positions' pages stay empty.
(Separate tensors per group, sized by need, would waste no page, but the global/sliding
ratio of blocks held depends on the context length, so a fixed split wastes more.)

`layers_per_block` is the smallest group's layer count (vLLM's rule): every kind
splits into groups of that many layers; where the largest kind is within 1.25x of the
smallest, one group per kind of the largest kind's size (less bookkeeping, little padding).

Worked example, Gemma 3 1B: 26 layers, every sixth global (layers 5, 11, 17, 23),
window 512, block 16. The kinds: 4 global layers, 22 sliding. layers_per_block = 4:
group 0 = global [5, 11, 17, 23]; groups 1-6 = sliding [0 1 2 3], [4 6 7 8],
[9 10 12 13], [14 15 16 18], [19 20 21 22], [24 25 -, -] (two padded positions). A block
id is 4 layers' pages (64 KiB in bf16: 4 x 2 x 16 tokens x 1 KV head x 256 x 2 bytes)
instead of the 26 layers' 416 KiB of one group. A request at 32768 tokens holds 2048
blocks in group 0 and at most ceil(512 / 16) + 1 = 33 in each sliding group while it
decodes: 2048 + 6 x 33 = 2246 blocks = 140 MiB, against 2048 x 416 KiB = 832 MiB with
every layer keeping every block (5.9x less).

Models with one kind of layer (every family but Gemma 3 and Qwen's partly sliding
checkpoints) have one group of all layers: the layout and the KV-cache manager are
those of a plain paged cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmfast.config import ModelConfig


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # the sliding window of its layers; None: global attention
    layers: tuple[int, ...]  # model layer indices, in order


@dataclass(frozen=True)
class KVCacheGroups:
    """The model's groups: global ones first, then sliding ones by window, largest first
    (so group 0 is the one whose blocks stay longest: the KV-cache manager relies on it)."""

    groups: tuple[KVCacheGroup, ...]
    layers_per_block: int  # layers whose pages one block id spans
    num_layers: int

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    def layer_group(self) -> tuple[int, ...]:
        """Per model layer, the index of its group."""
        out = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = g
        return tuple(out)

    def layer_slot(self) -> tuple[int, ...]:
        """Per model layer, its position in its group: the cache page it reads."""
        out = [0] * self.num_layers
        for group in self.groups:
            for j, layer in enumerate(group.layers):
                out[layer] = j
        return tuple(out)

    def max_blocks_per_request(self, num_tokens: int, max_step_tokens: int,
                               block_size: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds over all groups at any
        step computing at most `max_step_tokens` tokens: every block in a global group; in
        a sliding one the blocks spanning the step's tokens and the W - 1 keys before the
        first of them (one more for alignment), never more than the request spans.
        Decoding (one token a step), that is ceil(W / block_size) + 1."""
        spanned = -(-num_tokens // block_size)
        step = min(max_step_tokens, num_tokens)
        total = 0
        for group in self.groups:
            if group.window is None:
                total += spanned
            else:
                total += min(spanned, -(-(step + group.window - 1) // block_size) + 1)
        return total

    def max_tokens(self, num_usable_blocks: int, max_step_tokens: int, block_size: int,
                   upper: int) -> int:
        """The longest sequence (at most `upper` tokens) whose blocks fit in
        `num_usable_blocks` (binary search: `max_blocks_per_request` grows with it)."""
        lo, hi = 0, upper
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.max_blocks_per_request(mid, max_step_tokens, block_size) <= num_usable_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


def kv_cache_groups(config: ModelConfig) -> KVCacheGroups:
    """`config`'s layers in KV-cache groups (module doc)."""
    num_layers = config.num_hidden_layers
    kinds: dict[int | None, list[int]] = {}
    for layer in range(num_layers):
        kinds.setdefault(config.layer_window(layer), []).append(layer)
    if len(kinds) == 1:
        (window, layers), = kinds.items()
        return KVCacheGroups((KVCacheGroup(window, tuple(layers)),), num_layers, num_layers)
    counts = [len(layers) for layers in kinds.values()]
    size = min(counts)
    if max(counts) < 1.25 * size:
        size = max(counts)
    # Global first, then the widest window first (KVCacheGroups' order).
    order = sorted(kinds, key=lambda w: -1 if w is None else 1.0 / w)
    groups = tuple(KVCacheGroup(window, tuple(kinds[window][i:i + size]))
                   for window in order for i in range(0, len(kinds[window]), size))
    return KVCacheGroups(groups, size, num_layers)
