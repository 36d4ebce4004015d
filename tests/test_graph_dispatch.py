"""Which runner a step uses (full graph / piecewise graphs / none), its padding and
fallbacks, against a naive oracle; the capture context's GC freeze; the mode flag."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmfast.config import ConfigError, CudaGraphMode, parse_cuda_graph_mode
from llmfast.cuda_graphs.capture_context import graph_capture
from llmfast.cuda_graphs.dispatch import GraphDispatcher, RunnerKind, is_uniform_decode
from llmfast.utils.gc_freeze import active_holds
from tests.helpers.engine_config import engine_config

SIZES = (1, 2, 4, 8)


def _naive(mode: CudaGraphMode, sizes, max_reqs, num_tokens, num_reqs, uniform,
           piecewise_sizes=None):
    """The rule spelled out: smallest size >= n by a linear scan (piecewise graphs at
    `piecewise_sizes` when given)."""
    def smallest(cands):
        fits = [s for s in sorted(cands) if s >= num_tokens]
        return fits[0] if fits else None

    if uniform and mode in (CudaGraphMode.FULL_DECODE, CudaGraphMode.FULL_AND_PIECEWISE):
        full = smallest([s for s in sizes if s <= max_reqs])
        if full is not None:
            return RunnerKind.FULL, full, full
    if mode in (CudaGraphMode.PIECEWISE, CudaGraphMode.FULL_AND_PIECEWISE):
        padded = smallest(sizes if piecewise_sizes is None else piecewise_sizes)
        if padded is not None:
            return RunnerKind.PIECEWISE, padded, num_reqs
    return RunnerKind.NONE, num_tokens, num_reqs


def test_worked_example_of_the_module_doc():
    d = GraphDispatcher(CudaGraphMode.FULL_AND_PIECEWISE, SIZES, max_num_reqs=4)
    assert d.full_sizes == (1, 2, 4) and d.piecewise_sizes == SIZES
    step = d.dispatch(3, 3, True)
    assert (step.runner, step.descriptor.num_tokens, step.num_reqs) == (RunnerKind.FULL, 4, 4)
    assert step.descriptor.uniform_decode
    step = d.dispatch(3, 2, False)
    assert (step.runner, step.descriptor.num_tokens, step.num_reqs) == (RunnerKind.PIECEWISE, 4, 2)
    step = d.dispatch(6, 6, True)  # more decodes than any full graph holds
    assert (step.runner, step.descriptor.num_tokens, step.num_reqs) == (RunnerKind.PIECEWISE, 8, 6)
    step = d.dispatch(9, 3, False)
    assert (step.runner, step.descriptor.num_tokens, step.num_reqs) == (RunnerKind.NONE, 9, 3)


def test_piecewise_graphs_at_their_own_sizes():
    # --piecewise-graph-sizes 4,16: decodes keep every full size, steps with prefill
    # tokens pad to the piecewise graphs' coarser ones.
    d = GraphDispatcher(CudaGraphMode.FULL_AND_PIECEWISE, (1, 2, 4, 8, 16), 16, (4, 16))
    assert d.full_sizes == (1, 2, 4, 8, 16) and d.piecewise_sizes == (4, 16)
    assert d.dispatch(2, 2, True).descriptor.num_tokens == 2  # full graph of 2
    step = d.dispatch(5, 2, False)
    assert (step.runner, step.descriptor.num_tokens) == (RunnerKind.PIECEWISE, 16)
    assert d.dispatch(17, 2, False).runner is RunnerKind.NONE


def test_each_mode_uses_only_its_kinds():
    none = GraphDispatcher(CudaGraphMode.NONE, SIZES, 8)
    assert none.dispatch(3, 3, True).runner is RunnerKind.NONE
    assert none.padded_num_tokens(3, True) == 3
    piecewise = GraphDispatcher(CudaGraphMode.PIECEWISE, SIZES, 8)
    assert piecewise.dispatch(3, 3, True).runner is RunnerKind.PIECEWISE
    full = GraphDispatcher(CudaGraphMode.FULL_DECODE, SIZES, 8)
    assert full.dispatch(3, 3, True).runner is RunnerKind.FULL
    # Prefill tokens under full_decode: compiled, not padded.
    step = full.dispatch(3, 2, False)
    assert (step.runner, step.descriptor.num_tokens) == (RunnerKind.NONE, 3)
    with pytest.raises(ValueError, match="uniform decode"):
        full.dispatch(3, 2, True)


@settings(max_examples=300, deadline=None)
@given(mode=st.sampled_from(list(CudaGraphMode)),
       sizes=st.sets(st.integers(1, 64), max_size=8),
       max_reqs=st.integers(1, 64), num_tokens=st.integers(1, 80),
       num_reqs=st.integers(1, 80), uniform=st.booleans(),
       piecewise=st.none() | st.sets(st.integers(1, 64), max_size=5))
def test_dispatch_matches_naive_rule(mode, sizes, max_reqs, num_tokens, num_reqs, uniform,
                                     piecewise):
    if uniform:
        num_reqs = num_tokens
    d = GraphDispatcher(mode, tuple(sizes), max_reqs,
                        None if piecewise is None else tuple(piecewise))
    step = d.dispatch(num_tokens, num_reqs, uniform)
    want = _naive(mode, sizes, max_reqs, num_tokens, num_reqs, uniform, piecewise)
    assert (step.runner, step.descriptor.num_tokens, step.num_reqs) == want
    assert step.descriptor.num_tokens >= num_tokens
    if step.runner is RunnerKind.FULL:  # one row per token: padding rows never exceed it
        assert step.num_reqs == step.descriptor.num_tokens <= max_reqs


def test_uniform_decode_means_one_token_in_every_row():
    assert is_uniform_decode(np.array([1, 1, 1]))
    assert not is_uniform_decode(np.array([1, 2, 1]))
    assert not is_uniform_decode(np.array([1, 0, 1]))  # a row in the batch, not scheduled
    assert not is_uniform_decode(np.array([], dtype=np.int64))


def test_mode_names_and_errors():
    assert parse_cuda_graph_mode("full_decode") is CudaGraphMode.FULL_DECODE
    assert CudaGraphMode.FULL_AND_PIECEWISE.has_full and CudaGraphMode.FULL_AND_PIECEWISE.has_piecewise
    assert not CudaGraphMode.PIECEWISE.has_full and not CudaGraphMode.FULL_DECODE.has_piecewise
    with pytest.raises(ConfigError, match="unknown cuda graph mode 'full'"):
        parse_cuda_graph_mode("full")


def test_engine_args_turn_graphs_off_on_cpu_and_with_no_cuda_graphs():
    from llmfast.engine.args import EngineArgs

    for kw in ({}, {"cuda_graph_mode": "full_decode"}, {"cuda_graphs": False}):
        config, _ = engine_config(EngineArgs(model="random:tiny", device="cpu", compile=True,
                                             **kw))
        assert config.compile.cuda_graph_mode is CudaGraphMode.NONE
        assert not config.compile.use_cuda_graphs
    with pytest.raises(ConfigError, match="unknown cuda graph mode"):
        engine_config(EngineArgs(model="random:tiny", device="cpu", cuda_graph_mode="all"))


def test_capture_context_freezes_only_inside_and_keeps_an_outer_freeze():
    def check() -> None:
        # Finalise dead engines of earlier tests now (each releases its own hold), not in
        # the collection the capture's hold starts with.
        gc.collect()
        # An outer freeze: a plain gc.freeze(), or an engine's hold (an engine of an earlier
        # test still alive; conftest thaws the heap after each test, the hold stays).
        holds = active_holds()
        outer = gc.get_freeze_count() > 0 or holds > 0
        with graph_capture("test"):
            assert gc.get_freeze_count() > 0
            assert active_holds() == holds + 1
        assert active_holds() == holds
        # Thawed again only if the context froze. Under an outer freeze the count itself
        # may move (frozen temporaries are freed by reference counting), but it must not
        # be thawed.
        if outer:
            assert gc.get_freeze_count() > 0
        else:
            assert gc.get_freeze_count() == 0

    check()
    if gc.get_freeze_count() == 0:  # also the other case, then restore the state
        gc.freeze()
        try:
            check()
        finally:
            gc.unfreeze()
