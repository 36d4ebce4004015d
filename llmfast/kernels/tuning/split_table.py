"""Measured KV-split counts for decode attention, per GPU model.

`scripts/bench_kernels.py --sweep-splits FILE` times every power-of-two split count for
each decode shape (batch x context, graph-replayed) and adds the best to FILE, one table
per attention shape (heads, KV heads, head dim, dtype, block size; a second sweep of
another shape into the same file keeps the first). A copy of that file under
`llmfast/kernels/tuning/split_tables/<gpu name>.json` makes `unified_attention` use it on
that GPU for the shapes it holds; any other shape keeps the SM-count heuristic of
`select_config`.

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

    @property
    def shape(self) -> tuple[int, int, int, str, int]:
        """What a table is measured for: (heads, KV heads, head dim, dtype, block size)."""
        return (self.num_heads, self.num_kv_heads, self.head_dim, self.dtype, self.block_size)

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
    """One shape's sweep: an entry of the file's "shapes"."""
    best = {(int(r["batch"]), int(r["ctx"])): int(r["best"]) for r in data["table"]}
    if not best or any(s < 1 or s & (s - 1) for s in best.values()):
        raise ValueError("a split table needs rows with power-of-two split counts")
    return SplitTable(int(data["heads"]), int(data["kv_heads"]), int(data["head_dim"]),
                      str(data["dtype"]), int(data["block_size"]), best)


def parse_tables(data: dict) -> tuple[SplitTable, ...]:
    """The JSON `bench_kernels.py --sweep-splits` writes: {"device", "shapes": [sweep...]};
    a lone sweep (the format before several shapes shared a file) is one shape."""
    tables = tuple(parse_table(d) for d in data.get("shapes", [data]))
    if len({t.shape for t in tables}) != len(tables):
        raise ValueError("a split table file holds one table per attention shape")
    return tables


def merge_sweep(existing: dict | None, sweep: dict) -> dict:
    """`existing` (a file's JSON, or None) with `sweep` added, replacing the table of the
    same shape if there is one."""
    shape = parse_table(sweep).shape
    shapes = [] if existing is None else list(existing.get("shapes", [existing]))
    kept = [d for d in shapes if parse_table(d).shape != shape]
    merged = {k: sweep[k] for k in ("device", "torch", "num_sms") if k in sweep}
    merged["shapes"] = [*kept, sweep]
    parse_tables(merged)
    return merged


def find_table(tables: tuple[SplitTable, ...], num_heads: int, num_kv_heads: int,
               head_dim: int, dtype: str, block_size: int) -> SplitTable | None:
    shape = (num_heads, num_kv_heads, head_dim, dtype, block_size)
    return next((t for t in tables if t.shape == shape), None)


def table_path(device_name: str) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return TABLE_DIR / f"{slug}.json"


@functools.lru_cache(maxsize=8)
def split_tables_for(device_name: str) -> tuple[SplitTable, ...]:
    """The shipped tables of this GPU model; () when none was measured."""
    path = table_path(device_name)
    if not path.is_file():
        return ()
    return parse_tables(json.loads(path.read_text()))
