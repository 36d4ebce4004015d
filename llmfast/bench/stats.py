"""Order statistics of a metric: Summary and summarize (mean, median, p90, p99)."""

from __future__ import annotations

from collections.abc import Sequence
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
