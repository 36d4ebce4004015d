"""The cached launch path (kernels/launch/launch_cache.py) against Triton's own JIT launch.

Triton compiles the attention kernel for sm_90 on this CPU (kernels/launch/offline_target.py)
and every launch is recorded instead of run. The oracle is the JIT path itself: for the
same arguments the cached path must hand the launcher the same compiled kernel and the
same arguments, and must compile anew exactly when Triton would specialize differently.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

from llmfast.attention.triton import launch as attention
from llmfast.attention.triton import kv_write
from llmfast.kernels.launch import launch_cache
from llmfast.kernels.launch.offline_target import offline_hopper
from llmfast.attention.workspaces import AttentionWorkspaces

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available()
    or not isinstance(attention._unified_attention_kernel, triton.runtime.JITFunction),
    reason="offline sm_90 compile: CPU machine, triton imported without TRITON_INTERPRET",
)


def step_inputs(num_tokens, num_reqs, table_width=128, q_offset=0, table_dtype=torch.int32,
                qsl_dtype=torch.int32, lens_dtype=torch.int32, out_dtype=None, heads=32,
                kv_heads=8):
    """Empty tensors shaped like one step (values are never read: nothing runs), the
    cache owned by workspaces as a runner's is (split partials reused between calls).
    The output is q itself unless `out_dtype` asks for a tensor of its own."""
    q = torch.empty(num_tokens * heads * 128 + q_offset, dtype=torch.bfloat16)
    q = q[q_offset:].view(num_tokens, heads, 128)
    k_cache = torch.empty(4, 16, kv_heads, 128, dtype=torch.bfloat16)
    table = torch.empty(num_reqs, table_width, dtype=table_dtype)
    qsl = torch.empty(num_reqs + 1, dtype=qsl_dtype)
    seq_lens = torch.empty(num_reqs, dtype=lens_dtype)
    out = q if out_dtype is None else torch.empty(q.shape, dtype=out_dtype)
    return q, k_cache, table, qsl, seq_lens, AttentionWorkspaces([k_cache]), out


def call(inputs, **kw):
    q, k_cache, table, qsl, seq_lens, _, out = inputs
    attention.unified_attention(q, k_cache, k_cache, table, qsl, seq_lens, 0.1, out, **kw)


def _record_launches(monkeypatch, module, cache_name: str, kernel):
    """Fixture body: `module`'s launches of `kernel` through a fresh LaunchCache,
    recorded by the offline sm_90 target (launchability check off)."""
    monkeypatch.setattr(module, "check_launchable", lambda *args: None)
    monkeypatch.setattr(module, cache_name, launch_cache.LaunchCache(kernel))
    with offline_hopper(record_launches=True) as launches:
        yield launches


@pytest.fixture
def recorded(monkeypatch):
    yield from _record_launches(monkeypatch, attention, "_ATTENTION_LAUNCHES",
                                attention._unified_attention_kernel)


def same_launch(a: tuple, b: tuple) -> bool:
    """Grid, stream, compiled function, packed metadata and every kernel argument (the
    launch metadata and hooks, positions 6-8, may differ: None vs empty hook chains). A
    tensor argument is the tensor itself or its address (what the cached path passes)."""
    return len(a) == len(b) and all(
        _same_argument(x, y) for x, y in zip(a[:6] + a[9:], b[:6] + b[9:]))


def _same_argument(x, y) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x is y
    x, y = (t.data_ptr() if isinstance(t, torch.Tensor) else t for t in (x, y))
    return x == y


def tensor_positions(launch: tuple) -> list[int]:
    return [i for i, x in enumerate(launch) if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("num_tokens, num_reqs, kw", [
    (1, 1, dict(num_splits=8)),  # batch-1 decode, splits merged in the launch
    (70, 5, {}),  # a mixed batch: a 66-token chunk and 4 decodes, one launch
    (70, 5, dict(config=attention.AttentionConfig(  # ... its decodes' region split
        32, 64, 1, 8, 3, decode_region=attention.DecodeRegion(4, 128, 4)))),
    (1, 1, {}),  # the heuristic's split count
    (8, 8, dict(num_splits=4)),  # batch-8 decode
    (3, 3, dict(num_splits=2)),  # partials' second stats row 16-byte aligned: no
    (16, 8, dict(block_q=4)),  # decode-like, two tokens per request
    (512, 1, {}),  # a prefill
])
def test_cached_launch_passes_what_the_jit_launch_passes(recorded, monkeypatch, num_tokens,
                                                          num_reqs, kw):
    cache = attention._ATTENTION_LAUNCHES
    inputs = step_inputs(num_tokens, num_reqs)
    call(inputs, **kw)  # miss: the JIT path compiles, launches and is remembered
    assert cache.compiled_launches == 1 and cache.fast_launches == 0
    call(inputs, **kw)  # hit: the launcher directly
    assert cache.compiled_launches == 1 and cache.fast_launches == 1
    monkeypatch.setattr(cache, "enabled", False)
    call(inputs, **kw)  # the JIT path again, for comparison
    assert len(recorded) == 3  # one launch per call: no merge kernel, mixed or not
    jit, fast, jit_again = recorded
    assert same_launch(fast, jit) and same_launch(jit_again, jit)
    # The cached path hands the launcher addresses, which it takes as they are, where
    # the JIT hands it tensors (whose address it reads and has the driver check).
    assert tensor_positions(jit) and not tensor_positions(fast)


def test_cached_launch_passes_the_tensors_when_asked(recorded, monkeypatch):
    # raw_pointers off: what bench_kernels.py times against (the launcher's own checks).
    cache = attention._ATTENTION_LAUNCHES
    monkeypatch.setattr(cache, "raw_pointers", False)
    inputs = step_inputs(8, 8)
    call(inputs, num_splits=4)
    call(inputs, num_splits=4)
    assert cache.fast_launches == 1
    jit, fast = recorded
    assert tensor_positions(fast) == tensor_positions(jit) != []
    assert all(fast[i] is jit[i] for i in tensor_positions(jit))


@pytest.fixture
def recorded_rope(monkeypatch):
    yield from _record_launches(monkeypatch, attention, "_DECODE_ROPE_LAUNCHES",
                                attention._decode_rope_attention_kernel)


@pytest.mark.parametrize("num_reqs, num_splits", [(1, 8), (1, None), (8, 4), (64, 1)])
def test_cached_decode_rope_launch_passes_what_the_jit_launch_passes(
        recorded_rope, monkeypatch, num_reqs, num_splits):
    # The fused decode + RoPE kernel's launch: its five more tensors and strides.
    cache = attention._DECODE_ROPE_LAUNCHES
    qkv = torch.empty(num_reqs, 48, 128, dtype=torch.bfloat16)
    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
    # (The workspaces kept alive: they own the cache's split scratch, reused per call.)
    _, k_cache, table, qsl, seq_lens, workspaces, _ = step_inputs(num_reqs, num_reqs)
    new_tokens = (k, v, torch.empty(num_reqs, dtype=torch.int64),
                  torch.empty(num_reqs, dtype=torch.int64),
                  torch.empty(4096, 128, dtype=torch.float32))
    out = torch.empty_like(q)

    def launch():
        attention.unified_attention(q, k_cache, k_cache, table, qsl, seq_lens, 0.1, out,
                                    num_splits=num_splits, new_tokens=new_tokens,
                                    uniform_decode=True)

    launch()
    launch()
    assert cache.compiled_launches == 1 and cache.fast_launches == 1
    monkeypatch.setattr(cache, "enabled", False)
    launch()
    assert len(recorded_rope) == 3
    jit, fast, jit_again = recorded_rope
    assert same_launch(fast, jit) and same_launch(jit_again, jit)
    assert workspaces is not None


def test_padded_uniform_decode_is_configured_as_decode(recorded_rope, monkeypatch):
    """A uniform decode step padded past twice its requests (3 rows to a graph size of
    64 tokens: a sparse --cuda-graph-sizes) takes the decode launch its 3 rows would:
    decode tiles, the table's splits and the one compiled decode variant, never prefill
    tiles (nor their tuning)."""
    monkeypatch.setattr(attention, "_prefill_tiles",
                        lambda *a: pytest.fail("a decode step looked up prefill tiles"))
    _, k_cache, table, qsl, seq_lens, workspaces, _ = step_inputs(64, 3)
    qkv = torch.empty(64, 48, 128, dtype=torch.bfloat16)
    q, k, v = qkv[:, :32], qkv[:, 32:40], qkv[:, 40:]
    new_tokens = (k, v, torch.empty(64, dtype=torch.int64), torch.empty(64, dtype=torch.int64),
                  torch.empty(4096, 128, dtype=torch.float32))
    before = set(map(id, attention._PLANS.values()))

    def fresh_plan(**kw):
        attention.unified_attention(q, k_cache, k_cache, table, qsl, seq_lens, 0.1,
                                    torch.empty_like(q), **kw)
        plans = [p for p in attention._PLANS.values() if id(p) not in before]
        before.update(map(id, plans))
        assert len(plans) == 1
        return plans[0]

    padded = fresh_plan(new_tokens=new_tokens, uniform_decode=True)
    unpadded = attention._plan(q[:3], k_cache, k_cache, table, q[:3], 3, None, None, True,
                               None, rope=tuple(t[:3] if t.shape[0] == 64 else t
                                                for t in new_tokens))
    assert padded.rope and padded.constexprs == unpadded.constexprs
    assert padded.split_counts == unpadded.split_counts
    assert padded.grid == unpadded.grid == (3, 8, padded.split_counts[0])
    # Told nothing of its rows, 64 tokens over 3 requests is prefill-like.
    prefill = fresh_plan()
    assert prefill.constexprs["BLOCK_Q"] > padded.constexprs["BLOCK_Q"]
    assert workspaces is not None


def _cached_again_equal_jit(variants, cache, recorded, monkeypatch) -> list:
    """After one round of `variants` (2 splits): a second round, recorded, then a third
    through Triton's JIT (the cache left off); each second-round launch must equal the JIT's.
    Returns the second round's launches."""
    start = len(recorded)
    for inputs in variants:
        call(inputs, num_splits=2)
    fast = list(recorded[start:])
    monkeypatch.setattr(cache, "enabled", False)
    for inputs in variants:
        call(inputs, num_splits=2)
    jit = recorded[start + len(variants):]
    assert len(jit) == len(fast) == len(variants)
    for f, j in zip(fast, jit):
        assert same_launch(f, j)
    return fast


def test_new_specialization_compiles_as_the_jit_would(recorded, monkeypatch):
    cache = attention._ATTENTION_LAUNCHES
    variants = [
        step_inputs(1, 1),
        # A block-table row stride not divisible by 16: a key of its own for the launch
        # cache (strides are in its key), the same kernel (the kernel does not specialize
        # on that stride: triton/kernels.py).
        step_inputs(1, 1, table_width=17),
        step_inputs(1, 1, q_offset=1),  # q 2 bytes past a 16-byte boundary
        step_inputs(1, 1, table_width=64),  # same specialization as the first: a hit
        # The split partials' sum buffer 24 bytes into its allocation (2 splits x 3
        # heads): not 16-byte aligned, Triton specializes it so.
        step_inputs(1, 1, heads=3, kv_heads=1),
        step_inputs(1, 1, heads=4, kv_heads=1),  # 32 bytes in: aligned
    ]
    for inputs in variants:
        call(inputs, num_splits=2)
    assert cache.compiled_launches == 5 and cache.fast_launches == 1
    # All hits now, each its own specialization.
    fast = _cached_again_equal_jit(variants, cache, recorded, monkeypatch)
    assert cache.compiled_launches == 5 and cache.fast_launches == 1 + len(variants)
    functions = [launch[4] for launch in fast]
    assert functions[0] == functions[1] == functions[3] != functions[2]
    assert len(set(functions)) == 4


def test_every_tensor_dtype_is_part_of_the_planned_launch(recorded, monkeypatch):
    # The plan stands for the tensors' dtypes in the launch key (LaunchCache.
    # launch_planned reads only addresses per call): a dtype Triton specializes on that
    # the plan key missed would launch the wrong compiled kernel. Oracle: the JIT path.
    cache = attention._ATTENTION_LAUNCHES
    variants = [
        step_inputs(1, 1),
        step_inputs(1, 1, table_dtype=torch.int64),
        step_inputs(1, 1, qsl_dtype=torch.int64),
        step_inputs(1, 1, lens_dtype=torch.int64),
        step_inputs(1, 1, out_dtype=torch.float32),
    ]
    for inputs in variants:
        call(inputs, num_splits=2)
    assert cache.compiled_launches == len(variants) and cache.fast_launches == 0
    fast = _cached_again_equal_jit(variants, cache, recorded, monkeypatch)
    assert cache.compiled_launches == len(variants) and cache.fast_launches == len(variants)
    assert len({launch[4] for launch in fast}) == len(variants)


def test_cached_plans_equal_fresh_ones(recorded, monkeypatch):
    # The plan cache's oracle is the plan computed anew: over an interleaved mix of
    # shapes (each seen again after others), the plan a launch used is field for field
    # the one _plan makes from the same arguments now.
    cache = attention._ATTENTION_LAUNCHES
    used = []
    launch_planned = cache.launch_planned
    monkeypatch.setattr(cache, "launch_planned",
                        lambda plan, *rest: used.append(plan) or launch_planned(plan, *rest))
    shapes = [(1, 1, {}), (8, 8, {}), (1, 1, dict(num_splits=4)), (70, 5, {}),
              (4, 4, dict(block_q=1)), (1, 1, dict(num_splits=4, fused_merge=False)),
              (3, 3, {})]
    inputs = {i: step_inputs(n, r, table_width=16 * (i + 1)) for i, (n, r, _) in
              enumerate(shapes)}
    order = [0, 1, 2, 0, 3, 1, 4, 5, 6, 2, 6, 0, 4, 3, 5]
    for i in order:
        call(inputs[i], **shapes[i][2])
    assert len(used) == len(order)
    for i, plan in zip(order, used):
        q, k_cache, table, _, seq_lens, _, out = inputs[i]
        kw = shapes[i][2]
        fresh = attention._plan(q, k_cache, k_cache, table, out, seq_lens.shape[0],
                                kw.get("num_splits"), kw.get("block_q"),
                                kw.get("fused_merge", True), None)
        for field in dataclasses.fields(plan):
            assert getattr(plan, field.name) == getattr(fresh, field.name), (i, field.name)
    assert len({id(p) for p in used}) == len(shapes)  # each shape's plan made once


def test_a_scale_of_another_type_takes_the_specializing_path(recorded):
    # launch_planned assumes the scale scalar is a float; anything else goes through
    # the specialization key (a numpy float: unmodelled, the JIT path every time).
    np = pytest.importorskip("numpy")
    cache = attention._ATTENTION_LAUNCHES
    q, k_cache, table, qsl, seq_lens, _, out = inputs = step_inputs(1, 1)
    call(inputs)
    attention.unified_attention(q, k_cache, k_cache, table, qsl, seq_lens, np.float64(0.1),
                                out)
    assert cache.fast_launches == 0 and cache.compiled_launches == 1
    assert len(recorded) == 2 and same_launch(recorded[0], recorded[1])


def kv_write_inputs(num_tokens, k_offset=0, heads=8, cache_dtype=torch.bfloat16,
                    rows=None):
    """k and v ([rows or num_tokens, heads, 128], k `k_offset` elements past an
    allocation's start), caches and slots, empty (nothing runs)."""
    rows = rows or num_tokens
    k = torch.empty(rows * heads * 128 + k_offset, dtype=torch.bfloat16)
    k = k[k_offset:].view(rows, heads, 128)
    v = torch.empty(rows, heads, 128, dtype=torch.bfloat16)
    k_cache = torch.empty(4, 16, heads, 128, dtype=cache_dtype)
    v_cache = torch.empty(4, 16, heads, 128, dtype=cache_dtype)
    return k, v, k_cache, v_cache, torch.empty(num_tokens, dtype=torch.int64)


@pytest.fixture
def recorded_kv_write(monkeypatch):
    yield from _record_launches(monkeypatch, kv_write, "_KV_WRITE_LAUNCHES",
                                kv_write._reshape_and_cache_kernel)


def test_kv_write_planned_launch_passes_what_the_jit_launch_passes(recorded_kv_write,
                                                                   monkeypatch):
    cache = kv_write._KV_WRITE_LAUNCHES
    variants = [
        kv_write_inputs(1),
        kv_write_inputs(7),  # another plan (grid), the first's specialization: a hit
        kv_write_inputs(1, k_offset=1),  # k 2 bytes past a 16-byte boundary
        kv_write_inputs(1, heads=3),  # strides not divisible by 16
        kv_write_inputs(1, cache_dtype=torch.float8_e4m3fn),  # clamped, converted
        kv_write_inputs(2, rows=5),  # more rows than slots (not written): a hit
        kv_write_inputs(2),  # a hit
    ]
    for inputs in variants:
        kv_write.reshape_and_cache(*inputs)
    assert cache.compiled_launches == 4 and cache.fast_launches == 3
    for inputs in variants:
        kv_write.reshape_and_cache(*inputs)
    assert cache.compiled_launches == 4 and cache.fast_launches == 3 + len(variants)
    fast = list(recorded_kv_write[len(variants):])
    monkeypatch.setattr(cache, "enabled", False)
    for inputs in variants:
        kv_write.reshape_and_cache(*inputs)
    jit = recorded_kv_write[2 * len(variants):]
    assert len(jit) == len(fast) == len(variants)
    for f, j in zip(fast, jit):
        assert same_launch(f, j)
    assert [launch[:3] for launch in fast] == [(n, 1, 1) for n in (1, 7, 1, 1, 1, 2, 2)]


def test_kv_write_plan_keeps_the_checks(recorded_kv_write):
    k, v, k_cache, v_cache, slots = kv_write_inputs(4)
    with pytest.raises(ValueError, match="4 slots for 2 keys"):
        kv_write.reshape_and_cache(k[:2], v, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="4 slots for 4 keys and 3 values"):
        kv_write.reshape_and_cache(k, v[:3], k_cache, v_cache, slots)
    kv_write.reshape_and_cache(k, v, k_cache, v_cache, slots[:0])  # no tokens: no launch
    assert not recorded_kv_write


def test_specialization_key():
    t = torch.empty(8, dtype=torch.float16)
    key = launch_cache.specialization_key((t, t[1:]), (1, 16, 17, 2**40, 2**63, 0.5))
    assert key == ((torch.float16, torch.float16), (True, False), (
        (True, False, 0), (False, True, 0), (False, False, 0), (False, True, 1),
        (False, True, 2), float))
    assert launch_cache.specialization_key((t,), ("text",)) is None  # unmodelled: JIT path


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [64, 128])
def test_every_tile_candidate_fits_an_h100(monkeypatch, head_dim):
    # The tuner skips candidates that fail, but a search space of mostly failing ones
    # would tune nothing: each compiles for sm_90 within the H100's shared memory, for
    # one request (causal) and for several (mixed: with the decode region's programs,
    # whose decode tiles take the candidate's warps and stages).
    from llmfast.attention.tuning.prefill_tuning import CANDIDATES

    compiled = []
    run = triton.runtime.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        compiled.append(run(self, *args, grid=grid, warmup=True, **kwargs))

    monkeypatch.setattr(triton.runtime.JITFunction, "run", compile_only)
    monkeypatch.setattr(attention, "check_launchable", lambda *args: None)
    cases = [(tiles, num_reqs) for tiles in CANDIDATES for num_reqs in (1, 9)]
    with offline_hopper():
        for tiles, num_reqs in cases:
            q = torch.empty(2048, 32, head_dim, dtype=torch.bfloat16)
            k_cache = torch.empty(4, 16, 8, head_dim, dtype=torch.bfloat16)
            table = torch.empty(num_reqs, 128, dtype=torch.int32)
            attention.unified_attention(q, k_cache, k_cache, table,
                                        torch.empty(num_reqs + 1, dtype=torch.int32),
                                        torch.empty(num_reqs, dtype=torch.int32), 0.1, q,
                                        prefill_tiles=tiles)
    assert len(compiled) == len(cases)
    for case, kernel in zip(cases, compiled):
        assert kernel.metadata.shared <= 227 * 1024, (case, kernel.metadata.shared)
