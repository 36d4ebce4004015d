"""CUDA-graph capture sizes and the padding of a step's token count to one of them.

A graph replays a fixed shape, so a step of `n` tokens runs at the smallest captured
size `>= n` (the extra tokens are padding: slot -1, never written to the KV cache).
Steps larger than the largest size run the compiled model without graphs.
`--cuda-graph-sizes` is read by `llmfast.utils.flag_values.parse_sizes`, like every size list.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from llmfast.config import DEFAULT_CUDA_GRAPH_SIZES


def capture_sizes(
    max_num_tokens: int, sizes: Iterable[int] = DEFAULT_CUDA_GRAPH_SIZES
) -> tuple[int, ...]:
    """The sizes worth capturing: sorted, unique, at most `max_num_tokens` (a step never
    holds more tokens, so a larger graph would only cost memory)."""
    return tuple(sorted({s for s in sizes if 0 < s <= max_num_tokens}))


def pad_num_tokens(num_tokens: int, sizes: Sequence[int]) -> int:
    """The smallest size in the sorted `sizes` that is `>= num_tokens`, else
    `num_tokens` itself (too large for any graph: it runs without one)."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else num_tokens
