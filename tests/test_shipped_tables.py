"""The measured tables that ship in the package (attention/tuning/split_tables/*.json and
prefill_tables/*.json): every file parses, is named for the GPU it was measured on (the
slug the runtime looks up), and the head shapes the default models use are present in
the H200's, so a start there neither re-tunes nor falls back to the SM-count heuristic."""

from __future__ import annotations

import json

import pytest
import torch

from llmfast.attention.triton import launch as attention
from llmfast.attention.tuning import prefill_tuning, split_table

SPLIT_FILES = sorted(split_table.TABLE_DIR.glob("*.json"))
PREFILL_FILES = sorted(prefill_tuning.SHIPPED_DIR.glob("*.json"))


@pytest.mark.parametrize("path", SPLIT_FILES, ids=lambda p: p.name)
def test_split_tables_parse_and_are_named_for_their_gpu(path):
    data = json.loads(path.read_text())
    tables = split_table.parse_tables(data)
    assert tables
    assert split_table.table_path(data["device"]) == path
    assert split_table.split_tables_for(data["device"]) == tables


@pytest.mark.parametrize("path", PREFILL_FILES, ids=lambda p: p.name)
def test_prefill_tables_parse_and_are_named_for_their_gpu(path):
    tiles, data = prefill_tuning.read_table(path)
    assert tiles, "an empty or unreadable table"
    assert prefill_tuning.shipped_table_path(data["device"]) == path


def test_h200_tables_hold_the_default_shapes():
    names = {p.name for p in SPLIT_FILES} & {p.name for p in PREFILL_FILES}
    assert "nvidia-h200.json" in names
    tables = split_table.split_tables_for("NVIDIA H200")
    # Llama-3.2-1B (head dim 64) and the kernels' benchmark shape (head dim 128).
    for head_dim in (64, 128):
        table = split_table.find_table(tables, 32, 8, head_dim, "bfloat16", 16)
        assert table is not None
        # select_config takes the measured count, not the heuristic's, for a decode.
        for num_reqs, width in ((1, 8192), (8, 8192), (64, 512)):
            config = attention.select_config(
                num_reqs, num_reqs, 32, 8, head_dim, 16, width // 16, torch.bfloat16,
                num_sms=132, split_tables=tables)
            assert config.num_splits == table.lookup(num_reqs, width)
    tiles, _ = prefill_tuning.read_table(prefill_tuning.shipped_table_path("NVIDIA H200"))
    assert {"hd64-g4-bfloat16-causal", "hd64-g4-bfloat16-mixed",
            "hd128-g4-bfloat16-causal", "hd128-g4-bfloat16-mixed"} <= set(tiles)
