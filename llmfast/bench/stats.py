"""Order statistics of a metric: Summary and summarize (mean, median, p90, p99), and
median_call_ms, the median wall-clock time of a call (the benchmark scripts' timer)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Summary:
    """Order statistics of one metric (same unit as the input, usually seconds)."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float
    min: float
    max: float


def summarize(values: Sequence[float]) -> Summary | None:
    """Mean and percentiles (numpy's linear interpolation, as vLLM's bench); None if empty."""
    if len(values) == 0:
        return None
    arr = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return Summary(len(arr), float(arr.mean()), float(p50), float(p90), float(p99),
                   float(arr.min()), float(arr.max()))


def median_call_ms(fn: Callable[[], object], iters: int, warmup: int = 1) -> float:
    """Median wall-clock milliseconds of `iters` calls of `fn`, after `warmup` untimed
    ones (host time: a call that only launches device work is timed up to its return)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
