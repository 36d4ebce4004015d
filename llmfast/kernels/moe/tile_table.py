"""The fused MoE kernels' tiles per GPU model and shape, shipped as tables (as the
attention's prefill tiles and split counts are: llmfast/attention/tuning/).

A table (`tile_tables/<gpu name slug>.json`, written by `scripts/bench_moe.py --tune`)
holds, per layer shape `e{experts}-k{top_k}-h{hidden}-i{intermediate per rank}-{dtype}`,
the fastest tiles measured at a few token counts. A launch of T tokens takes the row of
the smallest measured count >= T (else the largest): a decode step and a long prefill
want different tiles (at batch 1 each expert sees one row: small BLOCK_M, the weights
streamed with wide tiles; at 512 tokens x 8 of 128 experts each sees ~32 rows: a
compute-shaped tile). A shape or GPU without a table gets `heuristic_tiles`; the
interpreter always takes small tiles (every program runs in Python there).

E.g. a table with rows 1, 16, 64, 512: T = 40 -> the 64 row; T = 2048 -> the 512 row.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path

from llmfast.kernels.launch.device_tables import read_shipped_table

TABLE_DIR = Path(__file__).parent / "tile_tables"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class MoeTiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def check(self) -> MoeTiles:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        return self


INTERPRETER_TILES = MoeTiles(16, 32, 32, group_m=1, num_warps=1, num_stages=1)


def shape_key(num_experts: int, top_k: int, hidden: int, inter: int, dtype: str) -> str:
    """E.g. Qwen3-30B-A3B's layer in bf16 -> "e128-k8-h2048-i768-bfloat16"."""
    return f"e{num_experts}-k{top_k}-h{hidden}-i{inter}-{dtype}"


def heuristic_tiles(num_tokens: int, num_experts: int, top_k: int) -> MoeTiles:
    """Tiles by the rows an expert sees on average: few rows are a weight stream (BLOCK_M
    at tl.dot's minimum, wide K steps), many a GEMM."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= 16:
        return MoeTiles(16, 64, 128, group_m=1, num_warps=4, num_stages=4)
    if rows_per_expert <= 64:
        return MoeTiles(32, 64, 64, group_m=8, num_warps=4, num_stages=4)
    return MoeTiles(64, 128, 64, group_m=8, num_warps=8, num_stages=3)


def parse_table(data: dict) -> dict[str, dict[int, MoeTiles]]:
    if data.get("format") != FORMAT_VERSION:
        raise ValueError(f"unknown format {data.get('format')!r}")
    return {key: {int(tokens): MoeTiles(**{k: v for k, v in tiles.items()
                                           if k in MoeTiles.__dataclass_fields__}).check()
                  for tokens, tiles in rows.items()}
            for key, rows in data["shapes"].items()}


@functools.cache
def shipped_table(device_name: str) -> dict[str, dict[int, MoeTiles]]:
    """This GPU model's shipped table ({} if none; a bad one is logged and ignored)."""
    return read_shipped_table(TABLE_DIR, device_name, parse_table, "MoE tile table") or {}


def lookup(rows: dict[int, MoeTiles], num_tokens: int) -> MoeTiles:
    counts = sorted(rows)
    return rows[next((c for c in counts if c >= num_tokens), counts[-1])]


def tiles_for(device_name: str | None, key: str, num_tokens: int, num_experts: int,
              top_k: int) -> MoeTiles:
    """The tiles of a launch: the interpreter's (device None), the shipped table's row,
    else the heuristic."""
    if device_name is None:
        return INTERPRETER_TILES
    rows = shipped_table(device_name).get(key)
    if rows:
        return lookup(rows, num_tokens)
    return heuristic_tiles(num_tokens, num_experts, top_k)


def table_json(device_name: str, shapes: dict[str, dict[int, tuple[MoeTiles, dict]]]) -> dict:
    """A table as written to tile_tables/: per shape, per token count, the tiles and the
    timings of every candidate (microseconds) that chose them."""
    return {"format": FORMAT_VERSION, "device": device_name,
            "shapes": {key: {str(t): {**asdict(tiles), "timings_us": timings}
                             for t, (tiles, timings) in sorted(rows.items())}
                       for key, rows in shapes.items()}}
