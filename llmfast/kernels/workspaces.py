"""Scratch memory the Triton attention reuses between calls, owned by the model runner
whose KV cache it attends over, and freed with that runner.

The split-KV kernel writes per-split partials (accumulator, running max, running sum)
that the merge kernel folds; allocating them per call would cost an allocation per
layer per step, so they are kept by shape. The runner makes one `SplitWorkspaces` for
its KV cache and holds it; the kernel finds it from the cache it is given
(`SplitWorkspaces.of`, through an index that holds owners weakly, so the index itself
keeps nothing alive). A cache nobody owns (tests, kernel benchmarks, the scratch cache
of memory profiling) gets fresh buffers each call.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

# [num_splits, num_tokens, num_heads, head_dim_p] f32, and max / sum [num_splits,
# num_tokens, num_heads] f32 each.
Partials = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def new_partials(device: torch.device, num_splits: int, num_tokens: int, num_heads: int,
                 head_dim_p: int) -> Partials:
    f32 = {"dtype": torch.float32, "device": device}
    acc = torch.empty(num_splits, num_tokens, num_heads, head_dim_p, **f32)
    stats = torch.empty(2, num_splits, num_tokens, num_heads, **f32)
    return acc, stats[0], stats[1]


def _storage_key(cache: torch.Tensor) -> tuple[str, int]:
    # Every layer's k and v caches are views of one runner tensor: one storage, one key.
    return str(cache.device), cache.untyped_storage().data_ptr()


class SplitWorkspaces:
    """Partials by shape for the KV cache `kv_cache` (any view of its storage): the
    `max_shapes` most recently used shapes are kept."""

    def __init__(self, kv_cache: torch.Tensor, max_shapes: int = 16) -> None:
        self.max_shapes = max_shapes
        self._partials: OrderedDict[tuple[int, ...], Partials] = OrderedDict()
        _OWNERS[_storage_key(kv_cache)] = self

    @classmethod
    def of(cls, cache: torch.Tensor) -> SplitWorkspaces | None:
        """The workspaces of the runner that owns `cache`, if one does."""
        return _OWNERS.get(_storage_key(cache))

    def get(self, device: torch.device, *shape: int) -> Partials:
        """Partials for (num_splits, num_tokens, num_heads, head_dim_p)."""
        partials = self._partials.get(shape)
        if partials is None:
            partials = self._partials[shape] = new_partials(device, *shape)
            if len(self._partials) > self.max_shapes:
                self._partials.popitem(last=False)
        else:
            self._partials.move_to_end(shape)
        return partials

    def __len__(self) -> int:
        return len(self._partials)


# KV-cache storage -> its owner's workspaces, held weakly: an index, not an owner.
_OWNERS: weakref.WeakValueDictionary[tuple[str, int], SplitWorkspaces] = \
    weakref.WeakValueDictionary()
