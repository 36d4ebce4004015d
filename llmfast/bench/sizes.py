"""Batch-size specs (`1..512`, `8..64:8`, `1,8,64`) and BenchError, the one-line
user-facing error every benchmark raises."""

from __future__ import annotations

import math
import re

# A batch of more than this many sequences is a typo, not a benchmark.
MAX_BENCH_SIZE = 65536


class BenchError(ValueError):
    """A benchmark that cannot run as asked; the message is one user-facing line."""


_RANGE = re.compile(r"^(\d+)\.\.(\d+)(?::(\d+))?$")


def parse_sizes(spec: str, limit: int = MAX_BENCH_SIZE, flag: str = "--sizes") -> list[int]:
    """Batch sizes from a spec: `1..512` doubles from 1 up to 512, `8..64:8` steps by 8,
    `1,8,64` lists; items can be mixed (`1,2,8..64:8`). Sorted, without duplicates."""
    if not spec or not spec.strip():
        raise BenchError(f"empty {flag}; use e.g. 1..512, 8..64:8 or 1,8,64")
    where = f"{flag} {spec!r}"
    sizes: set[int] = set()
    for item in (part.strip() for part in spec.split(",")):
        sizes.update(_parse_size_item(item, where))
    too_big = max(sizes)
    if too_big > limit:
        raise BenchError(f"size {too_big} in {where} is above the limit {limit}")
    return sorted(sizes)


def _parse_size_item(item: str, where: str) -> list[int]:
    if item.isdigit():
        value = int(item)
        if value < 1:
            raise BenchError(f"sizes must be >= 1, got {value} in {where}")
        return [value]
    match = _RANGE.match(item)
    if match is None:
        raise BenchError(f"cannot parse {item!r} in {where}; use e.g. 1..512, 8..64:8 or 1,8,64")
    start, stop = int(match[1]), int(match[2])
    if start < 1:
        raise BenchError(f"sizes must be >= 1, got {start} in {where}")
    if start > stop:
        raise BenchError(f"range {item!r} in {where} runs backwards ({start} > {stop})")
    if stop > MAX_BENCH_SIZE:  # checked before expanding so `1..10**12:1` stays cheap
        raise BenchError(f"size {stop} in {where} is above the limit {MAX_BENCH_SIZE}")
    if match[3] is None:  # doubling: 1..512 -> 1, 2, 4, ..., 512
        return [start << k for k in range(int(math.log2(stop / start)) + 1)]
    step = int(match[3])
    if step < 1:
        raise BenchError(f"the step in {item!r} must be >= 1")
    return list(range(start, stop + 1, step))
