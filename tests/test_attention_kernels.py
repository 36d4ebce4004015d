"""Triton paged attention and KV write, run by the Triton interpreter on CPU.

Triton chooses the interpreter when `@triton.jit` runs, and decorates its own standard
library (tl.sum, ...) when triton is imported, so TRITON_INTERPRET=1 must be set before
anything imports triton. Setting it in this module would leak into every other test
module (ops.py dispatches on it) and fail if triton was already imported; instead the
kernel checks run in one child Python per module, started with TRITON_INTERPRET=1
(the `interpreter` fixture; this file is the child's script). Shapes are small: the
interpreter runs every program in Python. The oracle is ops.py's reference in float64.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import select
import subprocess
import sys
import traceback

import pytest
import torch
import triton

from llmfast.attention.triton import launch as attention
from llmfast.attention.triton import launch_config as attention_config
from llmfast.attention.triton import kv_write
from llmfast.attention import ops
from llmfast.attention.triton import rope_cache
from llmfast.attention.triton.kv_write import next_pow2
from llmfast.kernels.launch.offline_target import offline_hopper
from llmfast.attention.tuning import prefill_measure
from llmfast.attention.tuning.prefill_tuning import PrefillTiles, ShapeClass
from llmfast.attention.workspaces import AttentionWorkspaces
from tests.helpers.triton_compat import fix_interpreter_scalar_index

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
CHILD_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def interpreter():
    """run(check_name, **kwargs): runs `check_name` in the interpreter child."""
    yield from interpreter_child(__file__)


def interpreter_child(script: str):
    """The `interpreter` fixture's body for a child running `script` (a test module
    whose `__main__` serves its checks: see `_serve`)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(filter(None, sys.path)))
    proc = subprocess.Popen(
        [sys.executable, script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )

    def run(check: str, **kwargs) -> None:
        proc.stdin.write(json.dumps([check, kwargs]) + "\n")
        proc.stdin.flush()
        if not select.select([proc.stdout], [], [], CHILD_TIMEOUT_S)[0]:
            proc.kill()
            pytest.fail(f"interpreter child gave no answer in {CHILD_TIMEOUT_S} s")
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"interpreter child died (exit code {proc.wait()})")
        error = json.loads(line)
        if error:
            pytest.fail(error, pytrace=False)

    yield run
    if proc.poll() is None:  # still serving: end it by closing its input
        proc.stdin.close()
        proc.wait(timeout=60)


def _serve(checks: dict | None = None) -> None:
    """Child loop: one JSON [check_name, kwargs] per line in, "" or a traceback out;
    `checks`: the serving module's globals (default: this module's)."""
    checks = globals() if checks is None else checks
    fix_interpreter_scalar_index()
    interpreted = triton.runtime.interpreter.InterpretedFunction
    assert isinstance(attention._unified_attention_kernel, interpreted)
    replies, sys.stdout = sys.stdout, sys.stderr  # keep the reply channel clean
    for line in sys.stdin:
        check, kwargs = json.loads(line)
        try:
            checks[check](**kwargs)
            error = ""
        except Exception:
            error = traceback.format_exc()
        replies.write(json.dumps(error) + "\n")
        replies.flush()


# ----------------------------------------------------------------------------- helpers


def make_batch(
    reqs: list[tuple[int, int]],  # (num_computed_tokens, num_scheduled_tokens) per request
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    pad_tokens: int = 0,
    pad_reqs: int = 0,
    device: str = "cpu",
    seed: int = 0,
) -> dict:
    """A step's attention inputs with a shuffled paged cache.

    Block 0 is a null block and every cache slot that holds no token is NaN, so a kernel
    that reads past a request's context (or through an unused table entry) poisons its
    output. Padding: `pad_tokens` rows with slot -1 past query_start_loc[-1], and
    `pad_reqs` requests with no tokens and seq_len 0.
    """
    gen = torch.Generator().manual_seed(seed)  # small index tensors: built on CPU
    dev_gen = torch.Generator(device).manual_seed(seed)  # bulk values: made on `device`

    def randn(*shape):
        return torch.randn(shape, generator=dev_gen, device=device).to(dtype)

    seq_lens = [c + n for c, n in reqs]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + 2  # null block + two never-used blocks
    perm = torch.randperm(num_blocks - 1, generator=gen).to(torch.int32) + 1
    num_reqs = len(reqs) + pad_reqs
    block_table = torch.zeros(num_reqs, max(blocks_per_req) + 1, dtype=torch.int32)
    prefix_slots, new_slots = [], []
    for r, ((c, n), nb) in enumerate(zip(reqs, blocks_per_req)):
        block_table[r, :nb], perm = perm[:nb], perm[nb:]
        pos = torch.arange(c + n)
        slot = block_table[r, pos // block_size].long() * block_size + pos % block_size
        prefix_slots.append(slot[:c])
        new_slots.append(slot[c:])

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
    # The cached prefix: written directly, as earlier steps would have.
    prefix = torch.cat(prefix_slots).to(device)
    k_cache.view(-1, num_kv_heads, head_dim)[prefix] = randn(len(prefix), num_kv_heads, head_dim)
    v_cache.view(-1, num_kv_heads, head_dim)[prefix] = randn(len(prefix), num_kv_heads, head_dim)

    num_tokens = sum(n for _, n in reqs) + pad_tokens
    starts = [0]
    for _, n in reqs:
        starts.append(starts[-1] + n)
    starts += [starts[-1]] * pad_reqs
    slot_mapping = torch.cat(new_slots + [torch.full((pad_tokens,), -1, dtype=torch.long)])
    return dict(
        q=randn(num_tokens, num_heads, head_dim),
        k=randn(num_tokens, num_kv_heads, head_dim),
        v=randn(num_tokens, num_kv_heads, head_dim),
        k_cache=k_cache,
        v_cache=v_cache,
        slot_mapping=slot_mapping.to(device),
        block_table=block_table.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens + [0] * pad_reqs, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def reference_out(b: dict) -> torch.Tensor:
    """Float64 attention over the caches after the new tokens were written."""
    k_cache, v_cache = b["k_cache"].clone(), b["v_cache"].clone()
    ops.reshape_and_cache_reference(b["k"], b["v"], k_cache, v_cache, b["slot_mapping"])
    out = torch.zeros(b["q"].shape, dtype=torch.float64, device=b["q"].device)
    ops.paged_attention_reference(
        b["q"], k_cache, v_cache, b["block_table"], b["query_start_loc"], b["seq_lens"],
        b["scale"], out, compute_dtype=torch.float64,
    )
    return out


def assert_rel_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert torch.isfinite(out).all(), "unwritten (NaN) or non-finite rows"
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err < tol, f"relative error {err:.3g} >= {tol}"


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def run_triton_step(b: dict, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KV write then attention with the Triton kernels, on copies; out starts as NaN."""
    k_cache, v_cache = b["k_cache"].clone(), b["v_cache"].clone()
    attention.reshape_and_cache(b["k"], b["v"], k_cache, v_cache, b["slot_mapping"])
    out = torch.full_like(b["q"], float("nan"))
    attention.unified_attention(
        b["q"], k_cache, v_cache, b["block_table"], b["query_start_loc"], b["seq_lens"],
        b["scale"], out, **kw,
    )
    return out, k_cache, v_cache


def check_step(b: dict, dtype: torch.dtype, **kw) -> None:
    out, k_cache, v_cache = run_triton_step(b, **kw)
    # Cache: exactly the reference write; every other slot (NaN poison) untouched.
    ref_k, ref_v = b["k_cache"].clone(), b["v_cache"].clone()
    ops.reshape_and_cache_reference(b["k"], b["v"], ref_k, ref_v, b["slot_mapping"])
    assert_same_bits(k_cache, ref_k)
    assert_same_bits(v_cache, ref_v)
    n = int(b["query_start_loc"][-1])
    assert_rel_close(out[:n], reference_out(b)[:n], TOL[dtype])


# Decode with a long cached context, a prefill chunk over a cached prefix, a fresh
# prefill, a decode whose context is the new token alone, a tiny chunk at a block edge.
MIXED = [(36, 1), (20, 13), (0, 9), (0, 1), (15, 2)]


# ----------------------------------------------------------------------------- child checks
# Run inside the interpreter child; dtypes arrive by name (JSON).


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def check_mixed(dtype, group, head_dim, block_size, block_q=None, num_splits=None):
    b = make_batch(
        MIXED, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
        block_size=block_size, dtype=_dtype(dtype), pad_tokens=3, pad_reqs=1,
    )
    check_step(b, _dtype(dtype), block_q=block_q, num_splits=num_splits)


def check_split_decode(dtype: str, num_splits: int, fused_merge: bool = True,
                       min_split_tiles: int | None = None):
    # Contexts shorter than one split's share leave some splits empty (merge weight 0);
    # with the fused merge, splits sized for the live context: the 150-key context uses
    # one split per key tile (min_split_tiles 1) or per two (the default), the 3-key one
    # a single split (written straight to `out`).
    b = make_batch(
        [(150, 1), (3, 1), (70, 1)], num_heads=8, num_kv_heads=2, head_dim=64,
        block_size=16, dtype=_dtype(dtype), pad_tokens=1,
    )
    kw = {}
    if min_split_tiles is not None:
        chosen = attention.select_config(4, 3, 8, 2, 64, 16, b["block_table"].shape[1],
                                         _dtype(dtype), attention._num_sms(b["q"].device))
        kw["config"] = dataclasses.replace(chosen, num_splits=num_splits,
                                           min_split_tiles=min_split_tiles)
    check_step(b, _dtype(dtype), num_splits=num_splits, fused_merge=fused_merge, **kw)
    if fused_merge:  # the last arrivals reset their counters: zero for the next launch
        k_cache, v_cache = b["k_cache"].clone(), b["v_cache"].clone()
        owner = AttentionWorkspaces([k_cache])  # as a runner's: its counters persist
        attention.unified_attention(
            b["q"], k_cache, v_cache, b["block_table"], b["query_start_loc"], b["seq_lens"],
            b["scale"], torch.empty_like(b["q"]), num_splits=num_splits, fused_merge=True,
            **kw)
        cfg = attention.select_config(4, 3, 8, 2, 64, 16, b["block_table"].shape[1],
                                      _dtype(dtype), attention._num_sms(b["q"].device))
        counters = owner.arrivals(b["q"].device, (4 // cfg.block_q + 3) * 2)
        assert owner.num_arrival_buffers == 1  # the launch used (and left) these counters
        assert counters.numel() and not counters.any(), counters


def check_full_graph_decode(dtype: str, contexts: list[int], padded: int,
                            max_model_len: int):
    """A full CUDA graph's decode launch: `padded` request rows of which the last hold
    no query token (seq_len 0), a block table as wide as max_model_len, and the split
    count the heuristic picks for that width on an H100-sized GPU (132 SMs), however
    short the live contexts. Every block no live key lives in, and every table entry
    past a row's context, names a NaN block: reading one poisons the output."""
    attention._num_sms = lambda device: 132
    n = len(contexts)
    b = make_batch([(c, 1) for c in contexts], num_heads=8, num_kv_heads=2, head_dim=64,
                   block_size=16, dtype=_dtype(dtype), pad_tokens=padded - n,
                   pad_reqs=padded - n)
    table, num_blocks = b["block_table"], b["k_cache"].shape[0]
    poison = sorted(set(range(1, num_blocks)) - set(table.flatten().tolist()))[0]
    wide = torch.full((padded, max_model_len // 16), poison, dtype=torch.int32)
    for r, c in enumerate(contexts):
        used = math.ceil((c + 1) / 16)
        wide[r, :used] = table[r, :used]
    b["block_table"] = wide
    cfg = attention.select_config(padded, padded, 8, 2, 64, 16, wide.shape[1],
                                  _dtype(dtype), 132)
    assert cfg.num_splits >= 4, cfg  # splits sized for max_model_len, not the live context
    check_step(b, _dtype(dtype))


def check_decode_like(reqs):
    b = make_batch([tuple(r) for r in reqs], num_heads=8, num_kv_heads=2, head_dim=32,
                   block_size=16, dtype=torch.float32, pad_tokens=2, pad_reqs=1)
    # 2-token tiles (block_q 2): requests' first tiles are r + r // 2 in a decode step
    check_step(b, torch.float32, block_q=2)


def check_one_kv_loop(dtype: str, kind: str):
    """One masked loop over the key tiles (AttentionConfig.one_kv_loop) computes what
    the unmasked bulk loop + masked tail do, bit for bit (masks that keep every key of
    a tile change no value), for decode splits, prefill tiles and a decode region."""
    if kind == "decode":
        b = make_batch([(150, 1), (3, 1), (70, 1)], num_heads=8, num_kv_heads=2,
                       head_dim=64, block_size=16, dtype=_dtype(dtype), pad_tokens=1)
        cfg = attention.AttentionConfig(4, 32, 4, 4, 2, min_split_tiles=1)
    else:
        b = make_batch(REGION_MIX, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=_dtype(dtype), pad_tokens=3, pad_reqs=1)
        region = attention.DecodeRegion(2, 16, 4) if kind == "region" else None
        cfg = attention.AttentionConfig(8, 16, 1, 4, 2, min_split_tiles=1,
                                        decode_region=region)
    one = dataclasses.replace(cfg, one_kv_loop=True)
    if cfg.decode_region is not None:
        one = dataclasses.replace(one, decode_region=dataclasses.replace(
            cfg.decode_region, one_kv_loop=True))
    out_two, _, _ = run_triton_step(b, config=cfg)
    out_one, _, _ = run_triton_step(b, config=one)
    n = int(b["query_start_loc"][-1])
    assert_rel_close(out_one[:n], reference_out(b)[:n], TOL[_dtype(dtype)])
    assert_same_bits(out_one[:n], out_two[:n])


# Decodes (1 and 2 query tokens: speculative rows) over long and short contexts, one
# request one token past the decode region's 2-token tiles (the query tiles take it),
# prefill chunks over a prefix and fresh, a decode whose only key is its own.
REGION_MIX = [(150, 1), (20, 13), (70, 2), (33, 3), (0, 9), (0, 1), (95, 1)]


def check_decode_region(dtype: str, region_splits: int, min_split_tiles: int = 1,
                        prefill_block_q: int = 8):
    """A prefill-like launch whose decodes run in the decode region (2-token tiles,
    `region_splits` KV splits merged in the launch) beside 8-token query tiles: every
    row matches the reference, and the region's counters are zero again afterwards."""
    group = 2
    b = make_batch(REGION_MIX, num_heads=2 * group, num_kv_heads=2, head_dim=64,
                   block_size=16, dtype=_dtype(dtype), pad_tokens=3, pad_reqs=1)
    region = attention.DecodeRegion(block_q=2, block_n=16, num_splits=region_splits)
    config = attention.AttentionConfig(prefill_block_q, 16, 1, num_warps=4, num_stages=2,
                                       min_split_tiles=min_split_tiles, decode_region=region)
    num_tokens, num_reqs = b["q"].shape[0], b["seq_lens"].shape[0]
    plan = attention._plan(b["q"], b["k_cache"], b["v_cache"], b["block_table"],
                           b["q"], num_reqs, None, None, True, None, config)
    main_tiles = num_tokens // prefill_block_q + num_reqs
    assert plan.grid == (main_tiles + num_reqs * region_splits, 2, 1), plan.grid
    assert plan.partials_shape[:2] == (region_splits, num_reqs * 2)
    check_step(b, _dtype(dtype), config=config)
    if region_splits > 1:
        k_cache, v_cache = b["k_cache"].clone(), b["v_cache"].clone()
        owner = AttentionWorkspaces([k_cache])
        attention.reshape_and_cache(b["k"], b["v"], k_cache, v_cache, b["slot_mapping"])
        attention.unified_attention(
            b["q"], k_cache, v_cache, b["block_table"], b["query_start_loc"], b["seq_lens"],
            b["scale"], torch.empty_like(b["q"]), config=config)
        counters = owner.arrivals(b["q"].device, plan.num_arrivals)
        assert owner.num_arrival_buffers == 1
        assert not counters.any(), counters


# Prefill chunks ending one before, at and one past a tile edge (16 keys, 16 rows), over
# no prefix and over a prefix of one and of two key tiles minus one, plus a decode.
TILE_EDGES = [(0, 15), (0, 17), (16, 16), (31, 2), (40, 1)]


def check_tile_boundaries(dtype, group, head_dim, block_m, block_n):
    b = make_batch(TILE_EDGES, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                   block_size=16, dtype=_dtype(dtype), pad_tokens=2)
    check_step(b, _dtype(dtype), prefill_tiles=PrefillTiles(block_m, block_n, 4, 2))


def check_causal_skip(dtype, group, ctx, num_new, cut, block_m, block_n, one_kv_loop=False):
    """Keys past a query tile's last causal position are never read: after the KV write,
    every key at position >= ctx + cut (a tile edge) is NaN; rows before `cut` must still
    match the reference (a loop that ran past its tile's bound, masking instead of
    stopping, would multiply the NaN values by 0 and return NaN), rows after must not."""
    b = make_batch([(ctx, num_new)], num_heads=2 * group, num_kv_heads=2, head_dim=64,
                   block_size=16, dtype=_dtype(dtype))
    ref = reference_out(b)
    k_cache, v_cache = b["k_cache"].clone(), b["v_cache"].clone()
    attention.reshape_and_cache(b["k"], b["v"], k_cache, v_cache, b["slot_mapping"])
    pos = torch.arange(ctx + cut, ctx + num_new)
    slots = b["block_table"][0, pos // 16].long() * 16 + pos % 16
    for cache in (k_cache, v_cache):
        cache.view(-1, 2, 64)[slots] = float("nan")
    out = torch.full_like(b["q"], float("nan"))
    tiles = PrefillTiles(block_m, block_n, 4, 2)
    config = None
    if one_kv_loop:
        config = attention.AttentionConfig(max(1, block_m // next_pow2(group)), block_n, 1, 4,
                                           2, one_kv_loop=True)
    attention.unified_attention(
        b["q"], k_cache, v_cache, b["block_table"], b["query_start_loc"], b["seq_lens"],
        b["scale"], out, prefill_tiles=tiles, config=config)
    assert_rel_close(out[:cut], ref[:cut], TOL[_dtype(dtype)])
    assert not torch.isfinite(out[cut:]).any()  # the poison is there for whoever reads it


def check_tuner_batch(kind: str):
    """The tuner's synthetic batch (kernels/prefill_measure.py, shrunk) is a valid step:
    the kernel with a candidate's tiles matches the reference on it."""
    prefill_measure.CAUSAL_TOKENS, prefill_measure.MIXED_CHUNK = 40, 24
    prefill_measure.MIXED_DECODES, prefill_measure.KV_HEADS = 3, 2
    b = prefill_measure.synthetic_batch(ShapeClass(32, 2, "float32", kind), torch.device("cpu"))
    ref = torch.zeros(b["q"].shape, dtype=torch.float64)
    ops.paged_attention_reference(b["q"], b["k_cache"], b["v_cache"], b["block_table"],
                                  b["query_start_loc"], b["seq_lens"], b["scale"], ref,
                                  compute_dtype=torch.float64)
    attention.unified_attention(**b, prefill_tiles=PrefillTiles(16, 32, 4, 2))
    assert b["q"].shape[0] == (40 if kind == "causal" else 27)
    assert_rel_close(b["out"], ref, TOL[torch.float32])


def check_reshape_and_cache_strided():
    # k/v as views of a fused qkv projection and caches as views of one [2, ...] tensor.
    torch.manual_seed(0)
    num_tokens, kv_heads, head_dim, block_size = 6, 3, 32, 16
    qkv = torch.randn(num_tokens, (4 + 2 * kv_heads) * head_dim, dtype=torch.float16)
    k = qkv[:, 4 * head_dim: (4 + kv_heads) * head_dim].view(num_tokens, kv_heads, head_dim)
    v = qkv[:, (4 + kv_heads) * head_dim:].view(num_tokens, kv_heads, head_dim)
    kv_cache = torch.full((2, 6, block_size, kv_heads, head_dim), float("nan"), dtype=torch.float16)
    slots = torch.tensor([3, 80, -1, 17, 95, -1], dtype=torch.int64)
    ref = kv_cache.clone()
    ops.reshape_and_cache_reference(k, v, ref[0], ref[1], slots)
    attention.reshape_and_cache(k, v, kv_cache[0], kv_cache[1], slots)
    assert_same_bits(kv_cache, ref)
    # More key rows than slots (the reference allows it): only len(slots) rows written.
    short = torch.tensor([40, 7], dtype=torch.int64)
    ops.reshape_and_cache_reference(k, v, ref[0], ref[1], short)
    attention.reshape_and_cache(k, v, kv_cache[0], kv_cache[1], short)
    assert_same_bits(kv_cache, ref)


def check_op_dispatch(build_batch=make_batch):
    """torch.ops.llmfast.unified_attention (KV write, then attention) on CPU goes to
    Triton when interpreting. `build_batch`: make_batch, or a builder of the same
    arguments (the fp8-cache tests pass theirs)."""
    b = build_batch(
        [(5, 1), (0, 6)], num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
        dtype=torch.float32, pad_tokens=1,
    )
    k_cache, v_cache = b["k_cache"].clone(), b["v_cache"].clone()
    out = torch.full_like(b["q"], float("nan"))
    torch.ops.llmfast.unified_attention(
        b["q"], b["k"], b["v"], k_cache, v_cache, b["slot_mapping"], b["block_table"],
        b["query_start_loc"], b["seq_lens"], b["scale"], out,
    )
    assert_rel_close(out[:7], reference_out(b)[:7], TOL[torch.float32])


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize(
    "dtype, group, head_dim, block_size, block_q",
    [
        ("float32", 1, 64, 16, None),
        ("float16", 3, 64, 32, 4),
        ("bfloat16", 4, 128, 16, 2),
        ("bfloat16", 8, 64, 64, None),
        ("float32", 2, 80, 16, 4),  # head_dim padded to 128 inside the kernel
    ],
)
def test_mixed_batch_matches_reference(interpreter, dtype, group, head_dim, block_size, block_q):
    interpreter(
        "check_mixed", dtype=dtype, group=group, head_dim=head_dim,
        block_size=block_size, block_q=block_q,
    )


@pytest.mark.parametrize("dtype, num_splits, fused_merge, min_split_tiles",
                         [("float32", 4, True, None), ("bfloat16", 8, True, None),
                          ("float32", 4, False, None), ("float32", 8, True, 1),
                          # counts between the powers of two (split tables may hold them)
                          ("float32", 3, True, 1), ("bfloat16", 6, True, 1),
                          ("float32", 3, False, 1)])
def test_split_kv_decode(interpreter, dtype, num_splits, fused_merge, min_split_tiles):
    interpreter("check_split_decode", dtype=dtype, num_splits=num_splits,
                fused_merge=fused_merge, min_split_tiles=min_split_tiles)


@pytest.mark.parametrize("dtype, contexts, padded", [
    ("float32", [5, 40, 0], 4),  # contexts far shorter than one split's share
    ("bfloat16", [300, 17, 1, 64, 2], 8),
])
def test_full_graph_decode_with_padding_rows_and_max_len_splits(interpreter, dtype, contexts,
                                                                 padded):
    interpreter("check_full_graph_decode", dtype=dtype, contexts=contexts, padded=padded,
                max_model_len=4096)


@pytest.mark.parametrize("dtype, region_splits, min_split_tiles", [
    ("float32", 1, 1), ("float32", 4, 1), ("bfloat16", 8, 2),
])
def test_decode_region_of_a_mixed_batch(interpreter, dtype, region_splits, min_split_tiles):
    interpreter("check_decode_region", dtype=dtype, region_splits=region_splits,
                min_split_tiles=min_split_tiles)


@pytest.mark.parametrize("reqs", [
    [(5, 1), (7, 3), (2, 1), (9, 1)],  # a 3-token request: the later tiles miss the guess
    [(40, 1), (3, 1), (0, 1), (17, 1), (8, 1), (1, 1)],  # one token each: every guess hits
])
def test_decode_like_launch_tile_search(interpreter, reqs):
    interpreter("check_decode_like", reqs=reqs)


@pytest.mark.parametrize("dtype, kind", [
    ("float32", "decode"), ("bfloat16", "decode"), ("float32", "prefill"),
    ("float32", "region"),
])
def test_one_kv_loop_equals_bulk_and_tail_loops(interpreter, dtype, kind):
    interpreter("check_one_kv_loop", dtype=dtype, kind=kind)


def test_split_kv_mixed_batch(interpreter):
    # The split path is general: prefill tiles with causal masks split as well.
    interpreter(
        "check_mixed", dtype="float16", group=4, head_dim=64, block_size=16,
        block_q=4, num_splits=2,
    )


@pytest.mark.parametrize("dtype, group, head_dim, block_m, block_n", [
    ("float32", 1, 64, 16, 16),
    ("bfloat16", 2, 128, 16, 32),
    ("float16", 4, 64, 32, 16),
    ("float32", 8, 128, 16, 16),
])
def test_tile_boundaries_and_gqa_groups(interpreter, dtype, group, head_dim, block_m, block_n):
    interpreter("check_tile_boundaries", dtype=dtype, group=group, head_dim=head_dim,
                block_m=block_m, block_n=block_n)


@pytest.mark.parametrize("group, ctx, num_new, cut, block_m, block_n", [
    (1, 0, 40, 16, 16, 16),  # the first tile stops at its own diagonal
    (2, 8, 24, 8, 16, 16),  # over a cached prefix, the diagonal inside a key tile
    (4, 0, 33, 16, 32, 32),  # 8-token tiles, 32-key steps: the bound mid-step
])
@pytest.mark.parametrize("one_kv_loop", [False, True])
def test_causal_tiles_past_the_diagonal_are_not_read(interpreter, group, ctx, num_new, cut,
                                                     block_m, block_n, one_kv_loop):
    interpreter("check_causal_skip", dtype="float32", group=group, ctx=ctx, num_new=num_new,
                cut=cut, block_m=block_m, block_n=block_n, one_kv_loop=one_kv_loop)


@pytest.mark.parametrize("kind", ["causal", "mixed"])
def test_tuner_synthetic_batch(interpreter, kind):
    interpreter("check_tuner_batch", kind=kind)


def test_reshape_and_cache_strided_inputs(interpreter):
    interpreter("check_reshape_and_cache_strided")


def test_op_dispatches_to_triton_when_interpreting(interpreter):
    interpreter("check_op_dispatch")


def _tile_request(tile: int, starts: list[int], block_q: int) -> tuple[int, bool]:
    """The kernel's tile -> request search, replayed: (request, whether the guess hit)."""
    num_reqs = len(starts) - 1
    guess = min(tile - (tile + 1) // (block_q + 1), num_reqs - 1)
    if starts[guess] // block_q + guess <= tile and (
            tile < starts[guess + 1] // block_q + guess + 1 or guess == num_reqs - 1):
        return guess, True
    lo, hi = 0, num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if starts[mid] // block_q + mid <= tile:
            lo = mid
        else:
            hi = mid - 1
    return lo, False


def test_tiles_cover_every_token_once():
    # Host-side replay of the kernel's tile -> request search (pure Python, fast),
    # against the naive answer: the last request whose first tile is <= the tile.
    rng = random.Random(0)
    for _ in range(300):
        block_q = rng.choice([1, 2, 4, 16, 32])
        if rng.random() < 0.3:  # a decode step: one token each, padding requests last
            counts = [1] * rng.randint(1, 40) + [0] * rng.randint(0, 3)
        else:
            counts = [rng.choice([0, 1, 1, 3, 17, 40]) for _ in range(rng.randint(1, 9))]
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        num_tokens = starts[-1] + rng.randint(0, 5)
        seen = []
        for tile in range(num_tokens // block_q + len(counts)):
            req, hit = _tile_request(tile, starts, block_q)
            naive = max(r for r in range(len(counts)) if starts[r] // block_q + r <= tile)
            assert req == naive, (tile, block_q, counts)
            if counts[req] == 1 and all(n == 1 for n in counts[:req]):
                assert hit, (tile, block_q, counts)  # decode rows: one round trip
            q_lo = (tile - (starts[req] // block_q + req)) * block_q
            seen += [starts[req] + i for i in range(q_lo, min(q_lo + block_q, counts[req]))]
        assert sorted(seen) == list(range(starts[-1])), (block_q, counts)


def test_decode_region_and_query_tiles_cover_every_token_once():
    # Host replay of the kernel's two regions (triton/kernels.py): query tiles skip
    # requests of <= dec_block_q tokens, the decode region takes exactly those; with
    # dec_splits programs per request, only split 0's share of the rows is counted.
    rng = random.Random(1)
    for _ in range(200):
        block_q = rng.choice([4, 8, 16, 32])
        dec_block_q = rng.choice([1, 2, 4])
        dec_splits = rng.choice([1, 2, 8])
        counts = [rng.choice([0, 1, 1, 2, 3, 4, 5, 17, 40]) for _ in range(rng.randint(1, 9))]
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        num_tokens, num_reqs = starts[-1] + rng.randint(0, 5), len(counts)
        num_tiles = num_tokens // block_q + num_reqs
        seen = []
        for program in range(num_tiles + num_reqs * dec_splits):
            if program >= num_tiles:
                req, split = divmod(program - num_tiles, dec_splits)
                num_q = counts[req]
                if num_q <= dec_block_q and split == 0:
                    seen += [starts[req] + i for i in range(num_q)]
                continue
            tile = num_tiles - 1 - program
            req = max(r for r in range(num_reqs) if starts[r] // block_q + r <= tile)
            if counts[req] <= dec_block_q:
                continue
            q_lo = (tile - (starts[req] // block_q + req)) * block_q
            seen += [starts[req] + i for i in range(q_lo, min(q_lo + block_q, counts[req]))]
        assert sorted(seen) == list(range(starts[-1])), (block_q, dec_block_q, counts)


def test_decode_region_config():
    def cfg(num_tokens, num_reqs, ctx=2048, sms=132):
        return attention.select_config(num_tokens, num_reqs, 32, 8, 128, 16, ctx // 16,
                                       torch.bfloat16, sms)

    mixed = cfg(2048 + 64, 65)
    decode_alone = cfg(64, 64)
    # The region is configured as the decodes' own launch would be.
    assert mixed.decode_region == attention.DecodeRegion(
        decode_alone.block_q, decode_alone.block_n, cfg(65, 65).num_splits,
        decode_alone.one_kv_loop)
    assert mixed.num_splits == 1 and mixed.decode_region.block_q < mixed.block_q
    assert cfg(2048, 1).decode_region is None  # one request: nothing to serve
    with pytest.MonkeyPatch.context() as mp:  # LLMFAST_ATTENTION_DECODE_REGION=0
        mp.setattr(attention_config, "_DECODE_REGION", False)
        assert cfg(2048 + 64, 65).decode_region is None
    assert cfg(64, 64).decode_region is None  # a decode launch is all decode tiles
    # A few decodes at a long context split their keys, as they would alone.
    few = cfg(4096 + 2, 3, ctx=8192)
    assert few.decode_region.num_splits == cfg(3, 3, ctx=8192).num_splits > 1


def test_split_heuristic():
    def cfg(num_reqs, ctx, num_tokens=None):
        return attention.select_config(
            num_tokens or num_reqs, num_reqs, 32, 8, 128, 16, ctx // 16, torch.bfloat16, 132
        )

    assert cfg(1, 8192).num_splits >= 16  # 8 programs alone would idle most SMs
    assert cfg(8, 2048).num_splits > 1
    assert cfg(64, 2048).num_splits == 1  # 512 programs already fill the GPU
    assert cfg(1, 64).num_splits == 1  # too short to be worth a merge
    prefill = cfg(1, 8192, num_tokens=2048)
    assert prefill.num_splits == 1 and prefill.block_q * 4 == 128


def test_opcheck_reference_ops(monkeypatch):
    # CPU reference path: checks schema, fake impls and the mutates_args declarations.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    b = make_batch(
        [(3, 1), (0, 4)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
        dtype=torch.float32, pad_tokens=1,
    )
    # NaN-free caches: opcheck compares outputs (and mutated inputs) between runs.
    k_cache = torch.nan_to_num(b["k_cache"])
    v_cache = torch.nan_to_num(b["v_cache"])
    out = torch.zeros_like(b["q"])
    torch.library.opcheck(
        torch.ops.llmfast.reshape_and_cache.default,
        (b["k"], b["v"], k_cache.clone(), v_cache.clone(), b["slot_mapping"]),
    )
    torch.library.opcheck(
        torch.ops.llmfast.unified_attention.default,
        (b["q"], b["k"], b["v"], k_cache, v_cache, b["slot_mapping"], b["block_table"],
         b["query_start_loc"], b["seq_lens"], b["scale"], out),
    )


def test_launch_path_compiles_for_sm90_and_reads_no_tensor_on_host(monkeypatch):
    # The interpreter checks numerics but not that the kernels compile for a GPU; this
    # compiles them (PTX and cubin) for an H100 through the real launch path, with every
    # way of reading a tensor value on the host disabled.
    compiled = compile_launches_only(monkeypatch)
    # Mixed batches whose decode region splits, beside query tiles of 8 warps and 3
    # stages, and of 4 stages (tuning candidates; the region takes their stages).
    region = attention.DecodeRegion(4, 128, 8)
    regions = [attention.AttentionConfig(32, 64, 1, 8, 3, decode_region=region),
               attention.AttentionConfig(16, 64, 1, 4, 4, decode_region=region),
               attention.AttentionConfig(32, 32, 1, 4, 4, decode_region=region)]
    batches = [  # (num_tokens, num_reqs, num_splits, fused_merge, config): decode with
        # splits (merged in the launch, or by the second kernel), without, prefill,
        # mixed batches with a decode region
        (8, 8, 8, True, None), (8, 8, 8, False, None), (64, 64, 1, True, None),
        (512, 2, 1, True, None), *((512, 9, None, True, cfg) for cfg in regions),
        # decode tiles walking their keys in one loop (DECODE_ONE_KV_LOOP's candidate)
        (8, 8, None, True, attention.AttentionConfig(4, 128, 8, 4, 3, one_kv_loop=True)),
    ]
    with offline_hopper():
        for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__index__"):
            monkeypatch.setattr(torch.Tensor, name, _no_host_read(name))
        for num_tokens, num_reqs, num_splits, fused_merge, config in batches:
            q = torch.empty(num_tokens, 32, 128, dtype=torch.bfloat16)
            k = torch.empty(num_tokens, 8, 128, dtype=torch.bfloat16)
            k_cache = torch.empty(4, 16, 8, 128, dtype=torch.bfloat16)
            block_table = torch.empty(num_reqs, 128, dtype=torch.int32)
            qsl = torch.empty(num_reqs + 1, dtype=torch.int32)
            seq_lens = torch.empty(num_reqs, dtype=torch.int32)
            slots = torch.empty(num_tokens, dtype=torch.int64)
            attention.reshape_and_cache(k, k, k_cache, k_cache, slots)
            attention.unified_attention(
                q, k_cache, k_cache, block_table, qsl, seq_lens, 0.1, q, num_splits=num_splits,
                fused_merge=fused_merge, config=config,
            )
        monkeypatch.undo()
    names = [name for name, _ in compiled]
    assert names.count("_unified_attention_kernel") == 8 and "_merge_splits_kernel" in names
    for name, kernel in compiled:
        assert "cubin" in kernel.asm, name
        assert kernel.metadata.shared <= 227 * 1024, (name, kernel.metadata.shared)


def test_batch_sizes_share_compiled_variants(monkeypatch):
    # A variant compiled after start-up costs a step ~1-2 s of Triton compilation: on an
    # H100 (2026-11-26) a mixed step of 2, 4, 8 or 16 requests took 1.9 s each while
    # the decode region's split count (16, 8, 4, 2 at those sizes) was a constexpr, and
    # offline throughput fell 3x. The split counts (and the block table's row stride) now
    # travel as unspecialized runtime arguments: every mixed launch of a model is one
    # variant, and every decode launch one (compiled with its split code, used or not;
    # so is the fused decode + RoPE kernel), whatever their request counts and
    # block tables (the start-up's memory profile launches 512 requests over a one-block
    # table, and must compile the variant the steps after it use). Compiled for sm_90,
    # with an H100's 132 SMs so that the heuristic picks every split count from 1 to 16.
    compiled = compile_launches_only(monkeypatch)
    monkeypatch.setattr(attention, "_num_sms", lambda device: 132)
    variants: dict[str, set] = {"decode": set(), "mixed": set(), "decode+rope": set()}
    wide = 512  # blocks per request: a block table 8192 keys wide (max_model_len)
    launches = [*(("decode", n, wide) for n in (1, 2, 3, 4, 8, 16, 32, 64, 256)),
                *(("mixed", n, wide) for n in (2, 3, 4, 8, 16, 32, 64, 256)),
                ("mixed", 512, 1),  # the memory profile's
                # uniform decode given its new tokens: the fused RoPE + KV-write kernel
                *(("decode+rope", n, wide) for n in (1, 2, 4, 16, 64, 256))]
    with offline_hopper():
        for kind, num_reqs, blocks_per_req in launches:
            num_tokens = num_reqs if kind != "mixed" else max(num_reqs - 1 + 300,
                                                              16 * num_reqs)
            qkv = torch.empty(num_tokens, 48, 64, dtype=torch.bfloat16)
            q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
            k_cache = torch.empty(4, 16, 8, 64, dtype=torch.bfloat16)
            block_table = torch.empty(num_reqs, blocks_per_req, dtype=torch.int32)
            qsl = torch.empty(num_reqs + 1, dtype=torch.int32)
            seq_lens = torch.empty(num_reqs, dtype=torch.int32)
            new_tokens = None
            if kind == "decode+rope":
                new_tokens = (k, v, torch.empty(num_tokens, dtype=torch.int64),
                              torch.empty(num_tokens, dtype=torch.int64),
                              torch.empty(8192, 64, dtype=torch.float32))
            before = len(compiled)
            attention.unified_attention(q, k_cache, k_cache, block_table, qsl, seq_lens,
                                        0.1, torch.empty_like(q), new_tokens=new_tokens,
                                        uniform_decode=new_tokens is not None)
            assert len(compiled) == before + 1  # one kernel, no second merge kernel
            variants[kind].add(compiled[-1][1].hash)
    monkeypatch.undo()
    assert len(variants["mixed"]) == 1
    assert len(variants["decode"]) == 1
    assert len(variants["decode+rope"]) == 1
    assert len(set.union(*variants.values())) == 3
    for name, kernel in compiled:
        assert "cubin" in kernel.asm and kernel.metadata.shared <= 227 * 1024, name


def compile_launches_only(monkeypatch) -> list[tuple[str, object]]:
    """Make every Triton launch compile (for the target `offline_hopper()` sets) instead
    of run, with the CUDA-only launchability check off; returns the list each compiled
    kernel goes to, as (kernel name, compiled kernel). Skips where that cannot work: a
    real GPU (the gpu tests compile for real), or an interpreted triton."""
    if torch.cuda.is_available():
        pytest.skip("the -m gpu tests compile and run the kernels for real")
    jit_function = triton.runtime.JITFunction
    if not isinstance(attention._unified_attention_kernel, jit_function):
        pytest.skip("triton was imported with TRITON_INTERPRET=1")
    compiled = []
    warmup_run = jit_function.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        assert all(isinstance(g, int) for g in grid)
        kernel = warmup_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))

    monkeypatch.setattr(jit_function, "run", compile_only)
    monkeypatch.setattr(attention, "check_launchable", lambda *args: None)
    monkeypatch.setattr(kv_write, "check_launchable", lambda *args: None)
    # Every launch through the JIT: a launcher an earlier test remembered would be called.
    for cache in (attention._ATTENTION_LAUNCHES, attention._DECODE_ROPE_LAUNCHES,
                  kv_write._KV_WRITE_LAUNCHES, rope_cache._LAUNCHES):
        monkeypatch.setattr(cache, "enabled", False)
    return compiled


def _no_host_read(name):
    def refuse(*args, **kwargs):
        raise AssertionError(f"Tensor.{name} called in the kernels' launch path")

    return refuse


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sweep(interpreter, dtype, group, block_size, head_dim):
    for kw in (dict(block_q=4), dict(), dict(num_splits=4)):
        interpreter(
            "check_mixed", dtype=dtype, group=group, head_dim=head_dim,
            block_size=block_size, **kw,
        )


if __name__ == "__main__":
    _serve()
