"""KV split counts that are not powers of two, under the Triton interpreter against the
float64 reference: the fused merge with num_used < num_splits, the decode region of a
mixed launch, the fused decode + RoPE kernel (which split writes the new K/V), and counts
that come from a split table (a runtime count under a power-of-two SPLIT_BOUND)."""

from __future__ import annotations


import pytest
import torch

from llmfast.attention.triton import launch as attention
from llmfast.attention.triton.kv_write import next_pow2
from llmfast.attention.tuning.split_table import parse_table
from llmfast.attention.workspaces import AttentionWorkspaces
from tests import test_attention_kernels as attn
from tests import test_rope_cache as rope_tests

# Long and short contexts: with 16-key tiles the 700-key one has 44 tiles, so 12 splits
# use 11 (num_used < num_splits), 24 use 22, 48 use 44; the 3-key one a single split.
CONTEXTS = [(700, 1), (3, 1), (150, 1), (33, 1), (0, 1)]


def _table(value, head_dim=64, heads=8, kv_heads=2):
    rows = [dict(batch=b, ctx=c, best=value(b, c)) for b in (1, 4, 8, 64)
            for c in (512, 2048, 8192)]
    return parse_table(dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                            dtype="float32", block_size=16, table=rows))


def check_forced_split_decode(num_splits: int, block_n: int, min_split_tiles: int):
    b = attn.make_batch(CONTEXTS, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                        dtype=torch.float32, pad_tokens=1, pad_reqs=1)
    cfg = attention.AttentionConfig(4, block_n, num_splits, 4, 2,
                                    min_split_tiles=min_split_tiles)
    plan = attention._plan(b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["q"],
                           b["seq_lens"].shape[0], None, None, True, None, cfg)
    assert plan.grid[2] == num_splits, plan.grid
    bound = plan.constexprs["SPLIT_BOUND"]
    assert bound >= num_splits and bound & (bound - 1) == 0, bound
    attn.check_step(b, torch.float32, config=cfg)
    # The counters are zero again (every touched counter reached its num_used).
    k_cache, v_cache = b["k_cache"].clone(), b["v_cache"].clone()
    owner = AttentionWorkspaces([k_cache])
    attention.reshape_and_cache(b["k"], b["v"], k_cache, v_cache, b["slot_mapping"])
    attention.unified_attention(b["q"], k_cache, v_cache, b["block_table"],
                                b["query_start_loc"], b["seq_lens"], b["scale"],
                                torch.empty_like(b["q"]), config=cfg)
    counters = owner.arrivals(b["q"].device, plan.num_arrivals)
    assert owner.num_arrival_buffers == 1 and not counters.any(), counters


def check_table_split_decode(table_splits: int):
    """A decode launch whose count comes from a split table (not forced): runtime
    count `table_splits`, split code compiled for its power of two."""
    tables = (_table(lambda b, c: table_splits),)
    saved = attention._device_split_tables
    attention._device_split_tables = lambda device: tables
    try:
        b = attn.make_batch(CONTEXTS, num_heads=8, num_kv_heads=2, head_dim=64,
                            block_size=16, dtype=torch.float32, pad_tokens=1, pad_reqs=1)
        plan = attention._plan(b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["q"],
                               b["seq_lens"].shape[0], None, None, True, None)
        assert plan.split_counts[0] == table_splits, plan.split_counts
        assert plan.constexprs["SPLIT_BOUND"] == next_pow2(table_splits)
        attn.check_step(b, torch.float32)
    finally:
        attention._device_split_tables = saved


def check_table_decode_region(table_splits: int):
    """A mixed launch whose decode region takes a split table's non-power-of-two count:
    DEC_SPLIT_BOUND its power of two, dec_splits the count itself."""
    tables = (_table(lambda b, c: table_splits, head_dim=64, heads=4, kv_heads=2),)
    saved = attention._device_split_tables
    attention._device_split_tables = lambda device: tables
    try:
        b = attn.make_batch(attn.REGION_MIX + [(600, 1)], num_heads=4, num_kv_heads=2,
                            head_dim=64, block_size=16, dtype=torch.float32, pad_tokens=3,
                            pad_reqs=1)
        num_reqs = b["seq_lens"].shape[0]
        plan = attention._plan(b["q"], b["k_cache"], b["v_cache"], b["block_table"], b["q"],
                               num_reqs, None, None, True, None)
        assert plan.constexprs["DECODE_REGION"], plan.constexprs
        assert plan.split_counts == (1, table_splits), plan.split_counts
        assert plan.constexprs["DEC_SPLIT_BOUND"] == next_pow2(table_splits)
        attn.check_step(b, torch.float32)
    finally:
        attention._device_split_tables = saved


def check_forced_decode_region(region_splits: int):
    attn.check_decode_region("float32", region_splits, min_split_tiles=1)


def check_decode_rope(num_splits: int, dtype: str = "float32"):
    rope_tests.check_decode_rope_kernel(dtype, dtype, num_splits)


def check_table_decode_rope(table_splits: int):
    """The fused decode + RoPE kernel at a table's count (6: SPLIT_BOUND 8)."""
    tables = (_table(lambda b, c: table_splits),)
    saved = attention._device_split_tables
    attention._device_split_tables = lambda device: tables
    try:
        before = {id(plan) for plan in attention._PLANS.values()}
        rope_tests.check_decode_rope_kernel("float32", "float32", None)
        fresh = [p for p in attention._PLANS.values() if id(p) not in before and p.rope]
        assert fresh and all(p.split_counts == (table_splits,) for p in fresh), fresh
        assert all(p.constexprs["SPLIT_BOUND"] == next_pow2(table_splits)
                   for p in fresh)
    finally:
        attention._device_split_tables = saved


@pytest.fixture(scope="module")
def interpreter():
    yield from attn.interpreter_child(__file__)


@pytest.mark.parametrize("num_splits, block_n, min_split_tiles",
                         [(3, 16, 1), (12, 16, 1), (48, 16, 1), (7, 32, 2)])
def test_forced_split_decode(interpreter, num_splits, block_n, min_split_tiles):
    interpreter("check_forced_split_decode", num_splits=num_splits, block_n=block_n,
                min_split_tiles=min_split_tiles)


@pytest.mark.parametrize("table_splits", [6])
def test_table_split_decode(interpreter, table_splits):
    interpreter("check_table_split_decode", table_splits=table_splits)


@pytest.mark.parametrize("table_splits", [6])
def test_table_decode_region(interpreter, table_splits):
    interpreter("check_table_decode_region", table_splits=table_splits)


@pytest.mark.parametrize("region_splits", [3])
def test_forced_decode_region(interpreter, region_splits):
    interpreter("check_forced_decode_region", region_splits=region_splits)


@pytest.mark.parametrize("num_splits", [3, 12])
def test_decode_rope(interpreter, num_splits):
    interpreter("check_decode_rope", num_splits=num_splits)


@pytest.mark.parametrize("table_splits", [6])
def test_table_decode_rope(interpreter, table_splits):
    interpreter("check_table_decode_rope", table_splits=table_splits)


if __name__ == "__main__":
    attn._serve(globals())
