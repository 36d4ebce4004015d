"""The cached launch path (kernels/launch_cache.py) against Triton's own JIT launch.

Triton compiles the attention kernel for sm_90 on this CPU (kernels/launch/offline_target.py)
and every launch is recorded instead of run. The oracle is the JIT path itself: for the
same arguments the cached path must hand the launcher the same compiled kernel and the
same arguments, and must compile anew exactly when Triton would specialize differently.
"""

from __future__ import annotations

import pytest
import torch
import triton

from llmfast.kernels import attention
from llmfast.kernels.launch import launch_cache
from llmfast.kernels.launch.offline_target import offline_hopper
from llmfast.kernels.workspaces import AttentionWorkspaces

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available()
    or not isinstance(attention._unified_attention_kernel, triton.runtime.JITFunction),
    reason="offline sm_90 compile: CPU machine, triton imported without TRITON_INTERPRET",
)


def step_inputs(num_tokens, num_reqs, table_width=128, q_offset=0):
    """Empty tensors shaped like one step (values are never read: nothing runs), the
    cache owned by workspaces as a runner's is (split partials reused between calls)."""
    q = torch.empty(num_tokens * 32 * 128 + q_offset, dtype=torch.bfloat16)
    q = q[q_offset:].view(num_tokens, 32, 128)
    k_cache = torch.empty(4, 16, 8, 128, dtype=torch.bfloat16)
    table = torch.empty(num_reqs, table_width, dtype=torch.int32)
    qsl = torch.empty(num_reqs + 1, dtype=torch.int32)
    seq_lens = torch.empty(num_reqs, dtype=torch.int32)
    return q, k_cache, table, qsl, seq_lens, AttentionWorkspaces([k_cache])


def call(inputs, **kw):
    q, k_cache, table, qsl, seq_lens, _ = inputs
    attention.unified_attention(q, k_cache, k_cache, table, qsl, seq_lens, 0.1, q, **kw)


@pytest.fixture
def recorded(monkeypatch):
    monkeypatch.setattr(attention, "check_launchable", lambda *args: None)
    monkeypatch.setattr(attention, "_ATTENTION_LAUNCHES",
                        launch_cache.LaunchCache(attention._unified_attention_kernel))
    with offline_hopper(record_launches=True) as launches:
        yield launches


def same_launch(a: tuple, b: tuple) -> bool:
    """Grid, stream, compiled function, packed metadata and every kernel argument (the
    launch metadata and hooks, positions 6-8, may differ: None vs empty hook chains)."""
    return len(a) == len(b) and all(
        x is y or (not isinstance(x, torch.Tensor) and x == y)
        for x, y in zip(a[:6] + a[9:], b[:6] + b[9:]))


@pytest.mark.parametrize("num_tokens, num_reqs, kw", [
    (1, 1, dict(num_splits=8)),  # batch-1 decode, splits merged in the launch
    (70, 5, {}),  # a mixed batch: a 66-token chunk and 4 decodes, one launch
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


def test_new_specialization_compiles_as_the_jit_would(recorded, monkeypatch):
    cache = attention._ATTENTION_LAUNCHES
    variants = [
        step_inputs(1, 1),
        step_inputs(1, 1, table_width=17),  # a block-table stride not divisible by 16
        step_inputs(1, 1, q_offset=1),  # q 2 bytes past a 16-byte boundary
        step_inputs(1, 1, table_width=64),  # same specialization as the first: a hit
    ]
    for inputs in variants:
        call(inputs)
    assert cache.compiled_launches == 3 and cache.fast_launches == 1
    fast = list(recorded)
    monkeypatch.setattr(cache, "enabled", False)
    for inputs in variants:
        call(inputs)
    jit = recorded[len(fast):]
    for f, j in zip(fast, jit):
        assert same_launch(f, j)
    functions = [launch[4] for launch in fast]
    assert len(set(functions[:3])) == 3 and functions[3] == functions[0]


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
    # would tune nothing: each compiles for sm_90 within the H100's shared memory.
    from llmfast.kernels.tuning.prefill_tuning import CANDIDATES

    compiled = []
    run = triton.runtime.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        compiled.append(run(self, *args, grid=grid, warmup=True, **kwargs))

    monkeypatch.setattr(triton.runtime.JITFunction, "run", compile_only)
    monkeypatch.setattr(attention, "check_launchable", lambda *args: None)
    with offline_hopper():
        for tiles in CANDIDATES:
            q = torch.empty(2048, 32, head_dim, dtype=torch.bfloat16)
            k_cache = torch.empty(4, 16, 8, head_dim, dtype=torch.bfloat16)
            table = torch.empty(1, 128, dtype=torch.int32)
            attention.unified_attention(q, k_cache, k_cache, table,
                                        torch.empty(2, dtype=torch.int32),
                                        torch.empty(1, dtype=torch.int32), 0.1, q,
                                        prefill_tiles=tiles)
    assert len(compiled) == len(CANDIDATES)
    for tiles, kernel in zip(CANDIDATES, compiled):
        assert kernel.metadata.shared <= 227 * 1024, (tiles, kernel.metadata.shared)
