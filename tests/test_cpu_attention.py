"""The vectorised CPU attention equals the float64 reference."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from llmfast.attention import cpu as cpu_attention
from llmfast.attention.ops import paged_attention_reference
from llmfast.attention.workspaces import AttentionWorkspaces


def _case(seed: int, q_lens: list[int], ctx_lens: list[int], num_heads=6, num_kv=2, hd=16,
          block_size=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-c // block_size) for c in ctx_lens) + 1
    num_blocks = len(ctx_lens) * max_blocks + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv, hd, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv, hd, generator=g).to(dtype)
    table = (torch.randperm(num_blocks - 1, generator=g) + 1)[: len(ctx_lens) * max_blocks]
    table = table.view(len(ctx_lens), max_blocks).to(torch.int32)
    total = sum(q_lens)
    q = torch.randn(total + 3, num_heads, hd, generator=g).to(dtype)  # 3 padding rows
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    return q, k_cache, v_cache, table, qsl, seq_lens, total


def _reference(q, kc, vc, table, qsl, seq_lens, scale, window=None) -> torch.Tensor:
    """The float64 reference's output (rows past the batch's tokens stay NaN)."""
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    paged_attention_reference(q.double(), kc.double(), vc.double(), table, qsl, seq_lens,
                              scale, out, compute_dtype=torch.float64, window=window)
    return out


def _cpu_op(q, kc, vc, table, qsl, seq_lens, scale, window=None) -> torch.Tensor:
    """The CPU op's output, into a NaN-filled buffer (a row it skipped stays NaN)."""
    out = torch.full_like(q, float("nan"))
    cpu_attention.paged_attention_cpu(q, kc, vc, table, qsl, seq_lens, scale, out, window)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_matches_reference(seed, monkeypatch):
    # decodes (1 token), prefill chunks over cached prefixes, an idle row (0 tokens)
    q_lens = [1, 5, 1, 0, 9, 1]
    ctx = [17, 5, 40, 12, 30, 1]
    q, kc, vc, table, qsl, seq_lens, total = _case(seed, q_lens, ctx)
    expected = _reference(q, kc, vc, table, qsl, seq_lens, 0.25)
    # Force several decode chunks too.
    monkeypatch.setattr(cpu_attention, "_MAX_GATHER_ELEMENTS", 2000)  # (no owner: no memo)
    # Poison every cache slot past each request's context with stale finite garbage (the
    # runner zero-fills the cache, so stale slots are finite): it must not leak in.
    for r, n in enumerate(ctx):
        for pos in range(n, table.shape[1] * kc.shape[1]):
            block = int(table[r, pos // kc.shape[1]])
            kc[block, pos % kc.shape[1]] = 1e4
            vc[block, pos % kc.shape[1]] = -1e4
    out = _cpu_op(q, kc, vc, table, qsl, seq_lens, 0.25)
    torch.testing.assert_close(out[:total].double(), expected[:total], atol=1e-5, rtol=1e-5)


def test_bf16_matches_reference():
    q, kc, vc, table, qsl, seq_lens, total = _case(3, [1, 4, 1], [9, 20, 33], num_heads=8,
                                                   num_kv=1, dtype=torch.bfloat16)
    expected = _reference(q, kc, vc, table, qsl, seq_lens, 0.3)
    out = _cpu_op(q, kc, vc, table, qsl, seq_lens, 0.3)
    torch.testing.assert_close(out[:total].double(), expected[:total], atol=2e-2, rtol=2e-2)


def test_layers_sharing_a_plan_reuse_one_workspace_per_cache_shape():
    # Two caches with the same row size (2 x 16 vs 4 x 8 elements per slot) share the
    # step's plan: each must get gather buffers of its own shape, and every call (as
    # every layer of a step) must equal the reference though the buffers are reused.
    q_lens, ctx = [1, 3, 1], [9, 20, 33]
    cases = [_case(seed, q_lens, ctx, num_heads=8, num_kv=num_kv, hd=hd)
             for num_kv, hd, seed in [(2, 16, 5), (4, 8, 6), (2, 16, 7)]]
    owner = AttentionWorkspaces(case[1] for case in cases)  # as a runner owns its cache
    table = cases[0][3]
    for q, kc, vc, _, qsl, seq_lens, total in cases:
        expected = _reference(q, kc, vc, table, qsl, seq_lens, 0.3)
        out = _cpu_op(q, kc, vc, table, qsl, seq_lens, 0.3)
        torch.testing.assert_close(out[:total].double(), expected[:total], atol=1e-5, rtol=1e-5)
    assert owner.num_plans == 1  # the plan was shared
    (plan,) = owner._plans.values()
    assert len(plan.workspace) == 2  # gather buffers of each cache shape


def test_plans_and_their_buffers_die_with_the_owner():
    q, kc, vc, table, qsl, seq_lens, _ = _case(4, [1, 2], [10, 30])
    owner = AttentionWorkspaces([kc])
    out = torch.empty_like(q)
    cpu_attention.paged_attention_cpu(q, kc, vc, table, qsl, seq_lens, 0.3, out)
    (plan,) = owner._plans.values()
    refs = [weakref.ref(plan)] + [weakref.ref(buf) for buf in plan.workspace.values()]
    del owner, plan
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert AttentionWorkspaces.of(kc) is None


@pytest.mark.parametrize("window", [1, 7, 16, 29, 100])
def test_sliding_window_matches_reference_and_skips_old_blocks(window, monkeypatch):
    """Decodes, chunks over long prefixes, a fresh prefill longer than the window, an
    idle row: the windowed op equals the float64 reference with the window. Every block
    wholly before a row's first visible key is NaN: gathering it (masking instead of
    skipping) would poison the row."""
    q_lens = [1, 5, 1, 0, 30, 1, 2]
    ctx = [70, 45, 40, 12, 30, 1, 66]
    block_size = 8
    q, kc, vc, table, qsl, seq_lens, total = _case(4, q_lens, ctx, block_size=block_size)
    expected = _reference(q, kc, vc, table, qsl, seq_lens, 0.25, window)
    monkeypatch.setattr(cpu_attention, "_MAX_GATHER_ELEMENTS", 3000)  # several chunks
    poisoned = 0
    for r, (n, length) in enumerate(zip(q_lens, ctx)):
        first_key = max(0, length - n - window + 1)
        for block in table[r, : first_key // block_size].tolist():
            kc[block], vc[block] = float("nan"), float("nan")
            poisoned += 1
    assert poisoned > 0 or window == 100
    out = _cpu_op(q, kc, vc, table, qsl, seq_lens, 0.25, window)
    torch.testing.assert_close(out[:total].double(), expected[:total], atol=1e-5, rtol=1e-5)
    # A decode gathers at most the blocks its window spans.
    plan = cpu_attention._build_plan(
        qsl.numpy().tobytes(), seq_lens.numpy().tobytes(), table.numpy().tobytes(),
        tuple(table.shape), block_size, 2 * 16, window)
    assert all(c.num_blocks <= -(-window // block_size) + 1 for c in plan.decode)


def test_reference_window_is_hf_mask():
    """The reference's window is HF's sliding mask (kv_idx > q_idx - window, causal):
    checked against a naive loop over one request's scores."""
    q, kc, vc, table, qsl, seq_lens, total = _case(2, [6], [13], num_heads=2, num_kv=2,
                                                   block_size=4)
    window = 4
    out = _reference(q, kc, vc, table, qsl, seq_lens, 0.5, window)
    keys = kc.double()[table[0].long()].reshape(-1, 2, 16)[:13]
    values = vc.double()[table[0].long()].reshape(-1, 2, 16)[:13]
    for i in range(6):
        q_idx = 13 - 6 + i
        for h in range(2):
            seen = [k for k in range(13) if k <= q_idx and k > q_idx - window]
            scores = torch.stack([q[i, h].double() @ keys[k, h] * 0.5 for k in seen])
            expected = torch.softmax(scores, 0) @ values[seen, h]
            torch.testing.assert_close(out[i, h], expected)
