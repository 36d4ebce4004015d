"""CUDA graphs for speculative decoding's verify step: the dispatch rule for uniform
steps of 1 + K query tokens per request (sizes, padding, request rows, graph keys), and
the full-graph path through the real engine on CPU with emulated graphs (capture runs
the forward once; replay re-runs it on the capture-time buffers, inputs checked for
static addresses), greedy tokens equal to HF's."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from llmfast import SamplingParams
from llmfast.config import CudaGraphMode
from llmfast.cuda_graphs.dispatch import (
    GraphDispatcher,
    RunnerKind,
    spec_full_sizes,
    uniform_query_len,
)
from llmfast.engine import LLMEngine
from llmfast.engine.args import EngineArgs
from llmfast.worker.spec_decode.replay_proposer import ReplayProposer
from tests.helpers.engine_config import engine_config

MODE = CudaGraphMode.FULL_AND_PIECEWISE


def naive_spec_sizes(sizes, q, max_reqs):
    out = set()
    for s in sizes:
        r = s
        while r % q:
            r += 1
        if r <= max_reqs * q and r <= max(sizes):
            out.add(r)
    return tuple(sorted(out))


@pytest.mark.parametrize("q", [2, 3, 4, 5, 9])
@pytest.mark.parametrize("max_reqs", [1, 4, 6, 64])
def test_spec_sizes_match_naive(q, max_reqs):
    sizes = (1, 2, 4) + tuple(range(8, 256, 8)) + tuple(range(256, 513, 16))
    got = spec_full_sizes(sizes, q, max_reqs)
    assert got == naive_spec_sizes(sizes, q, max_reqs)
    assert all(s % q == 0 for s in got)


def test_uniform_query_len():
    assert uniform_query_len(np.array([1, 1, 1])) == 1
    assert uniform_query_len(np.array([4, 4])) == 4
    assert uniform_query_len(np.array([4, 3])) == 0
    assert uniform_query_len(np.array([0, 0])) == 0
    assert uniform_query_len(np.array([], dtype=np.int64)) == 0


def test_verify_dispatch():
    """The module doc's example, q = 3, sizes (1, 2, 4, 8), max_num_seqs 4."""
    d = GraphDispatcher(MODE, (1, 2, 4, 8), 4, spec_query_len=3)
    assert d.spec_full_sizes == (3, 6)
    assert d.full_graph_keys == (1, 2, 4, (3, 3), (6, 3))
    for num_reqs, want_size in ((1, 3), (2, 6)):
        step = d.dispatch(3 * num_reqs, num_reqs, False, 3)
        assert step.runner is RunnerKind.FULL
        assert step.descriptor.num_tokens == want_size and step.num_reqs == want_size // 3
        assert step.descriptor.graph_key == (want_size, 3)
    # Too large for every verify graph (9 > 8): not even piecewise.
    assert d.dispatch(9, 3, False, 3).runner is RunnerKind.NONE
    # Mixed query lengths: piecewise at the padded size, the live rows.
    mixed = d.dispatch(4, 2, False, 0)
    assert (mixed.runner, mixed.descriptor.num_tokens, mixed.num_reqs) == (
        RunnerKind.PIECEWISE, 4, 2)
    # A uniform step of another length than 1 + K (drafts cut by the budget): piecewise.
    assert d.dispatch(4, 2, False, 2).runner is RunnerKind.PIECEWISE
    # A plain decode keeps its own graphs, keyed by size alone: the decode graph of 4
    # and the verify graph of (6, 3) are different graphs.
    decode = d.dispatch(3, 3, True)
    assert decode.runner is RunnerKind.FULL and decode.descriptor.graph_key == 4
    # Without speculation, or without full graphs, no verify graph.
    assert GraphDispatcher(MODE, (1, 2, 4, 8), 4).spec_full_sizes == ()
    pw = GraphDispatcher(CudaGraphMode.PIECEWISE, (1, 2, 4, 8), 4, spec_query_len=3)
    assert pw.spec_full_sizes == () and pw.dispatch(6, 2, False, 3).runner is RunnerKind.PIECEWISE


class _Spy:
    """Records each full-graph replay's key and the buffers it reads."""

    def __init__(self, engine: LLMEngine) -> None:
        runner = engine.runner
        self.runner, self.replay = runner, runner.cuda_graphs.replay_full
        self.calls: list[dict] = []
        runner.cuda_graphs.replay_full = self

    def __call__(self, key, inputs):
        r = self.runner
        size, q = key if isinstance(key, tuple) else (key, 1)
        rows = size // q
        self.calls.append(dict(key=key, n=r.input_batch.num_reqs,
                               query_start_loc=r.query_start_loc.np[:rows + 1].copy(),
                               seq_lens=r.seq_lens.np[:rows].copy(),
                               slots=r.input_batch.block_table.slot_mapping.np[:size].copy()))
        return self.replay(key, inputs)


def test_verify_steps_replay_full_graphs_and_match_hf(ckpt, oracle):
    k = 2
    args = EngineArgs(model=str(ckpt), device="cpu", max_model_len=96, block_size=4, seed=0,
                      compile=True, max_num_seqs=4, max_num_batched_tokens=32,
                      cuda_graph_sizes=(1, 2, 4, 8, 16, 32), speculative_method="ngram",
                      num_speculative_tokens=k)
    config, source = engine_config(args)
    config = dataclasses.replace(config, compile=dataclasses.replace(
        config.compile, cuda_graph_mode=MODE, emulate_cuda_graphs=True,
        check_static_addresses=True))
    engine = LLMEngine(config, source)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 20))] for _ in range(6)]
    lengths = [rng.randrange(6, 20) for _ in prompts]
    expected = [oracle(p, n) for p, n in zip(prompts, lengths)]
    # Every draft right: most steps are uniform verify steps of 1 + K tokens a request.
    engine.runner.spec.proposer = ReplayProposer(k, [p + e for p, e in zip(prompts, expected)])
    spy = _Spy(engine)
    ids = {}
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        ids[engine.add_request({"prompt_token_ids": p},
                               SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                               stream=False)] = i
    got = {}
    while len(got) < len(prompts):
        for out in engine.step():
            if out.finished:
                got[ids[out.request_id]] = list(out.outputs[0].token_ids)
    assert [got[i] for i in range(len(prompts))] == expected
    verify = [c for c in spy.calls if isinstance(c["key"], tuple)]
    assert verify, "no verify step ran as a full graph"
    q = k + 1
    assert {c["key"] for c in verify} <= {(3, 3), (6, 3), (9, 3), (12, 3)}
    for c in verify:
        n, rows = c["n"], c["key"][0] // q
        # Live rows: q query tokens each; padding rows: none, seq_len 0, slot -1.
        assert np.array_equal(c["query_start_loc"], np.minimum(np.arange(rows + 1), n) * q)
        assert (c["seq_lens"][n:] == 0).all() and (c["seq_lens"][:n] > 0).all()
        assert (c["slots"][n * q:] == -1).all() and (c["slots"][:n * q] >= 0).all()
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
