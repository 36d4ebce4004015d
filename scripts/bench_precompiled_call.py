"""Host cost of one `CompiledModel` call on the CPU: Dynamo's compiled frame (guards,
wrappers) vs the split graph a warm start loads (llmfast/compile/precompiled.py). Same
Inductor pieces either way; the tiny random model at 1 token, no CUDA graphs, so what
differs is what runs around the pieces.

Each setting runs in a fresh process on one compile cache (the first run of each fills
it and is not reported); settings alternate; figures are the median of 15 x 100 calls.

    PYTHONPATH=$PWD python scripts/bench_precompiled_call.py [--pairs 3] [--cache DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

_CHILD = """
import statistics, time, torch
from llmfast.attention_metadata import AttentionMetadata, host_max_query_len
from llmfast.compile import CompiledModel
from tests.helpers.static_batch import StaticBatch
from tests.test_precompiled import CONFIG, one_allocation, tiny_model

model = tiny_model()
batch = StaticBatch(model, 4, 64, 64)
one_allocation(model)
cm = CompiledModel(model, CONFIG, "cpu", max_num_tokens=64)
batch.step({0: [5]}, cm)
md = AttentionMetadata(batch.slot_mapping[:1], batch.table[:1], batch.query_start_loc[:2],
                       batch.seq_lens[:1], host_max_query_len(1))
ids, pos = batch.input_ids[:1], batch.positions[:1]
times = []
with torch.inference_mode():
    for _ in range(50):
        cm(ids, pos, md)
    for _ in range(15):
        t = time.perf_counter()
        for _ in range(100):
            cm(ids, pos, md)
        times.append((time.perf_counter() - t) / 100 * 1e6)
print("precompiled" if cm.stats.precompiled else "dynamo", statistics.median(times))
"""


def _run(precompiled: bool, cache: str) -> tuple[str, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LLMFAST_CACHE": cache,
           "LLMFAST_PRECOMPILED": "1" if precompiled else "0"}
    out = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    return out[-2], float(out[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--cache", default=None, help="compile cache (default: a temporary one)")
    args = parser.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="llmfast_call_")
    for precompiled in (False, True):  # fill the caches (and the saved trace)
        _run(precompiled, cache)
    rows = []
    for _ in range(args.pairs):
        for precompiled in (False, True):
            rows.append(_run(precompiled, cache))
    for path in ("dynamo", "precompiled"):
        us = [f"{t:.0f}" for p, t in rows if p == path]
        print(f"{path:12s} µs per call: {', '.join(us)}")


if __name__ == "__main__":
    main()
