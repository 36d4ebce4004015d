"""Measured KV-split counts for decode attention, per GPU model.

`scripts/bench_kernels.py --sweep-splits FILE` times every power-of-two split count for
each decode shape (batch x context, graph-replayed) and writes the best; a copy of that
file under `llmfast/kernels/tuning/split_tables/<gpu name>.json` makes `unified_attention` use
it on that GPU for the shape it was measured with (heads, KV heads, head dim, dtype,
block size); anything else keeps the SM-count heuristic of `select_config`.

Lookup: the measured row with the smallest batch >= num_reqs and context >= the block
table's width in keys (the split count is fixed by what the launch may have to read),
else the largest measured. E.g. rows at batch 1/8/64/256 x context 512/2048/8192: 3
requests over a 4096-key table -> the (8, 8192) row.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

TABLE_DIR = Path(__file__).parent / "split_tables"


@dataclass(frozen=True)
class SplitTable:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16", ...
    block_size: int
    best: dict[tuple[int, int], int]  # (batch, context) -> splits

    def matches(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: str,
                block_size: int) -> bool:
        return (self.num_heads, self.num_kv_heads, self.head_dim, self.dtype,
                self.block_size) == (num_heads, num_kv_heads, head_dim, dtype, block_size)

    def lookup(self, num_reqs: int, context: int) -> int:
        batches = sorted({b for b, _ in self.best})
        contexts = sorted({c for _, c in self.best})
        batch = next((b for b in batches if b >= num_reqs), batches[-1])
        ctx = next((c for c in contexts if c >= context), contexts[-1])
        if (batch, ctx) in self.best:
            return self.best[(batch, ctx)]
        # An incomplete grid: the nearest measured row.
        return self.best[min(self.best, key=lambda k: (abs(k[0] - batch), abs(k[1] - ctx)))]


def parse_table(data: dict) -> SplitTable:
    """The JSON `bench_kernels.py --sweep-splits` writes."""
    best = {(int(r["batch"]), int(r["ctx"])): int(r["best"]) for r in data["table"]}
    if not best or any(s < 1 or s & (s - 1) for s in best.values()):
        raise ValueError("a split table needs rows with power-of-two split counts")
    return SplitTable(int(data["heads"]), int(data["kv_heads"]), int(data["head_dim"]),
                      str(data["dtype"]), int(data["block_size"]), best)


def table_path(device_name: str) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return TABLE_DIR / f"{slug}.json"


@functools.lru_cache(maxsize=8)
def split_table_for(device_name: str) -> SplitTable | None:
    path = table_path(device_name)
    if not path.is_file():
        return None
    return parse_table(json.loads(path.read_text()))
