"""CUDA-graph capture sizes and the padding of a step's token count to one of them.

A graph replays a fixed shape, so a step of `n` tokens runs at the smallest captured
size `>= n` (the extra tokens are padding: slot -1, never written to the KV cache).
Steps larger than the largest size run the compiled model without graphs.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from llmfast.config import DEFAULT_CUDA_GRAPH_SIZES, ConfigError


def capture_sizes(
    max_num_tokens: int, sizes: Iterable[int] = DEFAULT_CUDA_GRAPH_SIZES
) -> tuple[int, ...]:
    """The sizes worth capturing: sorted, unique, at most `max_num_tokens` (a step never
    holds more tokens, so a larger graph would only cost memory)."""
    return tuple(sorted({s for s in sizes if 0 < s <= max_num_tokens}))


def parse_sizes(spec: str) -> tuple[int, ...]:
    """Parse a `--cuda-graph-sizes` spec: comma-separated sizes and ranges.

    "1,2,4,8" -> (1, 2, 4, 8); "1..8" -> (1, ..., 8); "8..64:8" -> (8, 16, ..., 64)
    (an optional `:step` after a range); "" or "none" -> () (no graphs).
    """
    spec = spec.strip().lower()
    if spec in ("", "none", "0"):
        return ()
    sizes: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if ".." in part:
                bounds, _, step = part.partition(":")
                lo, _, hi = bounds.partition("..")
                start, stop, stride = int(lo), int(hi), int(step) if step else 1
                if stride <= 0 or stop < start:
                    raise ValueError
                sizes.update(range(start, stop + 1, stride))
            else:
                sizes.add(int(part))
        except ValueError:
            raise ConfigError(
                f"bad cuda graph size {part!r} in {spec!r}; use e.g. '1,2,4,8', '1..64' "
                "or '8..256:8'"
            ) from None
    if any(s <= 0 for s in sizes):
        raise ConfigError(f"cuda graph sizes must be positive, got {spec!r}")
    return tuple(sorted(sizes))


def pad_num_tokens(num_tokens: int, sizes: Sequence[int]) -> int:
    """The smallest size in the sorted `sizes` that is `>= num_tokens`, else
    `num_tokens` itself (too large for any graph: it runs without one)."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else num_tokens
