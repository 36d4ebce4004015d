"""Scratch memory the attention kernels reuse between calls, owned by whoever owns the KV
cache they attend over (the model runner), and freed with it.

- The Triton split-KV kernel writes per-split partials (accumulator, running max,
  running sum) that the merge kernel folds; they are kept by shape.
- The CPU attention builds a plan per step (gather indices, masks and gather buffers)
  that every layer of the step shares; the most recent plans are kept.

Allocating either per call would cost an allocation per layer per step. The runner makes
one `AttentionWorkspaces` for its KV cache and holds it; a kernel finds it from the cache
it is given (`AttentionWorkspaces.of`, through an index that holds owners weakly, so the
index itself keeps nothing alive). A cache nobody owns gets fresh scratch each call.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

import torch

T = TypeVar("T")
# [num_splits, num_tokens, num_heads, head_dim_p] f32, and max / sum [num_splits,
# num_tokens, num_heads] f32 each.
Partials = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def new_partials(device: torch.device, num_splits: int, num_tokens: int, num_heads: int,
                 head_dim_p: int) -> Partials:
    f32 = {"dtype": torch.float32, "device": device}
    acc = torch.empty(num_splits, num_tokens, num_heads, head_dim_p, **f32)
    stats = torch.empty(2, num_splits, num_tokens, num_heads, **f32)
    return acc, stats[0], stats[1]


def arrivals_bound(max_num_tokens: int, max_num_reqs: int, num_kv_heads: int) -> int:
    """The most fused-merge counters an attention launch of at most `max_num_tokens`
    tokens and `max_num_reqs` requests takes: one per KV head and query tile (at most
    one a token, plus one a request: the plan's `num_tiles`) or, with a decode region,
    per KV head and request (attention/triton/launch.py `_plan`)."""
    return (max_num_tokens + max_num_reqs) * num_kv_heads


def _storage_key(cache: torch.Tensor) -> int:
    # The runner's layers' k and v caches are views of one tensor: one storage, one key.
    # Live allocations never share an address, host or device (CUDA's unified virtual
    # addressing), so the address alone names the storage; str(device) would cost 3 us.
    return cache.untyped_storage().data_ptr()


def _lru(entries: OrderedDict[Any, T], key: Hashable, make: Callable[[], T], limit: int) -> T:
    value = entries.get(key)
    if value is None:
        value = entries[key] = make()
        if len(entries) > limit:
            entries.popitem(last=False)
    else:
        entries.move_to_end(key)
    return value


class AttentionWorkspaces:
    """The scratch of the attention calls over `caches` (tensors or views of them)."""

    def __init__(self, caches: Iterable[torch.Tensor], max_shapes: int = 16,
                 max_plans: int = 2) -> None:
        self.max_shapes, self.max_plans = max_shapes, max_plans
        self._partials: OrderedDict[tuple[int, ...], Partials] = OrderedDict()
        self._plans: OrderedDict[Hashable, Any] = OrderedDict()
        # The fused merge's arrival counters: one int32 buffer of which each split
        # launch uses the first n (a few per query tile and KV head), zero between
        # launches (the last arrival resets its own; launches run one at a time, on one
        # stream), so any launch shape finds them, a CUDA graph's capture too (no memset
        # recorded in the graph). A launch needing more replaces it with a larger one;
        # the outgrown ones are kept, since graphs captured with them hold their addresses.
        self._arrivals: torch.Tensor | None = None
        self._outgrown_arrivals: list[torch.Tensor] = []
        for cache in caches:
            _OWNERS[_storage_key(cache)] = self

    @classmethod
    def of(cls, cache: torch.Tensor) -> AttentionWorkspaces | None:
        """The workspaces of whoever owns `cache`, if anyone does."""
        return _OWNERS.get(_storage_key(cache))

    def partials(self, device: torch.device, *shape: int) -> Partials:
        """Split partials for (num_splits, num_tokens, num_heads, head_dim_p)."""
        return _lru(self._partials, shape, lambda: new_partials(device, *shape),
                    self.max_shapes)

    def arrivals(self, device: torch.device, n: int) -> torch.Tensor:
        """At least `n` int32 arrival counters for the fused merge, zero between launches
        (the buffer every launch shares; grown, never shrunk). The runner asks for what
        its largest launch needs when it allocates the KV cache, before any capture."""
        counters = self._arrivals
        if counters is None or counters.numel() < n:
            if counters is not None:
                self._outgrown_arrivals.append(counters)
            size = max(n, 2 * counters.numel() if counters is not None else 0)
            counters = self._arrivals = torch.zeros(size, dtype=torch.int32, device=device)
        return counters

    def existing_arrivals(self, n: int) -> torch.Tensor | None:
        """The counters, if at least `n` exist (none are made here: a CUDA graph capture
        asks, and memory allocated there would be the graph's)."""
        counters = self._arrivals
        return counters if counters is not None and counters.numel() >= n else None

    def split_scratch(self, device: torch.device, shape: tuple[int, int, int, int],
                      num_arrivals: int) -> tuple[Partials, torch.Tensor | None]:
        """`partials(device, *shape)` and, unless `num_arrivals` is 0,
        `arrivals(device, num_arrivals)` (else None): one call per split launch, with the
        hits (every call after a shape's first) inlined."""
        partials = self._partials.get(shape)
        if partials is None:
            partials = self.partials(device, *shape)
        else:
            self._partials.move_to_end(shape)
        if not num_arrivals:
            return partials, None
        arrivals = self._arrivals
        if arrivals is None or arrivals.numel() < num_arrivals:
            arrivals = self.arrivals(device, num_arrivals)
        return partials, arrivals

    def cpu_plan(self, key: Hashable, build: Callable[[], T]) -> T:
        """The CPU attention's plan for `key` (the step's metadata), built once."""
        return _lru(self._plans, key, build, self.max_plans)

    @property
    def num_partials(self) -> int:
        return len(self._partials)

    @property
    def num_arrival_buffers(self) -> int:
        """Counter buffers made so far (the current one and the outgrown)."""
        return len(self._outgrown_arrivals) + (self._arrivals is not None)

    @property
    def num_plans(self) -> int:
        return len(self._plans)


# KV-cache storage -> its owner's workspaces, held weakly: an index, not an owner.
_OWNERS: weakref.WeakValueDictionary[int, AttentionWorkspaces] = \
    weakref.WeakValueDictionary()
