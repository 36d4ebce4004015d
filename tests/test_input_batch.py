"""Persistent input batch and block table against naive per-request references."""

from __future__ import annotations

import random

import numpy as np
import torch

from llmfast.sampling_params import SamplingParams
from llmfast.worker.block_table import PAD_SLOT_ID, BlockTable
from llmfast.worker.input_batch import CachedRequestState, InputBatch

CPU = torch.device("cpu")


def test_slot_mapping_design_example():
    """DESIGN.md: num_scheduled [4, 17, 4], block_size 16, rows starting with blocks
    0 / 5 6 / 11 -> slots [0..3, 80..96, 176..179]."""
    table = BlockTable(4, 8, 64, 16, CPU)
    table.add_row(0, [0, 1])
    table.add_row(1, [5, 6])
    table.add_row(2, [11, 12])
    num_sched = np.array([4, 17, 4])
    req_indices = np.repeat(np.arange(3), num_sched)
    positions = np.concatenate([np.arange(n) for n in num_sched])
    table.compute_slot_mapping(req_indices, positions, 32)
    expected = list(range(4)) + list(range(80, 97)) + list(range(176, 180))
    assert table.slot_mapping.np[:25].tolist() == expected
    assert (table.slot_mapping.np[25:32] == PAD_SLOT_ID).all()


def test_slot_mapping_matches_naive_loop():
    rng = np.random.default_rng(0)
    block_size, max_blocks = 8, 16
    table = BlockTable(8, max_blocks, 512, block_size, CPU)
    rows, computed, sched = [], [], []
    for row in range(6):
        blocks = rng.permutation(200)[:max_blocks].tolist()
        table.add_row(row, blocks)
        c = int(rng.integers(0, 60))
        s = int(rng.integers(0, 60))
        rows.append(blocks)
        computed.append(c)
        sched.append(s)
    sched_np = np.array(sched)
    req_indices = np.repeat(np.arange(6), sched_np)
    positions = np.concatenate([np.arange(c, c + s) for c, s in zip(computed, sched)])
    table.compute_slot_mapping(req_indices, positions, len(positions) + 5)
    naive = []
    for r in range(6):
        for p in range(computed[r], computed[r] + sched[r]):
            naive.append(rows[r][p // block_size] * block_size + p % block_size)
    assert table.slot_mapping.np[: len(naive)].tolist() == naive
    assert (table.slot_mapping.np[len(naive): len(naive) + 5] == PAD_SLOT_ID).all()


def _state(i: int, rng: random.Random) -> CachedRequestState:
    prompt = [rng.randrange(100) for _ in range(rng.randrange(1, 20))]
    output = [rng.randrange(100) for _ in range(rng.randrange(0, 5))]
    params = SamplingParams(temperature=rng.random(), top_k=rng.randrange(0, 50),
                            seed=rng.choice([None, i]), max_tokens=5)
    blocks = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 5))]
    return CachedRequestState(f"r{i}", prompt, output, params, blocks, rng.randrange(0, 10))


def test_add_remove_condense_matches_reference():
    rng = random.Random(0)
    batch = InputBatch(max_num_reqs=16, max_model_len=64, max_num_batched_tokens=64,
                       block_size=16, device=CPU)
    live: dict[str, CachedRequestState] = {}
    counter = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.5 and len(live) < 16:
            st = _state(counter, rng)
            counter += 1
            row = batch.add_request(st)
            live[st.req_id] = st
            # Freed rows are reused before new ones.
            assert row <= max(batch.req_id_to_index.values())
        elif op < 0.85 and live:
            req_id = rng.choice(sorted(live))
            batch.remove_request(req_id)
            del live[req_id]
        else:
            batch.condense()
            assert sorted(batch.req_id_to_index.values()) == list(range(len(live)))
        # Every row's data equals the per-request reference.
        for req_id, st in live.items():
            row = batch.req_id_to_index[req_id]
            assert batch.req_ids[row] == req_id
            tokens = st.prompt_token_ids + st.output_token_ids
            assert batch.num_tokens[row] == len(tokens)
            assert batch.token_ids[row, : len(tokens)].tolist() == tokens
            assert batch.num_prompt_tokens[row] == len(st.prompt_token_ids)
            assert batch.num_computed_tokens[row] == st.num_computed_tokens
            assert batch.sampling["top_k"].np[row] == st.sampling_params.top_k
            assert np.isclose(batch.sampling["temperature"].np[row], st.sampling_params.temperature)
            assert bool(batch.sampling["has_seed"].np[row]) == (st.sampling_params.seed is not None)
            n = batch.block_table.num_blocks[row]
            assert batch.block_table.table.np[row, :n].tolist() == st.block_ids
            assert batch.sampling_params[row] is st.sampling_params
    assert batch.num_reqs == len(live)


def test_condense_moves_tail_into_holes():
    rng = random.Random(1)
    batch = InputBatch(8, 64, 64, 16, CPU)
    for i in range(5):
        batch.add_request(_state(i, rng))
    batch.remove_request("r1")
    batch.remove_request("r3")
    batch.condense()
    assert batch.req_ids[:3] == ["r0", "r4", "r2"]
    assert batch.block_table.num_blocks[3:5].tolist() == [0, 0]


def test_write_sampled_tokens_matches_naive_loop():
    """The collected values go where the old per-row loop put them: only into rows of
    requests still there (the same state object, not a reused id), at their rows now
    (condense moves them between launch and collect)."""
    from types import SimpleNamespace

    from llmfast.worker.placeholders import write_sampled_tokens

    for seed in range(20):
        rng = random.Random(seed)
        batch = InputBatch(12, 64, 256, 4, CPU)
        requests: dict[str, CachedRequestState] = {}
        for i in range(12):
            state = _state(i, rng)
            requests[state.req_id] = state
            batch.add_request(state)
        n = 12
        rows = sorted(rng.sample(range(n), rng.randrange(1, n + 1)))  # scheduled rows
        samples = [rng.random() < 0.8 for _ in rows]
        launch = [r for r, s in zip(rows, samples) if s]
        states = [requests[batch.req_ids[r]] for r in launch]
        cols = [rng.randrange(20, 64) for _ in launch]
        step = SimpleNamespace(rows=rows, samples=samples, sampling_states=states,
                               sampling_rows=np.array(launch, dtype=np.int64),
                               placeholder_cols=np.array(cols, dtype=np.int64),
                               batch_version=batch.version)
        if seed % 4:  # else the batch is as at launch (write_sampled_tokens' fast path)
            # Between launch and collect: some leave, one id comes back as a new request.
            gone = rng.sample(sorted(requests), 4)
            for req_id in gone:
                del requests[req_id]
                batch.remove_request(req_id)
            reused = _state(int(gone[0].removeprefix("r")), rng)
            requests[reused.req_id] = reused
            batch.add_request(reused)
            batch.condense()
        sampled = np.array([rng.randrange(1000, 2000) for _ in range(n)], dtype=np.int64)
        expected = batch.token_ids.copy()
        for state, col, r in zip(states, cols, launch):  # the old loop
            if requests.get(state.req_id) is state:
                expected[batch.req_id_to_index[state.req_id], col] = sampled[r]
        write_sampled_tokens(step, sampled, requests, batch)
        assert (batch.token_ids == expected).all()


def _metadata_fields(md) -> dict:
    import dataclasses

    out = {}
    for f in dataclasses.fields(md):
        v = getattr(md, f.name)
        out[f.name] = v.tolist() if isinstance(v, torch.Tensor) else v
    return out


def test_sampling_metadata_per_layout_fields_follow_the_batch():
    """build_sampling_metadata reuses its per-layout fields while no request joins,
    leaves or moves: after every change, equal to a build from scratch."""
    from llmfast.worker.sampling.sampling_metadata import SamplingStaging, build_sampling_metadata

    rng = random.Random(1)
    batch = InputBatch(max_num_reqs=8, max_model_len=64, max_num_batched_tokens=64,
                       block_size=16, device=CPU)
    staging = SamplingStaging(CPU)
    live: list[str] = []
    for i in range(200):
        op = rng.random()
        if op < 0.45 and len(live) < 8:
            st = _state(i, rng)
            st.sampling_params = SamplingParams(
                temperature=rng.choice([0.0, 0.7]), top_k=rng.choice([0, 5]),
                top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.1]),
                presence_penalty=rng.choice([0.0, 0.5]), seed=rng.choice([None, i]),
                logprobs=rng.choice([None, 0, 3]), max_tokens=5)
            batch.add_request(st)
            live.append(st.req_id)
        elif op < 0.75 and live:
            batch.remove_request(live.pop(rng.randrange(len(live))))
        batch.condense()
        n = batch.num_reqs
        if n == 0:
            continue
        args = (batch, n, 100, (1,), staging)
        reused = _metadata_fields(build_sampling_metadata(*args))
        batch.sampling_fields = None  # the oracle: everything computed again
        assert reused == _metadata_fields(build_sampling_metadata(*args))


def test_scheduled_per_row_matches_lookup_per_row():
    from llmfast.worker.step_inputs import scheduled_per_row

    rng = random.Random(2)
    for _ in range(200):
        ids = [f"r{i}" for i in rng.sample(range(40), rng.randrange(0, 12))]
        scheduled = {r: rng.randrange(1, 9) for r in ids if rng.random() < 0.8}
        if rng.random() < 0.5:  # often the rows' own order (the fast path)
            scheduled = {r: rng.randrange(1, 9) for r in ids}
        expected = [scheduled.get(r, 0) for r in ids]
        got = scheduled_per_row(scheduled, ids)
        assert got.dtype == np.int64 and got.tolist() == expected
