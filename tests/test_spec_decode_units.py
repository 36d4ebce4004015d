"""Speculative decoding's vectorised index arithmetic against naive loops: n-gram
prompt lookup, the verify step's logits rows, and the verify step's inputs (drafts in
the rows, input ids, positions, slot mapping, query_start_loc) with 1 + K query tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmfast.config import CudaGraphMode, SpeculativeConfig
from llmfast.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from llmfast.cuda_graphs.dispatch import GraphDispatcher
from llmfast.sampling_params import SamplingParams
from llmfast.worker.input_batch import InputBatch
from llmfast.worker.placeholders import PlaceholderFill
from llmfast.worker.spec_decode.ngram_proposer import NgramProposer, propose_ngram
from llmfast.worker.spec_decode.proposer import ProposalInputs
from llmfast.worker.spec_decode.spec_decoder import (
    SpecDecoder,
    TargetFacts,
    make_proposer,
    spec_logits_rows,
)
from llmfast.worker.state_updates import update_states
from llmfast.worker.step_inputs import StepInputs


def naive_ngram(tokens, min_n, max_n, k):
    """Longest suffix of min_n..max_n tokens seen before; the tokens after its latest
    earlier occurrence, at most k and not past the end."""
    length = len(tokens)
    for n in range(min(max_n, length), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):  # latest first; must end before the suffix
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_ngram_matches_naive_loop(seed):
    rng = np.random.default_rng(seed)
    rows, width = 24, 80
    token_ids = np.zeros((rows, width), dtype=np.int32)
    num_tokens = rng.integers(1, width, size=rows).astype(np.int32)
    for r in range(rows):
        # Small vocabularies and repeated patterns, so that matches of every length occur.
        vocab = int(rng.integers(2, 12))
        pattern = rng.integers(0, vocab, size=int(rng.integers(1, 9)))
        seq = np.resize(pattern, num_tokens[r])
        noise = rng.random(num_tokens[r]) < 0.15
        seq[noise] = rng.integers(0, vocab, size=int(noise.sum()))
        token_ids[r, :num_tokens[r]] = seq
        token_ids[r, num_tokens[r]:] = 999  # padding must never be read
    for min_n, max_n, k in [(1, 1, 3), (2, 4, 3), (1, 5, 5), (3, 3, 1)]:
        max_drafts = rng.integers(0, k + 1, size=rows).astype(np.int32)
        drafts, counts = propose_ngram(token_ids, num_tokens, max_drafts, min_n, max_n, k)
        for r in range(rows):
            want = naive_ngram(token_ids[r, :num_tokens[r]].tolist(), min_n, max_n, k)
            want = want[:max_drafts[r]]
            assert counts[r] == len(want), (r, min_n, max_n)
            assert drafts[r, :counts[r]].tolist() == want
            assert (drafts[r, counts[r]:] == -1).all()


def test_ngram_proposer_rows_and_limits():
    token_ids = np.zeros((4, 16), dtype=np.int32)
    token_ids[0, :8] = [5, 7, 9, 5, 7, 9, 5, 7]
    token_ids[1, :8] = [5, 7, 9, 5, 7, 9, 5, 7]
    token_ids[2, :5] = [1, 2, 3, 4, 5]  # no repeat: no drafts
    token_ids[3, :2] = [4, 4]  # too short for min_n 2
    proposer = NgramProposer(3, 2, 3)
    drafts = proposer.propose(ProposalInputs(
        req_ids=["a", "b", "c", "d"], token_ids=token_ids,
        num_tokens=np.array([8, 8, 5, 2], dtype=np.int32),
        max_num_drafts=np.array([3, 0, 3, 3], dtype=np.int32)))
    assert drafts.as_lists() == [[9, 5, 7], [], [], []]
    with pytest.raises(ValueError):
        NgramProposer(3, 3, 2)


def test_logits_rows_match_naive_loop():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 9))
        num_drafts = rng.integers(0, 5, size=n)
        extra = rng.integers(0, 6, size=n) * (num_drafts == 0)  # prefill chunks: no drafts
        num_sched = num_drafts + 1 + extra
        num_sched[rng.random(n) < 0.1] = 0  # in the batch, nothing scheduled
        num_drafts[num_sched == 0] = 0
        out = np.zeros(200, dtype=np.int64)
        total = spec_logits_rows(num_sched, num_drafts, out)
        want, start = [], 0
        for s, d in zip(num_sched.tolist(), num_drafts.tolist()):
            last = max(start + s - 1, 0)
            want.extend(range(last - d, last + 1))
            start += s
        assert out[:total].tolist() == want


BS = 4


def _ngram_spec_decoder() -> SpecDecoder:
    """K = 3 n-gram drafts, 8 rows, 128 tokens a step, on the CPU."""
    config = SpeculativeConfig("ngram", 3)
    cpu = torch.device("cpu")
    target = TargetFacts(vocab_size=64, dtype=torch.float32, kv_dtype=torch.float32,
                         device=cpu, max_model_len=128, seed=0)
    return SpecDecoder(config, 8, 128, cpu, make_proposer(config, target))


def _batch_with_drafts(drafts_per_req, known, computed_prefill):
    """A batch of requests that ran before (`known` tokens each, decoding) plus one new
    prefill, and a SchedulerOutput giving each decoding request its drafts."""
    device = torch.device("cpu")
    batch = InputBatch(8, 64, 128, BS, device)
    requests = {}
    rng = np.random.default_rng(1)
    new_reqs = []
    for i, n_known in enumerate(known):
        prompt = rng.integers(3, 200, size=n_known).tolist()
        blocks = list(range(1 + 10 * i, 1 + 10 * i + 10))
        new_reqs.append(NewRequestData(f"r{i}", prompt, [], SamplingParams(), blocks, 0))
    first = SchedulerOutput(new_reqs, CachedRequestData(), {}, 0, set())
    update_states(requests, batch, first)
    ids = [f"r{i}" for i in range(len(known))]
    spec = {rid: d for rid, d in zip(ids, drafts_per_req) if d}
    num_sched = {rid: 1 + len(d) for rid, d in zip(ids, drafts_per_req)}
    prefill = NewRequestData("p", rng.integers(3, 200, size=9).tolist(), [], SamplingParams(),
                             [90, 91, 92], computed_prefill)
    num_sched["p"] = 9 - computed_prefill
    cached = CachedRequestData(ids, [()] * len(ids), [n - 1 for n in known])
    out = SchedulerOutput([prefill], cached, num_sched, sum(num_sched.values()), set(),
                          scheduled_spec_decode_tokens=spec)
    return batch, requests, out


def test_verify_step_inputs_match_naive_loop():
    drafts = [[11, 12, 13], [], [21], [31, 32, 33]]
    known = [5, 8, 4, 13]
    batch, requests, out = _batch_with_drafts(drafts, known, computed_prefill=4)
    spec = _ngram_spec_decoder()
    update_states(requests, batch, out)
    total = spec.write_drafts(out, batch)
    assert total == 7
    inputs = StepInputs(128, 8, torch.device("cpu"))
    dispatcher = GraphDispatcher(CudaGraphMode.NONE, (), 8)
    md, dispatch, num_sched, sampling_rows = inputs.prepare(
        out, batch, dispatcher, PlaceholderFill(8, torch.device("cpu")))
    # Naive: per request, its query tokens one by one.
    ids, positions, slots, qsl = [], [], [], [0]
    for row in range(batch.num_reqs):
        rid = batch.req_ids[row]
        state = requests[rid]
        if rid == "p":
            tokens, start = state.prompt_token_ids, 4
            query = tokens[start:]
        else:
            i = int(rid[1:])
            tokens = state.prompt_token_ids + drafts[i]
            start = known[i] - 1
            query = tokens[start:]
        for j, tok in enumerate(query):
            pos = start + j
            ids.append(tok)
            positions.append(pos)
            slots.append(state.block_ids[pos // BS] * BS + pos % BS)
        qsl.append(qsl[-1] + len(query))
    n_tok = len(ids)
    assert inputs.input_ids.np[:n_tok].tolist() == ids
    assert inputs.positions.np[:n_tok].tolist() == positions
    assert md.slot_mapping[:n_tok].tolist() == slots
    assert md.query_start_loc.tolist() == qsl
    # Every request samples: the decodes verify, the prefill reaches its prompt's end.
    assert sampling_rows.tolist() == list(range(batch.num_reqs))
    # The drafts as the rejection sampler gets them, in row order.
    order = [batch.req_ids[r] for r in range(batch.num_reqs)]
    want_drafts = [t for rid in order if rid != "p" for t in drafts[int(rid[1:])]]
    assert spec.draft_token_ids.np[:total].tolist() == want_drafts
    cu = [0]
    for rid in order:
        cu.append(cu[-1] + (0 if rid == "p" else len(drafts[int(rid[1:])])))
    assert spec.cu_num_draft_tokens.np[:len(order) + 1].tolist() == cu
    rows = spec.logits_rows(num_sched, total)
    # Each drafting request's rows are its last 1 + K query tokens.
    want_rows = []
    for r, rid in enumerate(order):
        k = 0 if rid == "p" else len(drafts[int(rid[1:])])
        want_rows.extend(range(qsl[r + 1] - 1 - k, qsl[r + 1]))
    assert rows.tolist() == want_rows


def test_emitted_tokens_written_into_rows():
    batch, requests, out = _batch_with_drafts([[11, 12], [21, 22, 23]], [5, 6], 0)
    spec = _ngram_spec_decoder()
    update_states(requests, batch, out)
    spec.write_drafts(out, batch)
    before = batch.num_tokens[:3].copy()
    cols = before.copy()  # where a placeholder would sit: the first unknown column
    batch.num_tokens[:3] += 1  # record_placeholders' count
    # Row 0 accepts 1 draft then a recovered token; row 1 all 3 drafts and a bonus.
    packed = np.array([[2, 11, 50, -1, -1], [4, 21, 22, 23, 60], [1, 70, -1, -1, -1]])
    rows = np.array([batch.req_id_to_index[r] for r in ("r0", "r1", "p")])
    packed_rows = np.zeros_like(packed)
    packed_rows[rows] = packed
    num_emitted, _ = spec.emitted(packed_rows, batch, np.arange(3), cols)
    for rid, want in (("r0", [11, 50]), ("r1", [21, 22, 23, 60]), ("p", [70])):
        r = batch.req_id_to_index[rid]
        assert batch.num_tokens[r] == before[r] + len(want)
        assert batch.token_ids[r, before[r]:batch.num_tokens[r]].tolist() == want
