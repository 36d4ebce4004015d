"""The measured KV-split tables: parsing and merging what bench_kernels --sweep-splits
writes (one table per attention shape in a file), the lookup rule against a naive scan,
and select_config using a table only for its own shape."""

from __future__ import annotations

import json

import pytest
import torch

from llmfast.attention.triton import launch as attention
from llmfast.attention.triton.launch_config import split_bound
from llmfast.attention.tuning import split_table
from llmfast.attention.tuning.split_table import (
    merge_sweep,
    merge_tables,
    parse_table,
    parse_tables,
    split_tables_for,
    table_path,
)

BATCHES, CONTEXTS = (1, 8, 64, 256), (512, 2048, 8192)


def _sweep_json(best, head_dim=128) -> dict:
    """One shape's sweep, as bench_kernels.py --sweep-splits makes it (graph_us trimmed)."""
    return dict(device="NVIDIA H100 80GB HBM3", torch="2.11", num_sms=132, dtype="bfloat16",
                heads=32, kv_heads=8, head_dim=head_dim, block_size=16,
                table=[dict(batch=b, ctx=c, chosen=1, best=best(b, c), graph_us={"1": 1.0})
                       for b in BATCHES for c in CONTEXTS])


def _best(batch: int, ctx: int) -> int:
    return max(1, min(32, ctx // (64 * batch)))  # some power of two per cell


def test_lookup_takes_the_next_measured_row_up():
    table = parse_table(json.loads(json.dumps(_sweep_json(_best))))
    for num_reqs in (1, 2, 3, 8, 9, 64, 100, 256, 300, 1000):
        for context in (16, 512, 513, 3000, 4096, 8192, 10_000, 131_072):
            batch = next((b for b in BATCHES if b >= num_reqs), BATCHES[-1])
            ctx = next((c for c in CONTEXTS if c >= context), CONTEXTS[-1])
            assert table.lookup(num_reqs, context) == _best(batch, ctx), (num_reqs, context)
    assert table.lookup(3, 4096) == _best(8, 8192)  # the module doc's example


def test_bad_tables_are_refused():
    for bad in (0, 65):
        with pytest.raises(ValueError, match="split counts from 1 to 64"):
            parse_table(_sweep_json(lambda b, c, bad=bad: bad))


def test_split_counts_between_the_powers_of_two():
    # A table may hold any count (the sweep times 3, 6, 12, ... too); the kernel's split
    # code compiles against the largest rounded up to a power of two (its merge's arange).
    assert set(split_table.SWEEP_SPLITS) > {1, 2, 4, 8, 16, 32, 64}
    tables = (parse_table(_sweep_json(lambda b, c: 6 if b == 8 else 3)),)
    cfg = attention.select_config(8, 8, 32, 8, 128, 16, 512, torch.bfloat16, 132, tables)
    assert cfg.num_splits == 6
    assert split_bound(32, 8, 128, 16, torch.bfloat16, 132, tables) == 8
    tables = (parse_table(_sweep_json(lambda b, c: 24 if c == 8192 else 1)),)
    assert split_bound(32, 8, 128, 16, torch.bfloat16, 132, tables) == 32


def test_a_sweep_row_keeps_its_count_unless_another_is_clearly_faster():
    timings = {1: 150.0, 2: 129.6, 3: 112.0, 4: 110.3, 6: 109.9, 8: 116.0}
    assert split_table.best_split(timings, chosen=4) == 4  # 6 is faster by 0.4 %: noise
    assert split_table.best_split(timings, chosen=8) == 6  # 8 is 5.5 % slower
    assert split_table.best_split(timings, chosen=16) == 6  # not timed: the fastest
    assert split_table.best_split({1: 10.0, 2: 9.0}, chosen=1, keep_within=0.2) == 1


def test_select_config_uses_the_table_only_for_its_shape():
    tables = (parse_table(_sweep_json(lambda b, c: 2 if b == 1 else 1)),)

    def cfg(num_reqs, heads=32, kv_heads=8, dtype=torch.bfloat16, width=512):
        return attention.select_config(num_reqs, num_reqs, heads, kv_heads, 128, 16, width,
                                       dtype, 132, tables)

    assert cfg(1).num_splits == 2  # the heuristic would pick 16 at batch 1, 8k keys
    assert attention.select_config(1, 1, 32, 8, 128, 16, 512, torch.bfloat16, 132).num_splits > 2
    assert cfg(8).num_splits == 1
    # Another shape or dtype than measured: the heuristic's choice.
    for heads, dtype in ((16, torch.bfloat16), (32, torch.float16)):
        assert cfg(1, heads=heads, dtype=dtype).num_splits == attention.select_config(
            1, 1, heads, 8, 128, 16, 512, dtype, 132).num_splits > 2
    # Prefill never splits, table or not.
    assert attention.select_config(2048, 1, 32, 8, 128, 16, 512, torch.bfloat16, 132,
                                   tables).num_splits == 1


def test_a_second_sweep_adds_its_shape_and_replaces_its_own():
    hd128 = merge_sweep(None, _sweep_json(lambda b, c: 4))
    both = merge_sweep(hd128, _sweep_json(lambda b, c: 8, head_dim=64))
    assert both["device"] == "NVIDIA H100 80GB HBM3" and len(both["shapes"]) == 2
    again = merge_sweep(json.loads(json.dumps(both)), _sweep_json(lambda b, c: 2))
    tables = parse_tables(again)
    assert sorted((t.head_dim, t.lookup(1, 512)) for t in tables) == [(64, 8), (128, 2)]
    # A lone sweep (the older file format) reads as one shape, and merges as one.
    assert [t.head_dim for t in parse_tables(_sweep_json(_best))] == [128]
    assert len(merge_sweep(_sweep_json(_best), _sweep_json(_best, head_dim=64))["shapes"]) == 2
    with pytest.raises(ValueError, match="one table per attention shape"):
        parse_tables({"shapes": [_sweep_json(_best), _sweep_json(_best)]})


def test_select_config_picks_the_table_of_its_head_dim():
    tables = parse_tables(merge_sweep(merge_sweep(None, _sweep_json(lambda b, c: 4)),
                                      _sweep_json(lambda b, c: 16, head_dim=64)))
    for hd, splits in ((128, 4), (64, 16)):
        assert attention.select_config(1, 1, 32, 8, hd, 16, 512, torch.bfloat16, 132,
                                       tables).num_splits == splits
    heuristic = attention.select_config(1, 1, 32, 8, 96, 16, 512, torch.bfloat16, 132)
    assert attention.select_config(1, 1, 32, 8, 96, 16, 512, torch.bfloat16, 132,
                                   tables).num_splits == heuristic.num_splits


def test_tables_are_found_by_gpu_name(tmp_path, monkeypatch):
    assert table_path("NVIDIA H100 80GB HBM3").name == "nvidia-h100-80gb-hbm3.json"
    assert split_tables_for("no such GPU") == ()
    monkeypatch.setattr(split_table, "TABLE_DIR", tmp_path)
    split_tables_for.cache_clear()
    try:
        both = merge_sweep(merge_sweep(None, _sweep_json(_best)), _sweep_json(_best, 64))
        (tmp_path / "test-gpu.json").write_text(json.dumps(both))
        assert sorted(t.head_dim for t in split_tables_for("Test GPU")) == [64, 128]
    finally:
        split_tables_for.cache_clear()


def test_a_launch_takes_its_split_count_as_is_under_a_power_of_two_bound():
    # The plan of a decode launch at 6 splits: 6 along the grid's split axis (no CTA
    # of a rounded-up count idles), the split code compiled for 8; the second merge
    # kernel's launch (fused_merge=False) spans a power of two: 8.
    q = torch.zeros(8, 32, 128, dtype=torch.bfloat16)
    k_cache = torch.zeros(64, 16, 8, 128, dtype=torch.bfloat16)
    table = torch.zeros(8, 512, dtype=torch.int32)
    for fused, grid_splits in ((True, 6), (False, 8)):
        plan = attention._plan(q, k_cache, k_cache, table, q, 8, 6, None, fused, None,
                               uniform_decode=True)
        assert plan.grid[2] == grid_splits and plan.split_counts[0] == grid_splits
        assert plan.constexprs["SPLIT_BOUND"] == 8
        assert plan.partials_shape[0] == grid_splits


def test_installing_a_sweep_keeps_the_shipped_tables_of_other_head_dims():
    # A session's `kernels` step sweeps head dim 128 only: installed over a shipped file
    # holding 64 and 128, it replaces 128 and keeps 64 (the 1B default's).
    shipped = merge_sweep(merge_sweep(None, _sweep_json(lambda b, c: 4)),
                          _sweep_json(lambda b, c: 16, head_dim=64))
    session = merge_sweep(None, _sweep_json(lambda b, c: 6))
    tables = {t.head_dim: t for t in parse_tables(merge_tables(shipped, session))}
    assert sorted(tables) == [64, 128]
    assert tables[128].lookup(8, 8192) == 6 and tables[64].lookup(8, 8192) == 16
    assert parse_tables(merge_tables(None, session))[0].lookup(1, 512) == 6


def test_a_table_names_its_shape_s_decode_stages():
    # Default 3 (what every GPU's shared memory holds); a table measured with a deeper
    # pipeline says so, and its shape's decode launches (not its prefills, nor other
    # shapes') take it. The H100's head-dim-128 table names 5 (its shipped file).
    plain = parse_table(_sweep_json(_best))
    assert plain.num_stages == split_table.DEFAULT_DECODE_STAGES == 3
    deep = parse_table(dict(_sweep_json(_best), num_stages=5))
    assert deep.num_stages == 5
    for bad in (0, 9):
        with pytest.raises(ValueError, match="num_stages"):
            parse_table(dict(_sweep_json(_best), num_stages=bad))
    decode = attention.select_config(8, 8, 32, 8, 128, 16, 512, torch.bfloat16, 132, (deep,))
    assert decode.num_stages == 5 and decode.num_splits == _best(8, 8192)
    assert attention.select_config(8, 8, 32, 8, 64, 16, 512, torch.bfloat16, 132,
                                   (deep,)).num_stages == 3  # another head dim
    assert attention.select_config(512, 1, 32, 8, 128, 16, 512, torch.bfloat16, 132,
                                   (deep,)) == attention.select_config(
        512, 1, 32, 8, 128, 16, 512, torch.bfloat16, 132, (plain,))  # a prefill: its tiles
    # Merging a sweep keeps the stage count it ran at.
    merged = parse_tables(merge_tables(None, dict(_sweep_json(_best), num_stages=5)))
    assert merged[0].num_stages == 5
    shipped = {t.head_dim: t.num_stages for t in split_tables_for("NVIDIA H100 80GB HBM3")}
    assert shipped[128] == 5 and shipped[64] == 3
