"""Sliding-window attention in the Triton kernels (prefill tiles, split-KV decode, the
decode region, the fused decode + RoPE kernel), run by the Triton interpreter in a child
process as tests/test_attention_kernels.py's are, against ops.py's float64 reference with
the window.

Besides the values, each check proves the skip: after the reference is computed, every
key more than 128 positions (the widest key tile) before a request's first visible key
is overwritten with NaN. A kernel that walked those tiles, masking instead of skipping
them, would multiply NaN by 0 and return NaN."""

from __future__ import annotations

import pytest
import torch

from llmfast.attention import ops
from llmfast.attention.triton import launch as attention
from llmfast.attention.tuning.prefill_tuning import PrefillTiles
from tests.test_attention_kernels import (
    TOL,
    _serve,
    assert_rel_close,
    assert_same_bits,
    interpreter_child,
    make_batch,
)

_WIDEST_TILE = 128


@pytest.fixture(scope="module")
def interpreter():
    yield from interpreter_child(__file__)


def _reference(b: dict, window: int) -> torch.Tensor:
    k_cache, v_cache = b["k_cache"].clone(), b["v_cache"].clone()
    ops.reshape_and_cache_reference(b["k"], b["v"], k_cache, v_cache, b["slot_mapping"])
    out = torch.zeros(b["q"].shape, dtype=torch.float64)
    ops.paged_attention_reference(b["q"], k_cache, v_cache, b["block_table"],
                                  b["query_start_loc"], b["seq_lens"], b["scale"], out,
                                  compute_dtype=torch.float64, window=window)
    return out


def _poison_before_windows(b: dict, reqs, window: int, k_cache, v_cache) -> int:
    """NaN into every key far before each request's first visible one; how many."""
    block_size, kv_heads, head_dim = k_cache.shape[1:]
    poisoned = 0
    for r, (ctx, _) in enumerate(reqs):
        first_key = max(0, ctx - window + 1)  # the first query's window start
        pos = torch.arange(0, max(0, first_key - _WIDEST_TILE + 1))
        slots = b["block_table"][r, pos // block_size].long() * block_size + pos % block_size
        for cache in (k_cache, v_cache):
            cache.view(-1, kv_heads, head_dim)[slots] = float("nan")
        poisoned += len(pos)
    return poisoned


def _run(b: dict, reqs, window: int, dtype: torch.dtype, **kw) -> torch.Tensor:
    ref = _reference(b, window)
    k_cache, v_cache = b["k_cache"].clone(), b["v_cache"].clone()
    attention.reshape_and_cache(b["k"], b["v"], k_cache, v_cache, b["slot_mapping"])
    assert _poison_before_windows(b, reqs, window, k_cache, v_cache) > 0
    out = torch.full_like(b["q"], float("nan"))
    attention.unified_attention(b["q"], k_cache, v_cache, b["block_table"],
                                b["query_start_loc"], b["seq_lens"], b["scale"], out,
                                window=window, **kw)
    n = int(b["query_start_loc"][len(reqs)])
    assert_rel_close(out[:n], ref[:n], TOL[dtype])
    return out


# Long decodes, a prefill chunk over a long prefix (its query tile's rows have different
# window starts), a fresh prefill longer than the window, short requests the window
# covers, a 2-token (speculative) row.
MIX = [(300, 1), (180, 37), (0, 50), (3, 1), (20, 9), (150, 2), (260, 1)]


def check_window(dtype: str, group: int, window: int, mode: str):
    dt = getattr(torch, dtype)
    reqs = MIX
    if mode in ("splits", "one_kv_loop"):
        reqs = [(300, 1), (3, 1), (170, 1), (45, 1)]
    b = make_batch(reqs, num_heads=2 * group, num_kv_heads=2, head_dim=64, block_size=16,
                   dtype=dt, pad_tokens=2, pad_reqs=1)
    kw: dict = {}
    if mode == "tiles":
        kw["prefill_tiles"] = PrefillTiles(16, 16, 4, 2)
    elif mode == "splits":
        kw["config"] = attention.AttentionConfig(1, 16, 4, 4, 2, min_split_tiles=1)
    elif mode == "one_kv_loop":
        kw["config"] = attention.AttentionConfig(1, 32, 3, 4, 2, min_split_tiles=1,
                                                 one_kv_loop=True)
    elif mode == "region":
        region = attention.DecodeRegion(block_q=2, block_n=16, num_splits=4)
        kw["config"] = attention.AttentionConfig(8, 16, 1, 4, 2, min_split_tiles=1,
                                                 decode_region=region)
    _run(b, reqs, window, dt, **kw)


def check_fused_decode_rope(dtype: str, window: int, num_splits: int):
    """The fused decode + RoPE kernel with a window = rope_and_cache then the windowed
    attention kernel, bit for bit; both skip the keys before the window."""
    from llmfast.config import RopeScaling
    from llmfast.models.rope import rope_table

    dt = getattr(torch, dtype)
    reqs = [(300, 1), (3, 1), (170, 1), (0, 1), (45, 1)]
    b = make_batch(reqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dt,
                   pad_tokens=1, pad_reqs=1)
    positions = torch.tensor([c for c, _ in reqs] + [0], dtype=torch.int64)
    table = rope_table(64, 512, 10000.0, RopeScaling())
    args = (b["block_table"], b["query_start_loc"], b["seq_lens"], b["scale"])
    outs = []
    for fused in (True, False):
        k_cache, v_cache = b["k_cache"].clone(), b["v_cache"].clone()
        _poison_before_windows(b, reqs, window, k_cache, v_cache)
        out = torch.full_like(b["q"], float("nan"))
        if fused:
            attention.unified_attention(
                b["q"], k_cache, v_cache, *args, out, num_splits=num_splits, window=window,
                new_tokens=(b["k"], b["v"], b["slot_mapping"], positions, table),
                uniform_decode=True)
        else:
            attention.rope_and_cache(b["q"], b["k"], b["v"], positions, table, out, k_cache,
                                     v_cache, b["slot_mapping"])
            attention.unified_attention(out, k_cache, v_cache, *args, out,
                                        num_splits=num_splits, window=window)
        outs.append(out[: len(reqs)])
    assert torch.isfinite(outs[0]).all()
    assert_same_bits(outs[0], outs[1])


@pytest.mark.parametrize("dtype, group, window, mode", [
    ("float32", 1, 40, "default"),
    ("bfloat16", 4, 17, "default"),
    ("float32", 2, 33, "tiles"),
    ("float32", 2, 1, "tiles"),  # each query sees itself only
    ("float32", 2, 40, "splits"),
    ("bfloat16", 2, 100, "splits"),
    ("float32", 2, 40, "one_kv_loop"),
    ("float32", 2, 24, "region"),
])
def test_window_matches_reference_and_skips_old_tiles(interpreter, dtype, group, window,
                                                      mode):
    interpreter("check_window", dtype=dtype, group=group, window=window, mode=mode)


@pytest.mark.parametrize("window, num_splits", [(40, None), (64, 4)])
def test_fused_decode_rope_with_window(interpreter, window, num_splits):
    interpreter("check_fused_decode_rope", dtype="float32", window=window,
                num_splits=num_splits)


def test_window_is_part_of_the_launch_plan():
    """Windowed and full launches of one shape are different variants (SLIDING is a
    constexpr; the window itself a runtime argument)."""
    cfg = attention.AttentionConfig(4, 16, 1, 4, 2)
    q = torch.zeros(8, 4, 64)
    cache = torch.zeros(10, 16, 2, 64)
    table = torch.zeros(2, 4, dtype=torch.int32)
    full = attention._plan(q, cache, cache, table, q, 2, None, None, True, None, cfg)
    slide = attention._plan(q, cache, cache, table, q, 2, None, None, True, None, cfg,
                            sliding=True)
    assert not full.constexprs["SLIDING"] and slide.constexprs["SLIDING"]
    assert full.const_key != slide.const_key


if __name__ == "__main__":
    _serve(globals())
