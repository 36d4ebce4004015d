"""Prefill tile configurations per GPU model: tuned once, kept on disk, shipped defaults.

A prefill-like launch of the unified attention kernel (more than ~2 query tokens per
request) is compute bound, and its speed depends on the tile shape: rows per tile
(BLOCK_M = query tokens x padded GQA group), keys per inner step (BLOCK_N), warps and
software-pipeline stages. The best choice depends on the GPU model and on the *shape
class*: head dim, GQA group size, dtype, and whether the batch is one causal prefill or a
mixed batch (several requests: chunks over cached prefixes plus decodes).

Where a launch's tiles come from, first hit wins (`PrefillTileTable.tiles_for`):
1. this machine's tuned table, `<cache dir>/attention/prefill-tiles-<gpu>-triton<ver>.json`
   (llmfast/utils/paths.py's cache dir; a new Triton version tunes afresh);
2. the table shipped for this GPU model, `llmfast/attention/tuning/prefill_tables/<gpu>.json`
   (the same format; a copy of a tuned table), so a first start needs no tuning;
3. tuning, when allowed (see `tuning_mode`): every candidate of `CANDIDATES` timed on a
   synthetic batch of the class, the fastest written to table 1;
4. the fixed heuristic of `heuristic_tiles` (CPU, the interpreter, and anything else).

`LLMFAST_ATTENTION_TUNING`: `auto` (default) tunes a class missing from tables 1-2 the
first time a large prefill (>= TUNE_MIN_TOKENS tokens) of it runs, outside CUDA-graph
capture; `force` re-tunes every class once per process, ignoring both tables; `off`
never tunes. A corrupt or unreadable table is logged and ignored (and overwritten by the
next tuning), never an error.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

from llmfast.kernels.launch.device_tables import device_slug
from llmfast.utils.paths import cache_dir

logger = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).parent / "prefill_tables"
TUNE_MIN_TOKENS = 1024
TUNING_MODES = ("auto", "off", "force")
FORMAT_VERSION = 1


@dataclass(frozen=True)
class ShapeClass:
    head_dim: int
    group: int  # query heads per KV head
    dtype: str  # "bfloat16", ...; "bfloat16kvfp8" with an fp8 cache (kv_dtype_name)
    kind: str  # "causal": one request; "mixed": several (chunks and decodes)

    @property
    def key(self) -> str:
        """E.g. ShapeClass(128, 4, "bfloat16", "causal") -> "hd128-g4-bfloat16-causal"."""
        return f"hd{self.head_dim}-g{self.group}-{self.dtype}-{self.kind}"

    @staticmethod
    def from_key(key: str) -> ShapeClass:
        m = re.fullmatch(r"hd(\d+)-g(\d+)-([a-z0-9]+)-(causal|mixed)", key)
        if m is None:
            raise ValueError(f"not a prefill shape class: {key!r}")
        return ShapeClass(int(m[1]), int(m[2]), m[3], m[4])


# Cache dtypes other than q's, by their short name in table keys (--kv-cache-dtype).
_KV_DTYPES = {"fp8": torch.float8_e4m3fn}


def kv_dtype_name(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> str:
    """The (q, KV cache) dtypes as one table-key name: "bfloat16" for a cache in q's
    dtype, "bfloat16kvfp8" for a float8_e4m3fn one. Tiles and split counts tuned for a
    bf16 cache need not suit one of half the bytes: an fp8 cache gets its own entries."""
    name = str(dtype).removeprefix("torch.")
    if kv_dtype is None or kv_dtype == dtype:
        return name
    short = next((k for k, v in _KV_DTYPES.items() if v == kv_dtype), None)
    if short is None:
        raise ValueError(f"no table name for a {kv_dtype} KV cache under {dtype} queries")
    return f"{name}kv{short}"


def parse_kv_dtype_name(name: str) -> tuple[torch.dtype, torch.dtype]:
    """kv_dtype_name's inverse: "bfloat16kvfp8" -> (torch.bfloat16, torch.float8_e4m3fn)."""
    q_name, _, short = name.partition("kv")
    q_dtype = getattr(torch, q_name)
    return q_dtype, _KV_DTYPES[short] if short else q_dtype


def shape_class(num_reqs: int, head_dim: int, group: int, dtype: torch.dtype,
                kv_dtype: torch.dtype | None = None) -> ShapeClass:
    kind = "causal" if num_reqs == 1 else "mixed"
    return ShapeClass(head_dim, group, kv_dtype_name(dtype, kv_dtype), kind)


@dataclass(frozen=True)
class PrefillTiles:
    block_m: int  # rows per tile: query tokens x next_pow2(group)
    block_n: int  # keys per inner-loop step
    num_warps: int
    num_stages: int

    def check(self) -> PrefillTiles:
        for name, value in asdict(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, not {value!r}")
        for name in ("block_m", "block_n", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"{name} must be a power of two, not {value}")
        if self.block_m < 16 or self.block_n < 16 or self.num_stages > 8 or self.num_warps > 16:
            raise ValueError(f"tiles out of range: {self}")
        return self


# The search space, bounded so one class tunes in well under a minute on an H100 (each
# candidate is one compile, ~1-3 s, plus ~25 timed launches of a few hundred µs): the
# wgmma-sized 64/128-row tiles with 32-128 keys, 4 or 8 warps, 2-4 stages. 256-row tiles
# spill the fp32 accumulator at head dim 128; fewer than 4 warps starve the tensor cores.
CANDIDATES: tuple[PrefillTiles, ...] = (
    PrefillTiles(128, 64, 8, 3),
    PrefillTiles(128, 64, 8, 2),
    PrefillTiles(128, 64, 4, 3),
    PrefillTiles(128, 128, 8, 2),
    PrefillTiles(128, 128, 8, 3),
    PrefillTiles(128, 32, 4, 4),
    PrefillTiles(128, 32, 8, 3),
    PrefillTiles(64, 64, 4, 3),
    PrefillTiles(64, 128, 4, 2),
    PrefillTiles(64, 64, 4, 4),
)


def heuristic_tiles(head_dim: int, dtype: torch.dtype) -> PrefillTiles:
    """The untuned choice. fp32 (ieee dots run on FMA units) or head_dim > 128: 32 x 16
    tiles and 8 warps keep ptxas free of spills on sm_90 (checked offline). Else 128 rows
    x 64 keys (wgmma-sized on Hopper)."""
    if dtype == torch.float32 or head_dim > 128:
        return PrefillTiles(32, 16, 8, 2)
    return PrefillTiles(128, 64, 8 if head_dim > 64 else 4, 3)


def tuning_mode() -> str:
    mode = os.environ.get("LLMFAST_ATTENTION_TUNING", "") or "auto"
    if mode not in TUNING_MODES:
        raise ValueError(f"LLMFAST_ATTENTION_TUNING must be one of {', '.join(TUNING_MODES)}, "
                         f"not {mode!r}")
    return mode


def tuned_table_path(device_name: str) -> Path:
    return (cache_dir() / "attention"
            / f"prefill-tiles-{device_slug(device_name)}-triton{triton.__version__}.json")


def shipped_table_path(device_name: str) -> Path:
    return SHIPPED_DIR / f"{device_slug(device_name)}.json"


def parse_tiles(data: dict) -> dict[str, PrefillTiles]:
    """The table format: {"format": 1, "device": ..., "tiles": {class key: {block_m,
    block_n, num_warps, num_stages, ...}}}; extra fields (timings) are kept out."""
    if not isinstance(data, dict) or data.get("format") != FORMAT_VERSION:
        raise ValueError(f"not a format-{FORMAT_VERSION} prefill tile table")
    tiles = {}
    for key, entry in data["tiles"].items():
        ShapeClass.from_key(key)
        tiles[key] = PrefillTiles(*(entry[f] for f in ("block_m", "block_n", "num_warps",
                                                           "num_stages"))).check()
    return tiles


def read_table(path: Path) -> tuple[dict[str, PrefillTiles], dict]:
    """(tiles, raw JSON) of a table file; ({}, {}) when it is missing, and when it is
    corrupt too (logged: the caller goes on with the next source)."""
    if not path.is_file():
        return {}, {}
    try:
        data = json.loads(path.read_text())
        return parse_tiles(data), data
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning("ignoring the prefill tile table %s (%s: %s)", path,
                       type(exc).__name__, exc)
        return {}, {}


def write_table(path: Path, device_name: str, key: str, tiles: PrefillTiles,
                timings_us: dict[str, float]) -> None:
    """Add (or replace) one class in the table at `path`, atomically: re-read first (another
    process may have tuned another class since), write a temporary file, rename."""
    _, data = read_table(path)
    entries = data.get("tiles", {}) if data else {}
    entries[key] = {**asdict(tiles), "timings_us": timings_us}
    out = dict(format=FORMAT_VERSION, device=device_name, triton=triton.__version__,
               torch=torch.__version__, tiles=entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(out, indent=2, sort_keys=True))
    os.replace(tmp, path)


def candidate_name(tiles: PrefillTiles) -> str:
    return f"m{tiles.block_m}-n{tiles.block_n}-w{tiles.num_warps}-s{tiles.num_stages}"


def pick_fastest(candidates: tuple[PrefillTiles, ...],
                 measure: Callable[[PrefillTiles], float]) -> tuple[PrefillTiles | None,
                                                                     dict[str, float]]:
    """(fastest candidate, µs per candidate name). A candidate whose compile or launch
    fails (out of shared memory, registers) is left out; None if all fail."""
    timings: dict[str, float] = {}
    best, best_us = None, float("inf")
    for tiles in candidates:
        try:
            us = float(measure(tiles))
        except Exception as exc:  # noqa: BLE001 - Triton's OutOfResources, compile errors
            logger.info("prefill tiles %s failed: %s", candidate_name(tiles), exc)
            continue
        timings[candidate_name(tiles)] = us
        if us < best_us:
            best, best_us = tiles, us
    return best, timings


class PrefillTileTable:
    """The tile sources of one GPU model, read once; see the module docstring."""

    def __init__(self, device_name: str, tuned_path: Path | None = None,
                 shipped_path: Path | None = None):
        self.device_name = device_name
        self.tuned_path = tuned_path or tuned_table_path(device_name)
        self.tuned, _ = read_table(self.tuned_path)
        self.shipped, _ = read_table(shipped_path or shipped_table_path(device_name))
        self.tuned_here: set[str] = set()  # classes this process tuned (`force` once each)
        self.tunings = 0

    def lookup(self, cls: ShapeClass) -> PrefillTiles | None:
        return self.tuned.get(cls.key) or self.shipped.get(cls.key)

    def tiles_for(self, cls: ShapeClass, may_tune: bool,
                  measure: Callable[[PrefillTiles], float] | None) -> PrefillTiles | None:
        """The tiles for `cls`, tuning first when the mode asks and `may_tune` (a large
        prefill outside graph capture, with `measure` timing one candidate); None: use
        the heuristic."""
        mode = tuning_mode()
        forced = mode == "force" and cls.key not in self.tuned_here
        found = None if forced else self.lookup(cls)
        if found is not None or mode == "off" or not may_tune or measure is None:
            return found
        if cls.key in self.tuned_here:  # tuned here already and every candidate failed
            return None
        return self.tune(cls, measure)

    def tune(self, cls: ShapeClass, measure: Callable[[PrefillTiles], float]
             ) -> PrefillTiles | None:
        self.tuned_here.add(cls.key)
        self.tunings += 1
        logger.info("tuning prefill attention tiles for %s on %s (%d candidates)", cls.key,
                    self.device_name, len(CANDIDATES))
        best, timings = pick_fastest(CANDIDATES, measure)
        if best is None:
            logger.warning("no prefill tile candidate ran for %s: keeping the heuristic",
                           cls.key)
            return None
        self.tuned[cls.key] = best
        try:
            write_table(self.tuned_path, self.device_name, cls.key, best, timings)
        except OSError as exc:  # a read-only cache dir: tuned for this process only
            logger.warning("could not save the prefill tile table %s: %s", self.tuned_path,
                           exc)
        logger.info("prefill tiles for %s: %s (%s)", cls.key, candidate_name(best),
                    ", ".join(f"{k} {v:.0f} us" for k, v in timings.items()))
        return best
