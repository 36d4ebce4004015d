"""The attention launch's scratch: AttentionWorkspaces.split_scratch (one call for the
split partials and the arrival counters) against the two separate calls it stands for,
and where a split launch takes its scratch from (the owner's, or fresh under capture)."""

from __future__ import annotations

import dataclasses

import torch

from llmfast.attention.triton import launch as attention
from llmfast.attention.workspaces import AttentionWorkspaces

CPU = torch.device("cpu")


def test_split_scratch_is_partials_and_arrivals():
    # Oracle: the same sequence through partials() and arrivals() on a twin owner; both
    # must hand out buffers alike (same reuse) and evict alike (same LRU order).
    fast_cache, slow_cache = torch.empty(4, 16, 2, 64), torch.empty(4, 16, 2, 64)
    fast = AttentionWorkspaces([fast_cache], max_shapes=3)
    slow = AttentionWorkspaces([slow_cache], max_shapes=3)
    calls = [((2, 1, 8, 64), 4), ((4, 3, 8, 64), 0), ((2, 1, 8, 64), 4), ((8, 1, 8, 64), 2),
             ((2, 5, 8, 64), 6), ((4, 3, 8, 64), 4), ((2, 1, 8, 64), 4), ((8, 2, 8, 64), 0)]
    fast_seen, slow_seen = [], []
    for shape, n in calls:
        partials, arrivals = fast.split_scratch(CPU, shape, n)
        fast_seen.append((*partials, arrivals))
        expected = slow.partials(CPU, *shape)
        slow_seen.append((*expected, slow.arrivals(CPU, n) if n else None))
        assert [p.shape for p in partials] == [p.shape for p in expected]
        assert (arrivals is None) == (n == 0)
        if n:
            assert arrivals.numel() >= n and arrivals.dtype == torch.int32
            assert not arrivals.any()
    for i in range(len(calls)):  # reuse: call i got call j's buffer exactly when slow did
        for j in range(i):
            for a, b, c, d in zip(fast_seen[i], fast_seen[j], slow_seen[i], slow_seen[j]):
                assert (a is not None and a is b) == (c is not None and c is d), (i, j)
    assert list(fast._partials) == list(slow._partials)
    assert fast._arrivals.numel() == slow._arrivals.numel()
    assert fast.num_arrival_buffers == slow.num_arrival_buffers == 2  # 4, then grown to 8


def _split_plan(**changes):
    q = torch.empty(1, 8, 64)
    k_cache = torch.empty(4, 16, 2, 64)
    table = torch.empty(1, 8, dtype=torch.int32)
    plan = attention._plan(q, k_cache, k_cache, table, q, 1, 4, None, True, None)
    assert plan.scratch_splits == 4 and plan.fused
    return dataclasses.replace(plan, **changes)


def test_split_launch_scratch_comes_from_the_owner(monkeypatch):
    k_cache = torch.empty(4, 16, 2, 64)
    owner = AttentionWorkspaces([k_cache])
    plan = _split_plan()
    first = attention._split_scratch(plan, k_cache)
    assert all(a is b for a, b in zip(first, attention._split_scratch(plan, k_cache)))
    assert owner.num_partials == 1 and owner.num_arrival_buffers == 1
    assert first[3].numel() >= plan.num_arrivals
    unfused = attention._split_scratch(dataclasses.replace(plan, fused=False), k_cache)
    assert unfused[3] is None and all(a is b for a, b in zip(first[:3], unfused[:3]))
    # Nobody owns this cache: fresh scratch each call, counters zeroed.
    other = torch.empty(4, 16, 2, 64)
    a, b = attention._split_scratch(plan, other), attention._split_scratch(plan, other)
    assert all(x is not y for x, y in zip(a, b)) and not a[3].any()


def test_split_launch_scratch_is_fresh_while_a_graph_is_captured(monkeypatch):
    # A CUDA plan under capture takes fresh buffers (the graph's pool) and, until an
    # eager launch made the owner's, fresh zeroed counters; outside capture the owner's. The capture state is
    # stood in for (no GPU here); the device check is the plan's.
    k_cache = torch.empty(4, 16, 2, 64)
    owner = AttentionWorkspaces([k_cache])
    plan = _split_plan(is_cuda=True)
    capturing = [True]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    captured = attention._split_scratch(plan, k_cache)
    assert owner.num_partials == 0 and owner.num_arrival_buffers == 0
    assert captured[3].numel() == plan.num_arrivals and not captured[3].any()
    again = attention._split_scratch(plan, k_cache)
    assert all(x is not y for x, y in zip(captured, again))
    capturing[0] = False
    eager = attention._split_scratch(plan, k_cache)
    assert owner.num_partials == 1 and owner.num_arrival_buffers == 1
    assert all(x is not y for x, y in zip(captured, eager))
    # Once the owner has counters enough (an eager launch made them, or the runner
    # reserved them), a capture takes those (zero between launches: no memset in the
    # graph); the partials stay fresh. Outgrown counters are kept (a graph holds them).
    capturing[0] = True
    after_warmup = attention._split_scratch(plan, k_cache)
    assert after_warmup[3] is eager[3]
    assert all(x is not y for x, y in zip(after_warmup[:3], eager[:3]))
    capturing[0] = False
    for n in range(1, 3 * owner.max_shapes):
        owner.arrivals(CPU, 1000 + n)
    assert any(c is eager[3] for c in owner._outgrown_arrivals)
    grown = owner.existing_arrivals(plan.num_arrivals)
    assert grown is not eager[3] and grown.numel() >= 1000 + 3 * owner.max_shapes - 1
    assert not grown.any()
    # A CPU plan never asks (torch without CUDA raises there).
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing",
                        lambda: (_ for _ in ()).throw(AssertionError("asked")))
    attention._split_scratch(_split_plan(), k_cache)


def test_reserved_counters_serve_every_capture(monkeypatch):
    """The runner reserves `arrivals_bound` counters with its KV cache: every split
    launch its steps can make (here _plan's num_arrivals over token and request counts
    up to the bound's, decode-like and mixed) then finds them while a CUDA graph is
    captured, so no graph records a memset of its own."""
    from llmfast.attention.workspaces import arrivals_bound

    max_tokens, max_reqs, kv_heads = 64, 16, 2
    k_cache = torch.empty(4, 16, kv_heads, 64)
    owner = AttentionWorkspaces([k_cache])
    owner.arrivals(CPU, arrivals_bound(max_tokens, max_reqs, kv_heads))
    reserved = owner.existing_arrivals(1)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    checked = 0
    for num_reqs in (1, 3, 8, max_reqs):
        for num_tokens in sorted({num_reqs, 2 * num_reqs, 3 * num_reqs, max_tokens}):
            if num_tokens > max_tokens:
                continue
            for splits, block_q in ((4, 1), (8, None), (None, None)):
                q = torch.empty(num_tokens, 8, 64)
                table = torch.empty(num_reqs, 8, dtype=torch.int32)
                plan = attention._plan(q, k_cache, k_cache, table, q, num_reqs, splits,
                                       block_q, True, None)
                if not plan.fused:
                    continue
                plan = dataclasses.replace(plan, is_cuda=True)
                assert attention._split_scratch(plan, k_cache)[3] is reserved
                checked += 1
    assert checked > 10 and owner.num_arrival_buffers == 1
