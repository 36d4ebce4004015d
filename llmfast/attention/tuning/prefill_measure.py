"""What the prefill tile tuner times: a synthetic batch of one shape class, and the median
device time of a launch over it (CUDA events).

The batch does not depend on the live call that triggered the tuning (its buffers are
never written): 8 KV heads x the class's group, block size 16, random values.
- causal: one request of CAUSAL_TOKENS fresh tokens;
- mixed: a MIXED_CHUNK-token chunk over a MIXED_CHUNK-token cached prefix, plus
  MIXED_DECODES decode rows at context MIXED_CHUNK (a chunked-prefill step).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

from llmfast.attention.tuning.prefill_tuning import ShapeClass, parse_kv_dtype_name

CAUSAL_TOKENS = 4096
MIXED_CHUNK = 1024
MIXED_DECODES = 32
KV_HEADS = 8
BLOCK_SIZE = 16


def synthetic_batch(cls: ShapeClass, device: torch.device) -> dict:
    """unified_attention's arguments (by name) for a batch of class `cls`."""
    if cls.kind == "causal":
        reqs = [(0, CAUSAL_TOKENS)]  # (cached tokens, new tokens)
    else:
        reqs = [(MIXED_CHUNK, MIXED_CHUNK)] + [(MIXED_CHUNK - 1, 1)] * MIXED_DECODES
    dtype, kv_dtype = parse_kv_dtype_name(cls.dtype)
    gen = torch.Generator(device).manual_seed(0)
    heads = KV_HEADS * cls.group
    blocks = [-(-(c + n) // BLOCK_SIZE) for c, n in reqs]
    table = torch.zeros(len(reqs), max(blocks), dtype=torch.int32)
    first = 0
    for r, nb in enumerate(blocks):  # each request's blocks contiguous: no gather cost
        table[r, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        first += nb
    starts = [0]
    for _, n in reqs:
        starts.append(starts[-1] + n)
    cache_shape = (first, BLOCK_SIZE, KV_HEADS, cls.head_dim)
    q = torch.randn(starts[-1], heads, cls.head_dim, generator=gen, device=device).to(dtype)
    return dict(
        q=q,
        k_cache=torch.randn(cache_shape, generator=gen, device=device).to(kv_dtype),
        v_cache=torch.randn(cache_shape, generator=gen, device=device).to(kv_dtype),
        block_table=table.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c + n for c, n in reqs], dtype=torch.int32, device=device),
        scale=cls.head_dim**-0.5,
        out=torch.empty_like(q),
    )


def median_device_us(fn: Callable[[], None], iters: int = 25, warmup: int = 1,
                     before: Callable[[], object] | None = None) -> float:
    """Median µs of fn() between CUDA events, after `warmup` untimed calls (the first
    compiles); `before` runs ahead of each timed call, outside its events (an L2 flush)."""
    return median_device_us_interleaved([fn], iters, warmup, before)[0]


def median_device_us_interleaved(fns: Sequence[Callable[[], None]], iters: int = 25,
                                 warmup: int = 1, before: Callable[[], object] | None = None
                                 ) -> list[float]:
    """median_device_us of each of `fns`, their timed calls taken in turn (f0, f1, f0,
    f1, ...), so that drift (clocks, host load) falls on all of them alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    events: list[list[tuple]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, timed in zip(fns, events):
            if before is not None:
                before()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            timed.append((start, end))
    torch.cuda.synchronize()
    return [1000 * statistics.median(s.elapsed_time(e) for s, e in timed) for timed in events]
