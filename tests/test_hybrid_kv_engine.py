"""A Gemma 3 text model with several KV-cache groups through the engine: a tiny random HF
checkpoint of seven layers (sliding, sliding, global, ...: two global, five sliding, so
four groups of two layers, one page padded) and a 16-token window gives HF's greedy
tokens on prompts plus generations longer than the window, batched, under chunked
prefill, preemption and prefix-cache hits; while it runs each sliding group of a decoding
request holds at most ceil(16 / 4) + 1 blocks and the global group every block. Also the
runner's side: the cache's pages, each layer's page and group, and the per-group slot
mappings against a naive loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmfast.core.kv_cache_groups import kv_cache_groups
from llmfast.worker.group_block_tables import MultiGroupBlockTable
from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.workloads import greedy_params
from tests.helpers.hf_oracle import greedy_oracle
from tests.test_engine import _llm
from tests.test_sliding_models import long_workload

S, G = "sliding_attention", "full_attention"
LAYER_TYPES = [S, S, G, S, S, G, S]
WINDOW, BS = 16, 4


@pytest.fixture(scope="module")
def gemma7(tmp_path_factory):
    path = make_hf_checkpoint(tmp_path_factory.mktemp("gemma3_groups") / "ckpt",
                              family="gemma3_text", tie=True, num_hidden_layers=7,
                              layer_types=LAYER_TYPES, sliding_window=WINDOW)
    return path, greedy_oracle(load_hf_model(path))


def _watch_held(scheduler):
    """Wrap scheduler.schedule: after each, every decoding request's held blocks per group."""
    kv = scheduler.kv_cache_manager
    schedule, seen = scheduler.schedule, []

    def checked_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        for rid, n in out.num_scheduled_tokens.items():
            if n == 1:
                request = scheduler.requests[rid]
                seen.append((kv.num_held_blocks_per_group(rid),
                             -(-request.num_computed_tokens // BS)))
        return out

    scheduler.schedule = checked_schedule
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_matches_hf_with_groups(gemma7, async_scheduling):
    path, oracle = gemma7
    prompts, lengths = long_workload(11)
    assert max(len(p) + n for p, n in zip(prompts, lengths)) > 3 * WINDOW
    # 4 groups; one 128-token request alone needs 32 + 3 x 9 = 59 blocks: 72 preempt.
    llm = _llm(path, max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=72,
               async_scheduling=async_scheduling)
    scheduler = llm.engine.scheduler
    assert scheduler.kv_groups is not None and scheduler.kv_groups.num_groups == 4
    seen = _watch_held(scheduler)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(lengths))
    for p, n, out in zip(prompts, lengths, outs):
        assert out.outputs[0].token_ids == oracle(p, n)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0 and sum(o.num_cached_tokens for o in outs) > 0
    bound = -(-WINDOW // BS) + 1
    assert len(seen) > 100
    for held, spanned in seen:
        assert held[0] == spanned  # the global group: every block
        assert max(held[1:]) <= bound
    assert max(spanned for _, spanned in seen) > 3 * bound


def test_runner_pages_and_layer_groups(gemma7):
    path, _ = gemma7
    llm = _llm(path, num_gpu_blocks_override=80, max_num_batched_tokens=16)
    runner = llm.engine.runner
    groups = runner.kv_groups
    assert [g.layers for g in groups.groups] == [(2, 5), (0, 1), (3, 4), (6,)]
    # [layers_per_block, 2, num_blocks, block_size, kv_heads, head_dim]
    assert runner.kv_cache.shape[:4] == (2, 2, 80, BS)
    slots, owner = groups.layer_slot(), groups.layer_group()
    for i, layer in enumerate(runner.model.attention_layers()):
        assert layer.kv_group == owner[i]
        assert layer.k_cache.data_ptr() == runner.kv_cache[slots[i], 0].data_ptr()
        assert layer.v_cache.data_ptr() == runner.kv_cache[slots[i], 1].data_ptr()
    table = runner.input_batch.block_table
    assert isinstance(table, MultiGroupBlockTable) and len(table.groups) == 4


def test_single_group_models_keep_one_table_and_every_layer_page(tmp_path):
    path = make_hf_checkpoint(tmp_path / "ckpt", family="mistral", sliding_window=16)
    runner = _llm(path, num_gpu_blocks_override=40).engine.runner
    assert runner.kv_groups.num_groups == 1
    assert runner.input_batch.block_table.groups is None
    assert runner.kv_cache.shape[0] == 2  # TINY's two layers, a page each
    assert all(layer.kv_group is None for layer in runner.model.attention_layers())


def test_group_slot_mappings_match_a_naive_loop():
    rng = np.random.default_rng(0)
    num_groups, max_reqs, max_blocks, bs = 3, 5, 12, 4
    tables = MultiGroupBlockTable(num_groups, max_reqs, max_blocks, 64, bs,
                                  torch.device("cpu"))
    rows = {}
    for row in range(4):
        n = int(rng.integers(1, max_blocks))
        ids = [list(rng.permutation(np.arange(1, 200))[:n]) for _ in range(num_groups)]
        tables.add_row(row, ids)
        rows[row] = ids
    tables.append_row(1, [[201], [202], [203]])
    for g in range(num_groups):
        rows[1][g] = rows[1][g] + [201 + g]
    tables.move_row(3, 0)  # rows: 0 <- 3 (3 freed)
    rows[0] = rows.pop(3)
    num_sched = {0: 5, 1: 3, 2: 2}
    req_indices, positions = [], []
    for row, k in num_sched.items():
        start = int(rng.integers(0, len(rows[row][0]) * bs - k + 1))
        req_indices += [row] * k
        positions += list(range(start, start + k))
    tables.compute_slot_mapping(np.array(req_indices), np.array(positions), 12)
    slots, device_tables = tables.device_groups(12, 3, 3)
    for g in range(num_groups):
        want = [rows[r][g][p // bs] * bs + p % bs for r, p in zip(req_indices, positions)]
        assert slots[g][:len(want)].tolist() == want
        assert slots[g][len(want):].tolist() == [-1] * (12 - len(want))
        for row in range(3):
            n = len(rows[row][g])
            assert device_tables[g][row, :n].tolist() == rows[row][g]
            assert not device_tables[g][row, n:].any()


def test_kv_cache_bytes_per_block_follow_the_groups(gemma7):
    from llmfast.models.families import model_config_from_hf
    from llmfast.worker.startup.kv_cache_sizing import kv_block_bytes
    import json

    path, _ = gemma7
    config = model_config_from_hf(json.loads((path / "config.json").read_text()))
    assert kv_cache_groups(config).layers_per_block == 2
    # 2 layers x K and V x 4 tokens x 2 KV heads x 16 x 4 bytes
    assert kv_block_bytes(config, BS, torch.float32) == 2 * 2 * BS * 2 * 16 * 4


@pytest.mark.slow  # ~2 min on 2 cores: two compiled starts with emulated CUDA graphs
def test_compiled_groups_with_full_graphs_and_a_warm_start(gemma7, monkeypatch, tmp_path):
    """Compiled (Inductor on CPU), piecewise and full graphs emulated, async: the
    per-group tables are graph inputs from persistent buffers (addresses checked at each
    full replay) and HF's tokens come out; the saved trace names every group's tables,
    and a second start loads it without tracing and gives the same tokens."""
    from llmfast.config import CudaGraphMode
    from tests.helpers.full_graphs import emulated_graph_engine, greedy_matches_hf

    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path))
    monkeypatch.delenv("LLMFAST_PRECOMPILED", raising=False)
    path, oracle = gemma7
    for start in ("cold", "warm"):
        # The full-graph tests' engine (block size 4 = BS) and their workload, greedy
        # under async scheduling: HF's tokens, both graph kinds replayed.
        eng = emulated_graph_engine(str(path), CudaGraphMode.FULL_AND_PIECEWISE)
        greedy_matches_hf(eng, oracle)
        compiled = eng.runner.compiled
        assert compiled.stats.precompiled == (start == "warm"), start
        # Every group's slot mapping and block table is an input of the full graphs.
        assert len(eng.runner._full_inputs(2)) == 6 + 2 * 3 + 2 * 7
        manifests = list(tmp_path.rglob("manifest.json"))
        assert manifests
        text = manifests[0].read_text()
        assert '"group_block_tables"' in text and '"group_slot_mappings"' in text
        del eng


@pytest.mark.slow  # ~80 s on 2 shared cores: two worker processes
def test_tensor_parallel_groups_match_hf(gemma7):
    """Two ranks (mp): the pickled per-group block ids reach both, each rank's cache of one
    KV head is paged by the same groups."""
    path, oracle = gemma7
    prompts, lengths = long_workload(11)
    llm = _llm(path, max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=72,
               tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            greedy_params(lengths))
        for p, n, out in zip(prompts, lengths, outs):
            assert out.outputs[0].token_ids == oracle(p, n)
        assert llm.engine.stats().num_preemptions > 0
    finally:
        llm.engine.shutdown()


def test_start_up_dry_batches_carry_every_groups_tables(gemma7):
    """The batches the CUDA start-up runs before serving (the memory profile's largest
    step, the captures' dummies, a full graph's batch: worker/startup/) give each group
    its tables, and the model runs on them (here on the CPU)."""
    path, _ = gemma7
    runner = _llm(path, num_gpu_blocks_override=80, max_num_batched_tokens=16,
                  max_num_seqs=4).engine.runner
    batches = runner._dry_batches()
    assert len(batches) >= 3
    for ids, positions, md in batches:
        assert len(md.group_slot_mappings) == len(md.group_block_tables) == 4
        assert md.group_slot_mappings[0] is md.slot_mapping or \
            md.group_slot_mappings[0].data_ptr() == md.slot_mapping.data_ptr()
        for slots in md.group_slot_mappings:
            assert slots.shape == md.slot_mapping.shape and (slots == -1).all()
        with torch.inference_mode():
            hidden = runner.model(ids, positions, md)
        assert hidden.shape == (ids.shape[0], 64)
        # Rows past the last request's tokens (a dummy batch's padding) are left as the
        # attention's output buffer was: unwritten memory, not necessarily finite.
        covered = int(md.query_start_loc[-1])
        assert covered >= 1 and torch.isfinite(hidden[:covered]).all()


def test_speculative_decoding_with_groups_matches_hf(gemma7):
    """n-gram drafts on the grouped model: a verify step's rejected drafts roll
    num_computed_tokens back while the sliding groups free by it; tokens stay HF's,
    under chunked prefill, preemption and prefix hits, and a decoding request's sliding
    groups stay within the window plus the verify step's 1 + K tokens."""
    from tests.test_spec_decode_engine import _check, copy_workload

    path, oracle = gemma7
    prompts, lengths = copy_workload(1, shared_prefix=20)
    assert max(len(p) + n for p, n in zip(prompts, lengths)) > 3 * WINDOW
    llm = _llm(path, max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=72,
               speculative_method="ngram", num_speculative_tokens=3)
    scheduler = llm.engine.scheduler
    kv = scheduler.kv_cache_manager
    schedule, held = scheduler.schedule, []

    def checked_schedule(*args, **kwargs):
        out = schedule(*args, **kwargs)
        held.extend(max(kv.num_held_blocks_per_group(rid)[1:])
                    for rid, n in out.num_scheduled_tokens.items() if n <= 4
                    and scheduler.requests[rid].output_token_ids)
        return out

    scheduler.schedule = checked_schedule
    stats = _check(llm, prompts, lengths, oracle)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    # Keys from p - 15 to p + 3 (the verify step's queries): 19 positions, 6 blocks of 4.
    assert held and max(held) <= -(-(WINDOW + 3) // BS) + 1


def test_bench_counts_every_groups_blocks(gemma7):
    """`llmfast bench`'s room check counts a request's blocks in every group: 2 requests
    of 64 tokens need 2 x (16 + 3 x 9) = 86 blocks of the 79 (one group would say 32);
    one request of 64 runs as a pure decode sweep point."""
    from llmfast.bench.sweep import NotPureDecode, _check_room, run_sweep_point

    path, _ = gemma7
    engine = _llm(path, num_gpu_blocks_override=80, max_num_batched_tokens=16,
                  max_num_seqs=4).engine
    with pytest.raises(NotPureDecode, match="needs 86 KV blocks, the cache holds 79"):
        _check_room(engine, 2, 60, 4)
    point = run_sweep_point(engine, 1, 40, steps=4)
    assert point.batch_size == 1


def test_a_grouped_draft_model_keeps_every_block(gemma7):
    """--speculative-method draft with the grouped Gemma 3 as both target and draft: the
    draft's cache has a page per layer in every block of the target's global group (its
    layers all read that one table), so it drafts as the target decodes: HF's tokens,
    nearly every draft accepted."""
    from tests.test_spec_decode_engine import _generate, _greedy, copy_workload

    path, oracle = gemma7
    prompts, lengths = copy_workload(6, num=8)
    llm = _llm(path, speculative_method="draft", speculative_model=str(path),
               num_speculative_tokens=3, max_num_batched_tokens=16, max_num_seqs=8,
               num_gpu_blocks_override=72, max_model_len=88)
    draft = llm.engine.runner.spec.proposer
    assert all(layer.kv_group is None for layer in draft.model.attention_layers())
    assert draft.kv_cache.shape[0] == 7  # a page per layer
    outs = _generate(llm, prompts, _greedy(lengths))
    for p, n, out in zip(prompts, lengths, outs):
        assert out.token_ids == oracle(p, n)
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens > 0


@pytest.mark.slow  # ~1 min: a compiled start with emulated graphs
def test_verify_full_graphs_read_every_groups_tables(gemma7):
    """Speculative decoding's verify steps (1 + K tokens a request) as full graphs on
    the grouped model: every group's tables at the verify graph's request rows, HF's
    tokens."""
    import dataclasses
    import random

    from llmfast import SamplingParams
    from llmfast.config import CudaGraphMode
    from llmfast.engine import LLMEngine
    from llmfast.engine.args import EngineArgs
    from llmfast.worker.spec_decode.replay_proposer import ReplayProposer
    from tests.helpers.engine_config import engine_config
    from tests.helpers.full_graphs import run_with_arrivals
    from tests.test_spec_decode_graphs import _Spy

    path, oracle = gemma7
    k = 2
    args = EngineArgs(model=str(path), device="cpu", max_model_len=96, block_size=BS, seed=0,
                      compile=True, max_num_seqs=4, max_num_batched_tokens=32,
                      cuda_graph_sizes=(1, 2, 4, 8, 16, 32), speculative_method="ngram",
                      num_speculative_tokens=k)
    config, source = engine_config(args)
    config = dataclasses.replace(config, compile=dataclasses.replace(
        config.compile, cuda_graph_mode=CudaGraphMode.FULL_AND_PIECEWISE,
        emulate_cuda_graphs=True, check_static_addresses=True))
    engine = LLMEngine(config, source)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(2, 20))] for _ in range(6)]
    lengths = [rng.randrange(20, 40) for _ in prompts]  # past the 16-token window
    expected = [oracle(p, n) for p, n in zip(prompts, lengths)]
    engine.runner.spec.proposer = ReplayProposer(k, [p + e for p, e in zip(prompts, expected)])
    spy = _Spy(engine)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    assert run_with_arrivals(engine, prompts, params, [0] * len(prompts)) == expected
    assert any(isinstance(c["key"], tuple) for c in spy.calls), "no verify full graph ran"
    assert len(engine.runner._full_inputs(6)) == 6 + 2 * 3 + 2 * 7
