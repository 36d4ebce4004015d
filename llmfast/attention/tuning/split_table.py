"""Measured KV-split counts for decode attention, per GPU model.

`scripts/bench_kernels.py --sweep-splits FILE` times the split counts of SWEEP_SPLITS for
each decode shape (batch x context, graph-replayed) and adds the best to FILE, one table
per attention shape (heads, KV heads, head dim, dtype, block size; a second sweep of
another shape into the same file keeps the first). A copy of that file under
`llmfast/attention/tuning/split_tables/<gpu name>.json` makes `unified_attention` use it on
that GPU for the shapes it holds; any other shape keeps the SM-count heuristic of
`select_config`.

A table may also name the decode launches' pipeline stages for its shape (`num_stages`,
default 3): a deeper pipeline needs more shared memory per block than every GPU has, so
it is a measured, per-GPU choice like the split counts. The sweep that wrote the table
ran at that stage count.

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

# The most KV splits a launch takes (the SM-count heuristic's cap, and the largest count
# the sweeps time).
MAX_SPLITS = 64

# The counts a sweep times: the powers of two and the 1.5x steps between them. A launch
# of `programs` (request, KV head) pairs at `s` splits puts programs x s CTAs on the
# GPU; where a power of two leaves a partial last wave (or idle SMs), the step between
# may fill it: B=8 x 8 KV heads on 132 SMs of 3 CTAs each holds 6 splits in one wave,
# not 8. The kernel takes any count: its split code compiles against a power-of-two
# bound (attention_config.split_bound).
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)

# Decode launches' pipeline stages where no table says otherwise: at BLOCK_N 128, 74 KB of
# shared memory at head dim 128 (4 stages compile to the same; 5 take 140 KB).
DEFAULT_DECODE_STAGES = 3


@dataclass(frozen=True)
class SplitTable:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "bfloat16", ...
    block_size: int
    best: dict[tuple[int, int], int]  # (batch, context) -> splits
    # Pipeline stages of this shape's decode launches (module docstring).
    num_stages: int = DEFAULT_DECODE_STAGES

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


def best_split(graph_us: dict[int, float], chosen: int, keep_within: float = 0.02) -> int:
    """A sweep row's split count: the fastest, unless the count chosen now is within
    `keep_within` of it (timing noise, at 12 counts a row, would otherwise move the table
    at every sweep). E.g. {4: 110.3, 6: 109.9, 8: 116.0}, chosen 4 -> 4; chosen 8 -> 6."""
    fastest = min(graph_us, key=graph_us.get)
    if chosen in graph_us and graph_us[chosen] <= graph_us[fastest] * (1 + keep_within):
        return chosen
    return fastest


def parse_table(data: dict) -> SplitTable:
    """One shape's sweep: an entry of the file's "shapes"."""
    best = {(int(r["batch"]), int(r["ctx"])): int(r["best"]) for r in data["table"]}
    if not best or any(not 1 <= s <= MAX_SPLITS for s in best.values()):
        raise ValueError(f"a split table needs rows with split counts from 1 to {MAX_SPLITS}")
    stages = int(data.get("num_stages", DEFAULT_DECODE_STAGES))
    if not 1 <= stages <= 8:
        raise ValueError(f"a split table's num_stages is 1 to 8, not {stages}")
    return SplitTable(int(data["heads"]), int(data["kv_heads"]), int(data["head_dim"]),
                      str(data["dtype"]), int(data["block_size"]), best, stages)


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


def merge_tables(existing: dict | None, new: dict) -> dict:
    """`existing` (a table file's JSON, or None) with every shape of `new` (another's)
    merged in: `new`'s tables replace those of their shape, the rest are kept. What a
    GPU run installs: its sweeps (often of one head dim) over the shipped file."""
    merged = existing
    for sweep in new.get("shapes", [new]):
        merged = merge_sweep(merged, sweep)
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
