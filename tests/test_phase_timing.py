"""PhaseTimer's interval arithmetic (the CUDA-event side runs in tests/test_async_gpu.py)."""

from __future__ import annotations

import itertools
import random

from llmfast.profiling.phase_timing import PhaseTimer, _intersection, _merge, phases_markdown


def test_overlap_of_host_intervals_with_device_busy_intervals_matches_a_naive_count():
    rng = random.Random(0)
    for _ in range(200):
        busy = [(a, a + rng.randrange(1, 20)) for a in (rng.randrange(0, 100) for _ in range(6))]
        merged = _merge([(float(a), float(b)) for a, b in busy])
        assert all(b < c for (_, b), (c, _) in itertools.pairwise(merged))  # disjoint, sorted
        start = rng.randrange(0, 110)
        end = start + rng.randrange(0, 30)
        # Naive: unit cells [t, t + 1) inside both the host interval and some busy one.
        naive = sum(1 for t in range(start, end) if any(a <= t < b for a, b in busy))
        assert _intersection(float(start), float(end), merged) == naive


def test_cpu_timer_counts_host_time_per_phase_and_leaves_device_columns_empty():
    timer = PhaseTimer("cpu")
    for name in ("schedule", "forward[8]", "forward[16]", "schedule"):
        timer.end(timer.begin(name))
    stats = timer.summary()
    assert list(stats) == ["schedule", "forward"]
    assert stats["forward"].calls == 2 and stats["schedule"].calls == 2
    assert stats["forward"].device_ms is None and stats["forward"].overlap_ms is None
    assert "| `forward` | 2 |" in phases_markdown(stats)
