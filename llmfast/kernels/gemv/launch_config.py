"""Which kernel a skinny projection takes, and its launch configuration: per GPU model,
from a shipped table (`tables/<gpu name slug>.json`, as the MoE tiles and attention
splits are), else from what the start-up measured on this GPU (worker/startup/gemv_tuning.py), else
a heuristic.

A table holds per weight shape `n{N}-k{K}-{weight dtype}[-{fusion}]` and per M bucket
(1, 2, 4, 8, 16: a launch of M rows takes the smallest bucket >= M) the faster of
cuBLAS (`F.linear`, or `_scaled_mm` for fp8) and the best Triton configuration,
measured. E.g. {"n3072-k2048-bfloat16": {"1": {"backend": "triton", "block_n": 16, ...},
"16": {"backend": "cublas"}}}: a 3-row launch takes the 4 bucket, absent here, so the
next bucket up that is present (16: cuBLAS).

The backend (`--gemv`, config.SkinnyLinearConfig, passed to the op by each layer):
- `auto`: the table's choice (shipped, else measured at start-up); no entry: cuBLAS;
- `triton`: every launch of at most MAX_GEMV_ROWS rows, the table's Triton config or
  the heuristic's (what the GPU check compares against cuBLAS);
- `cublas`: never.
More than MAX_GEMV_ROWS rows always keep cuBLAS (batch 64-512 are GEMMs it does well).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path

from llmfast.kernels.launch.device_tables import device_slug, read_shipped_table

__all__ = ["device_slug"]  # (the tables' file names: scripts/bench_gemv.py)

TABLE_DIR = Path(__file__).parent / "tables"
FORMAT_VERSION = 1
MAX_GEMV_ROWS = 16
M_BUCKETS = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class GemvConfig:
    """One launch: BLOCK_N output columns per program, BLOCK_K per loop step, K in
    `split_k` ranges (1: no reduce kernel); `dot`: tl.dot (BLOCK_M >= 16)."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = False

    def check(self) -> GemvConfig:
        for name in ("block_n", "block_k", "split_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")
        if self.dot and min(self.block_n, self.block_k) < 16:
            raise ValueError("tl.dot wants block_n and block_k >= 16")
        return self


@dataclass(frozen=True)
class Choice:
    """A launch's kernel: `config` None means cuBLAS."""

    config: GemvConfig | None
    source: str  # "table", "heuristic", "rows" (more than MAX_GEMV_ROWS), "off"


# Every program runs in Python under the interpreter: few, small ones.
INTERPRETER_CONFIG = GemvConfig(block_n=16, block_k=32, split_k=1, num_warps=1, num_stages=1)


def m_bucket(rows: int) -> int:
    """The bucket a launch of `rows` rows (1..MAX_GEMV_ROWS) takes: 3 -> 4, 9 -> 16."""
    return next(b for b in M_BUCKETS if b >= rows)


def shape_key(n: int, k: int, weight_dtype: str, fusion: str = "") -> str:
    """Llama-3.2-1B's qkv in bf16 with the norm fused -> "n3072-k2048-bfloat16-norm"."""
    return f"n{n}-k{k}-{weight_dtype}" + (f"-{fusion}" if fusion else "")


def heuristic_config(rows: int, n: int, k: int, num_sms: int, fp8: bool = False) -> GemvConfig:
    """Few columns per program, so N/BLOCK_N programs already cover the SMs at 2048
    columns; K split (powers of two, each range at least 4 steps of BLOCK_K) until there
    are ~4 programs per SM to keep loads in flight. 16 rows take tl.dot (the broadcast
    product's registers grow with the rows); fp8 tiles read twice the columns per byte.
    Llama-3.2-1B's down_proj at batch 1 on 132 SMs: 128 column tiles x split 8 (K
    ranges of 1024: 32 KiB of weight a program)."""
    dot = m_bucket(rows) >= 16
    block_n = 32 if dot else 16
    block_k = (128 if dot else 256 if rows <= 2 else 128) * (2 if fp8 else 1)
    tiles = -(-n // block_n)
    split_k = 1
    while tiles * split_k < 4 * num_sms and k // (2 * split_k) >= 4 * block_k:
        split_k *= 2
    return GemvConfig(block_n, block_k, split_k, num_warps=4, num_stages=3, dot=dot).check()


def tuning_candidates(rows: int, n: int, k: int, num_sms: int,
                      fp8: bool = False) -> list[GemvConfig]:
    """What `scripts/bench_gemv.py --tune` times for a launch: the heuristic's config
    and its neighbours (column tiles, K steps, splits up to where a range is one K
    step), at most 25, all valid."""
    base = heuristic_config(rows, n, k, num_sms, fp8)
    dot = base.dot
    block_ns = (32, 64) if dot else (16, 32)
    block_ks = (64, 128) if dot else (128, 256, 512) if rows <= 2 else (64, 128, 256)
    out = {base}
    for block_n in block_ns:
        for block_k in block_ks:
            for split_k in (1, 2, 4, 8):
                if split_k > 1 and k // split_k < block_k:
                    continue
                warps = 8 if block_n * block_k * max(rows, 1) >= 1 << 16 else 4
                out.add(GemvConfig(block_n, block_k, split_k, warps, 3, dot))
    return sorted(out, key=lambda c: (c != base, c.block_n, c.block_k, c.split_k))


# Triton configurations a start-up times per shape and bucket besides cuBLAS: each is a
# compile (about a second; unmeasured on a GPU), so a handful, not the tuning's 25.
STARTUP_CANDIDATES = 4


def startup_candidates(rows: int, n: int, k: int, num_sms: int, fp8: bool = False,
                       limit: int = STARTUP_CANDIDATES) -> list[GemvConfig]:
    """The heuristic's config and its nearest neighbours among `tuning_candidates`
    (fewest doublings or halvings of columns, K step and split away)."""
    base = heuristic_config(rows, n, k, num_sms, fp8)

    def distance(c: GemvConfig) -> int:
        return sum(abs(getattr(c, f).bit_length() - getattr(base, f).bit_length())
                   for f in ("block_n", "block_k", "split_k")) + (c.num_warps != base.num_warps)

    return sorted(tuning_candidates(rows, n, k, num_sms, fp8), key=distance)[:limit]


def parse_row(row: dict) -> GemvConfig | None:
    if row.get("backend") == "cublas":
        return None
    if row.get("backend") != "triton":
        raise ValueError(f"unknown backend {row.get('backend')!r}")
    return GemvConfig(**{k: v for k, v in row.items()
                         if k in GemvConfig.__dataclass_fields__}).check()


def parse_table(data: dict) -> dict[str, dict[int, GemvConfig | None]]:
    if data.get("format") != FORMAT_VERSION:
        raise ValueError(f"unknown format {data.get('format')!r}")
    table = {}
    for key, rows in data["shapes"].items():
        buckets = {int(m): parse_row(row) for m, row in rows.items()}
        if not set(buckets) <= set(M_BUCKETS):
            raise ValueError(f"{key}: M buckets must be among {M_BUCKETS}")
        table[key] = buckets
    return table


@functools.cache
def shipped_table(device_name: str) -> dict[str, dict[int, GemvConfig | None]]:
    """This GPU model's shipped table ({} if none; a bad one is logged and ignored)."""
    return read_shipped_table(TABLE_DIR, device_name, parse_table, "GEMV table") or {}


# What start-up measurements chose in this process, per GPU model (worker/startup/gemv_tuning.py
# fills it before any CUDA graph is captured; shipped entries take precedence).
_MEASURED: dict[str, dict[str, dict[int, GemvConfig | None]]] = {}


def add_measured(device_name: str, table: dict[str, dict[int, GemvConfig | None]]) -> None:
    _MEASURED.setdefault(device_name, {}).update(table)


def launch_table(device_name: str) -> dict[str, dict[int, GemvConfig | None]]:
    """The entries launches read: the shipped table's shapes, the measured ones besides."""
    return {**_MEASURED.get(device_name, {}), **shipped_table(device_name)}


def table_entry(rows: dict[int, GemvConfig | None], bucket: int) -> tuple[bool, GemvConfig | None]:
    """(found, config) for `bucket`: the smallest measured bucket >= it (a larger M
    streams the same weight with more work per byte), else not found."""
    above = [b for b in sorted(rows) if b >= bucket]
    return (True, rows[above[0]]) if above else (False, None)


def takes_triton(device_name: str, key: str) -> bool:
    """Whether the table has the Triton GEMV win any bucket of the weight `key`: a layer
    that never would keeps its plain `F.linear` (under --gemv auto)."""
    return any(c is not None for c in launch_table(device_name).get(key, {}).values())


def choose(rows: int, n: int, k: int, key: str, device_name: str | None, num_sms: int,
           backend: str, fp8: bool = False) -> Choice:
    """The kernel of a launch of `rows` rows on the weight `key` ([n, k]) under
    `backend` (--gemv); device_name None: the interpreter (its config, unless cublas)."""
    if backend == "cublas":
        return Choice(None, "off")
    if rows > MAX_GEMV_ROWS:
        return Choice(None, "rows")
    if device_name is None:
        return Choice(INTERPRETER_CONFIG, "interpreter")
    found, config = table_entry(launch_table(device_name).get(key, {}), m_bucket(rows))
    if backend == "triton" and config is None:
        return Choice(heuristic_config(rows, n, k, num_sms, fp8), "heuristic")
    if found:
        return Choice(config, "table")
    return Choice(None, "no table entry")


def table_json(device_name: str,
               shapes: dict[str, dict[int, tuple[GemvConfig | None, dict]]]) -> dict:
    """A table as written to tables/: per shape, per M bucket, the winner and the
    timings (microseconds) of every candidate that chose it."""
    def row(config: GemvConfig | None, timings: dict) -> dict:
        head = {"backend": "cublas"} if config is None else {"backend": "triton",
                                                              **asdict(config)}
        return {**head, "timings_us": timings}

    return {"format": FORMAT_VERSION, "device": device_name,
            "shapes": {key: {str(m): row(*rows[m]) for m in sorted(rows)}
                       for key, rows in shapes.items()}}
