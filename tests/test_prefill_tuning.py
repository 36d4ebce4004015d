"""Prefill tile tables (kernels/prefill_tuning.py): keys, on-disk cache, shipped defaults,
tuning once, forced re-tuning, corrupt files. The timing function is injected (a GPU
times real launches; here a table of made-up costs), so every path runs on CPU."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from llmfast.attention.triton import launch_config as attention_config
from llmfast.attention.tuning import prefill_tuning
from llmfast.attention.tuning.prefill_tuning import (
    CANDIDATES,
    PrefillTiles,
    PrefillTileTable,
    ShapeClass,
    shape_class,
)

GPU = "NVIDIA H100 80GB HBM3"
CLS = ShapeClass(128, 4, "bfloat16", "causal")


class Costs:
    """measure(tiles): a fixed made-up cost per candidate; counts the calls."""

    def __init__(self, best: PrefillTiles, failing: tuple[PrefillTiles, ...] = ()):
        self.best, self.failing, self.calls = best, failing, 0

    def __call__(self, tiles: PrefillTiles) -> float:
        self.calls += 1
        if tiles in self.failing:
            raise RuntimeError("out of resources: shared memory")
        return 100.0 if tiles == self.best else 200.0 + tiles.block_n


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("LLMFAST_ATTENTION_TUNING", raising=False)
    monkeypatch.setattr(prefill_tuning, "SHIPPED_DIR", tmp_path / "shipped")
    return tmp_path


def test_keys_and_paths(cache):
    assert CLS.key == "hd128-g4-bfloat16-causal"
    assert ShapeClass.from_key(CLS.key) == CLS
    assert shape_class(1, 64, 8, torch.float16) == ShapeClass(64, 8, "float16", "causal")
    assert shape_class(3, 64, 1, torch.bfloat16).kind == "mixed"
    with pytest.raises(ValueError):
        ShapeClass.from_key("hd128-g4-bfloat16")
    path = prefill_tuning.tuned_table_path(GPU)
    assert path.parent == cache / "cache" / "attention"
    assert path.name.startswith("prefill-tiles-nvidia-h100-80gb-hbm3-triton")


def test_tuned_once_then_read_from_disk_on_the_next_start(cache):
    best = CANDIDATES[5]
    costs = Costs(best)
    assert PrefillTileTable(GPU).tiles_for(CLS, True, costs) == best
    assert costs.calls == len(CANDIDATES)
    saved = json.loads(prefill_tuning.tuned_table_path(GPU).read_text())
    assert saved["tiles"][CLS.key]["timings_us"]["m128-n32-w4-s4"] == 100.0
    # The next start: the table is read, nothing is timed, even when tuning is allowed.
    again = Costs(CANDIDATES[0])
    table = PrefillTileTable(GPU)
    assert table.tiles_for(CLS, True, again) == best and again.calls == 0
    # Another class is tuned beside it; the first stays.
    other = ShapeClass(64, 8, "float16", "mixed")
    assert table.tiles_for(other, True, Costs(CANDIDATES[7])) == CANDIDATES[7]
    fresh = PrefillTileTable(GPU)
    assert fresh.lookup(CLS) == best and fresh.lookup(other) == CANDIDATES[7]


def test_no_tuning_unless_allowed(cache, monkeypatch):
    costs = Costs(CANDIDATES[1])
    assert PrefillTileTable(GPU).tiles_for(CLS, False, costs) is None  # small prefill
    monkeypatch.setenv("LLMFAST_ATTENTION_TUNING", "off")
    assert PrefillTileTable(GPU).tiles_for(CLS, True, costs) is None
    assert costs.calls == 0 and not prefill_tuning.tuned_table_path(GPU).exists()
    monkeypatch.setenv("LLMFAST_ATTENTION_TUNING", "sometimes")
    with pytest.raises(ValueError, match="LLMFAST_ATTENTION_TUNING"):
        PrefillTileTable(GPU).tiles_for(CLS, True, costs)


def test_force_retunes_once_per_process(cache, monkeypatch):
    PrefillTileTable(GPU).tiles_for(CLS, True, Costs(CANDIDATES[0]))
    monkeypatch.setenv("LLMFAST_ATTENTION_TUNING", "force")
    table = PrefillTileTable(GPU)
    costs = Costs(CANDIDATES[3])
    assert table.tiles_for(CLS, True, costs) == CANDIDATES[3]
    assert table.tiles_for(CLS, True, costs) == CANDIDATES[3]  # not twice
    assert costs.calls == len(CANDIDATES)
    assert PrefillTileTable(GPU).lookup(CLS) == CANDIDATES[3]  # saved


def test_shipped_table_first_start_and_tuned_table_wins(cache):
    shipped = prefill_tuning.shipped_table_path(GPU)
    shipped.parent.mkdir()
    shipped.write_text(json.dumps({"format": 1, "device": GPU, "tiles": {
        CLS.key: {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2}}}))
    costs = Costs(CANDIDATES[0])
    assert PrefillTileTable(GPU).tiles_for(CLS, True, costs) == PrefillTiles(64, 128, 4, 2)
    assert costs.calls == 0  # a first start needs no tuning
    prefill_tuning.write_table(prefill_tuning.tuned_table_path(GPU), GPU, CLS.key,
                               CANDIDATES[2], {})
    assert PrefillTileTable(GPU).tiles_for(CLS, True, costs) == CANDIDATES[2]


@pytest.mark.parametrize("content", [
    "{not json",
    json.dumps({"format": 99, "tiles": {}}),
    json.dumps({"format": 1, "tiles": {"hd128-g4-bfloat16-causal": {"block_m": 48,
               "block_n": 64, "num_warps": 8, "num_stages": 3}}}),  # not a power of 2
    json.dumps({"format": 1, "tiles": {"nonsense": {}}}),
    json.dumps([1, 2]),
])
def test_corrupt_table_warns_and_is_retuned(cache, caplog, content):
    path = prefill_tuning.tuned_table_path(GPU)
    path.parent.mkdir(parents=True)
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger=prefill_tuning.__name__):
        table = PrefillTileTable(GPU)
    assert "ignoring the prefill tile table" in caplog.text
    assert table.lookup(CLS) is None
    assert table.tiles_for(CLS, True, Costs(CANDIDATES[4])) == CANDIDATES[4]
    assert PrefillTileTable(GPU).lookup(CLS) == CANDIDATES[4]  # overwritten, valid again


def test_failing_candidates_are_skipped(cache, caplog):
    costs = Costs(CANDIDATES[0], failing=CANDIDATES[:3])
    best = PrefillTileTable(GPU).tiles_for(CLS, True, costs)
    assert best not in CANDIDATES[:3] and best.block_n == 32  # the cheapest that ran
    everything = Costs(CANDIDATES[0], failing=CANDIDATES)
    other = ShapeClass(64, 2, "bfloat16", "causal")
    with caplog.at_level(logging.WARNING, logger=prefill_tuning.__name__):
        table = PrefillTileTable(GPU)
        assert table.tiles_for(other, True, everything) is None  # -> the heuristic
        assert table.tiles_for(other, True, everything) is None  # and not tried again
    assert everything.calls == len(CANDIDATES)
    assert "keeping the heuristic" in caplog.text


def test_unwritable_cache_keeps_the_tuned_tiles_in_memory(cache, monkeypatch):
    blocker = cache / "file"
    blocker.write_text("")
    monkeypatch.setenv("LLMFAST_CACHE", str(blocker / "below-a-file"))
    table = PrefillTileTable(GPU)
    assert table.tiles_for(CLS, True, Costs(CANDIDATES[6])) == CANDIDATES[6]
    assert table.lookup(CLS) == CANDIDATES[6]


def test_select_config_takes_the_tiles():
    def cfg(tiles, group=4, num_tokens=2048):
        return attention_config.select_config(num_tokens, 1, 8 * group, 8, 128, 16, 128,
                                              torch.bfloat16, 132, (), tiles)

    assert cfg(PrefillTiles(64, 128, 4, 2)) == attention_config.AttentionConfig(16, 128, 1, 4, 2)
    assert cfg(PrefillTiles(128, 32, 8, 4), group=8).block_q == 16
    assert cfg(PrefillTiles(128, 32, 8, 4), group=3).block_q == 32  # group padded to 4
    heuristic = cfg(None)
    assert (heuristic.block_q * 4, heuristic.block_n) == (128, 64)
    decode = cfg(PrefillTiles(64, 32, 8, 2), num_tokens=1)  # decode: not the tiles'
    assert (decode.block_n, decode.num_warps, decode.num_stages) == (128, 4, 3)
    for tiles in CANDIDATES:
        tiles.check()
