"""Rejection sampler tests: greedy against a naive loop, the emitted tokens' distribution
against the exact target softmax (total variation over many seeds), point-mass drafts,
rows without drafts, seeds across batch compositions, filters, penalties, logprobs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from llmfast.sampling_params import SamplingParams
from llmfast.worker.sampling.sampler import Sampler
from llmfast.worker.spec_decode.rejection_sampler import expand_metadata, rejection_sample
from tests.helpers.sampling import metadata_from_params

SP = SamplingParams


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def batch_rows(num_drafts: list[int]):
    """cu_num_draft_tokens and each request's first row in target_logits."""
    cu = torch.tensor([0, *torch.tensor(num_drafts).cumsum(0).tolist()], dtype=torch.int32)
    first = [int(cu[i]) + i for i in range(len(num_drafts))]
    return cu, first


def naive_greedy(logits, drafts, num_drafts):
    """Per request: drafts while they equal the argmax, then the argmax."""
    out, d, r = [], 0, 0
    for k in num_drafts:
        mine, emitted = drafts[d:d + k].tolist(), []
        for j in range(k + 1):
            target = int(logits[r + j].argmax())
            emitted.append(target)
            if j == k or mine[j] != target:
                break
        out.append(emitted)
        d, r = d + k, r + k + 1
    return out


def table(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows])


# ---- greedy ------------------------------------------------------------------------


@pytest.mark.parametrize("with_probs", [False, True])
def test_greedy_matches_naive_loop(with_probs):
    vocab = 20
    num_drafts = [3, 0, 5, 1, 0, 2, 4]
    num_rows = len(num_drafts) + sum(num_drafts)
    logits = torch.randn(num_rows, vocab, generator=gen(0))
    cu, first = batch_rows(num_drafts)
    # Drafts: mostly the argmax (long accepted runs), sometimes another token.
    drafts = []
    g = gen(1)
    for i, k in enumerate(num_drafts):
        for j in range(k):
            t = int(logits[first[i] + j].argmax())
            drafts.append(t if torch.rand((), generator=g) < 0.75 else (t + 1) % vocab)
    drafts = torch.tensor(drafts, dtype=torch.int64)
    probs = torch.softmax(torch.randn(len(drafts), vocab, generator=g), -1) if with_probs else None
    md = metadata_from_params([SP(temperature=0.0)] * len(num_drafts), vocab_size=vocab)
    res = rejection_sample(logits, drafts, cu, probs, md, max_num_draft_tokens=5)
    want = naive_greedy(logits, drafts, num_drafts)
    assert torch.equal(res.output_token_ids, table(want, 6))
    assert res.num_emitted.tolist() == [len(w) for w in want]
    assert res.logprobs is None
    # Some requests stopped early, some took every draft plus the bonus.
    assert any(len(w) < k + 1 for w, k in zip(want, num_drafts))
    assert any(len(w) == k + 1 and k > 0 for w, k in zip(want, num_drafts))
    # Without max_num_draft_tokens the width is read from cu (CPU here: no device sync).
    assert torch.equal(rejection_sample(logits, drafts, cu, probs, md).output_token_ids,
                       res.output_token_ids)


def test_penalties_and_logprobs_per_row_match_the_plain_sampler():
    """A row at position j sees the request's drafts before it as output tokens (its
    penalties count them) and samples output number step + j (min_tokens): the plain
    Sampler run on that row alone, with those outputs and that step, is the oracle for
    the token and its logprobs."""
    vocab = 16
    eos = 0
    params = [SP(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.4, logprobs=3),
              SP(temperature=0.0, presence_penalty=1.0, min_tokens=3, logprobs=2,
                 logit_bias={5: 2.0}),
              SP(temperature=0.0, logprobs=0)]
    num_drafts = [4, 3, 0]
    prompts = [[1, 2, 3], [4, 4], [7]]
    outputs = [[5], [6, 2], []]
    steps = [1, 1, 0]
    cu, first = batch_rows(num_drafts)
    g = gen(3)
    logits = torch.randn(len(params) + sum(num_drafts), vocab, generator=g) * 2
    # Drafts = what the target itself would pick, so runs get long and penalties bite.
    drafts, per_req = [], []
    for i, k in enumerate(num_drafts):
        mine = []
        for j in range(k):
            md_j = metadata_from_params([params[i]], vocab_size=vocab, steps=[steps[i] + j],
                                        prompt_token_ids=[prompts[i]],
                                        output_token_ids=[outputs[i] + mine], eos_token_id=eos)
            t = int(Sampler()(logits[first[i] + j][None], md_j).sampled_token_ids[0])
            mine.append(t if j < 3 else (t + 1) % vocab)  # the 4th draft of row 0 is wrong
        drafts += mine
        per_req.append(mine)
    md = metadata_from_params(params, vocab_size=vocab, steps=steps, prompt_token_ids=prompts,
                              output_token_ids=outputs, eos_token_id=eos)
    res = rejection_sample(logits, torch.tensor(drafts), cu, None, md, max_num_draft_tokens=4)
    assert res.num_emitted.tolist() == [4, 4, 1]
    for i in range(len(params)):
        for j in range(int(res.num_emitted[i])):
            md_j = metadata_from_params(
                [dataclasses.replace(params[i], logprobs=3)], vocab_size=vocab,
                steps=[steps[i] + j], prompt_token_ids=[prompts[i]],
                output_token_ids=[outputs[i] + per_req[i][:j]], eos_token_id=eos)
            want = Sampler()(logits[first[i] + j][None], md_j)
            assert int(res.output_token_ids[i, j]) == int(want.sampled_token_ids[0])
            lp = res.logprobs
            torch.testing.assert_close(lp.sampled_logprobs[i, j], want.logprobs.sampled_logprobs[0])
            assert torch.equal(lp.topk_ids[i, j], want.logprobs.topk_ids[0])
            torch.testing.assert_close(lp.topk_logprobs[i, j], want.logprobs.topk_logprobs[0])
    # min_tokens: row 1 starts at output 1 of min 3, so its first two positions ban EOS.
    assert (res.output_token_ids[1, :2] != eos).all()


def test_bad_shapes_are_named():
    md = metadata_from_params([SP()], vocab_size=4)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="need 3"):
        rejection_sample(torch.zeros(2, 4), torch.tensor([1, 2]), cu, None, md)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(3, 4), torch.tensor([1, 2]), cu, torch.zeros(2, 5), md)


# ---- the emitted tokens' distribution ------------------------------------------------


def tv_bound(n: int, vocab: int, delta: float = 1e-6) -> float:
    """A total-variation distance the empirical distribution of n i.i.d. draws exceeds
    with probability < delta (Bretagnolle-Huber-Carol: P(|p_n - p|_1 >= e) <= 2^V
    exp(-n e^2 / 2), and TV = |.|_1 / 2)."""
    return math.sqrt((vocab * math.log(2) + math.log(1 / delta)) / (2 * n))


def tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    return 0.5 * float((counts / counts.sum() - probs.double()).abs().sum())


def exact_target(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The plain sampler's distribution, from its definition: temperature, then the k
    largest, then the smallest most-likely head with mass >= top_p."""
    x = logits.double() / p.temperature
    if p.top_k > 0:
        x = x.masked_fill(x < x.sort(descending=True).values[p.top_k - 1], -math.inf)
    probs = x.softmax(-1)
    if p.top_p < 1:
        sorted_p, idx = probs.sort(descending=True)
        mass_before = sorted_p.cumsum(0) - sorted_p
        probs = probs.clone()
        probs[idx[mass_before >= p.top_p]] = 0
        probs /= probs.sum()
    return probs


DIST_CASES = {
    "plain": SP(temperature=1.0),
    "temperature-topk": SP(temperature=0.7, top_k=5),
    "topp": SP(temperature=1.3, top_p=0.8),
}


@pytest.mark.parametrize("case", list(DIST_CASES))
@pytest.mark.parametrize("point_mass", [False, True])
@pytest.mark.parametrize("seeded", [True, False])
def test_emitted_tokens_follow_the_target_distribution(case, point_mass, seeded):
    """N independent requests, each verifying K drafts against the same per-position
    target logits: the first emitted token has the target's distribution p_0, and the
    token at position j, among requests that reached it (drafts before it accepted), has
    p_j. Each is checked by total variation against the exact p_j, under a bound derived
    from the sample size; two wrong algorithms over the same draws exceed it."""
    torch.manual_seed(0)  # the unseeded rows' generator
    params, vocab, k, n = DIST_CASES[case], 8, 3, 12_000
    g = gen(11)
    logits = torch.randn(k + 1, vocab, generator=g) * 1.5  # per position, shared
    p = torch.stack([exact_target(logits[j], params) for j in range(k + 1)])
    if point_mass:
        # n-gram style: a fixed draft per position (a likely one, so later positions fill).
        drafts = p[:k].argmax(-1).repeat(n)  # [n * k]
        q = None
    else:
        # A draft model near the target: its logits plus noise (wide enough that the
        # wrong algorithms below are far off, close enough that later positions fill).
        q = torch.softmax(logits[:k] + torch.randn(k, vocab, generator=g) * 1.5, -1)
        drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g)
                              for j in range(k)], dim=1).reshape(-1)  # [n * k], x_j ~ q_j
    # n copies of one request (seeds 0..n-1 if seeded): its metadata, one row per copy.
    md = metadata_from_params([dataclasses.replace(params, seed=0 if seeded else None)],
                              vocab_size=vocab)
    copies = torch.zeros(n, dtype=torch.int64)
    md = dataclasses.replace(expand_metadata(md, copies, copies, None),
                             seeds=torch.arange(n), has_seed=torch.full((n,), seeded))
    cu = torch.arange(0, (n + 1) * k, k, dtype=torch.int32)
    res = rejection_sample(logits.repeat(n, 1), drafts,
                           cu, None if q is None else q.repeat(n, 1), md,
                           max_num_draft_tokens=k)
    out, emitted = res.output_token_ids, res.num_emitted
    assert (emitted >= 1).all() and (emitted <= k + 1).all()
    for j in range(k + 1):
        reached = emitted > j
        n_j = int(reached.sum())
        assert n_j > 1000, f"position {j} reached by only {n_j} requests"
        assert tv(out[reached, j], p[j]) < tv_bound(n_j, vocab), f"position {j}"
    # Each position's emitted tokens lie in the filtered support.
    assert (p.gather(1, out.clamp(min=0).T).T[out >= 0] > 0).all()

    # The bound has teeth: over the same draws, "always accept the draft" and "on a
    # rejection, sample p itself instead of the residual" both exceed it at position 0.
    bound = tv_bound(n, vocab)
    x0 = drafts.view(n, k)[:, 0]
    q0 = torch.nn.functional.one_hot(x0[:1], vocab)[0].double() if q is None else q[0]
    u = torch.rand(n, generator=g, dtype=torch.float64)
    accept = u * q0[x0] < p[0][x0]
    from_p = torch.multinomial(p[0], n, replacement=True, generator=g)
    assert tv(x0, p[0]) > bound
    assert tv(torch.where(accept, x0, from_p), p[0]) > bound


def test_draft_equal_to_target_is_always_accepted():
    vocab, k, n = 12, 4, 50
    logits = torch.randn(n * (k + 1), vocab, generator=gen(5))
    q = logits.view(n, k + 1, vocab)[:, :k].softmax(-1).reshape(n * k, vocab)
    drafts = torch.multinomial(q, 1, generator=gen(6))[:, 0]
    md = metadata_from_params([SP(seed=i) for i in range(n)], vocab_size=vocab)
    cu = torch.arange(0, (n + 1) * k, k, dtype=torch.int32)
    res = rejection_sample(logits, drafts, cu, q, md, max_num_draft_tokens=k)
    assert (res.num_emitted == k + 1).all()
    assert torch.equal(res.output_token_ids[:, :k], drafts.view(n, k))


# ---- rows without drafts, seeds, filters ----------------------------------------------


def test_rows_without_drafts_sample_exactly_what_the_plain_sampler_samples():
    vocab = 30
    params = [SP(seed=7, logprobs=2), SP(temperature=0.0), SP(seed=8, top_k=4),
              SP(seed=9, temperature=0.5, top_p=0.7, min_p=0.05)]
    num_drafts = [0, 2, 0, 0]
    steps = [3, 0, 5, 1]
    cu, first = batch_rows(num_drafts)
    logits = torch.randn(len(params) + 2, vocab, generator=gen(2)) * 2
    md = metadata_from_params(params, vocab_size=vocab, steps=steps)
    res = rejection_sample(logits, torch.tensor([1, 2]), cu, None, md, max_num_draft_tokens=2)
    plain_rows = [0, 2, 3]
    rows = torch.tensor([first[i] for i in plain_rows])
    md_plain = metadata_from_params([params[i] for i in plain_rows], vocab_size=vocab,
                                    steps=[steps[i] for i in plain_rows])
    want = Sampler()(logits[rows], md_plain)
    assert torch.equal(res.output_token_ids[plain_rows, 0], want.sampled_token_ids)
    assert res.num_emitted[plain_rows].tolist() == [1, 1, 1]
    assert (res.output_token_ids[plain_rows, 1:] == -1).all()
    torch.testing.assert_close(res.logprobs.sampled_logprobs[plain_rows, 0],
                               want.logprobs.sampled_logprobs)


def test_seeded_requests_emit_the_same_tokens_in_any_batch():
    vocab, k = 10, 3
    g = gen(4)
    logits = torch.randn(k + 1, vocab, generator=g)
    q = torch.softmax(torch.randn(k, vocab, generator=g), -1)
    drafts = torch.multinomial(q, 1, generator=g)[:, 0]
    for seed in range(20):
        req = SP(seed=seed, temperature=0.9)
        alone = rejection_sample(logits, drafts, torch.tensor([0, k], dtype=torch.int32), q,
                                 metadata_from_params([req], vocab_size=vocab, steps=[6]))
        # The same request third in a batch with unseeded, greedy and draft-less rows.
        others = [SP(), SP(temperature=0.0), req, SP(seed=seed + 1, top_k=3)]
        ks = [2, 0, k, 1]
        cu, first = batch_rows(ks)
        big = torch.randn(sum(ks) + 4, vocab, generator=g)
        big[first[2]:first[2] + k + 1] = logits
        all_drafts = torch.randint(vocab, (sum(ks),), generator=g)
        all_drafts[int(cu[2]):int(cu[3])] = drafts
        all_q = torch.softmax(torch.randn(sum(ks), vocab, generator=g), -1)
        all_q[int(cu[2]):int(cu[3])] = q
        res = rejection_sample(big, all_drafts, cu, all_q,
                               metadata_from_params(others, vocab_size=vocab, steps=[0, 0, 6, 2]))
        assert torch.equal(res.output_token_ids[2], alone.output_token_ids[0])
        assert int(res.num_emitted[2]) == int(alone.num_emitted[0])


def test_filters_reject_drafts_outside_the_allowed_set():
    """Drafts drawn uniformly: any draft outside a row's top-k / top-p set (target
    probability 0) must be rejected, and every emitted token lies inside its row's set."""
    vocab, k, n = 20, 4, 64
    g = gen(8)
    params = [SP(seed=i, top_k=3) if i % 2 else SP(seed=i, top_p=0.3, temperature=0.8)
              for i in range(n)]
    logits = torch.randn(n * (k + 1), vocab, generator=g) * 2
    drafts = torch.randint(vocab, (n * k,), generator=g)
    q = torch.full((n * k, vocab), 1.0 / vocab)
    cu = torch.arange(0, (n + 1) * k, k, dtype=torch.int32)
    res = rejection_sample(logits, drafts, cu, q, metadata_from_params(params, vocab_size=vocab),
                           max_num_draft_tokens=k)
    for i in range(n):
        for j in range(int(res.num_emitted[i])):
            support = exact_target(logits[i * (k + 1) + j], params[i]) > 0
            assert support[res.output_token_ids[i, j]]
    assert (res.num_emitted > 1).any()  # some drafts did land in the set


# ---- no host sync ------------------------------------------------------------------


def test_runs_on_meta_tensors_so_it_never_reads_device_values():
    """Any .item()/.tolist(), Python branch on a tensor or data-dependent shape raises on
    meta tensors: finishing with every stage on proves the sampler is sync-free."""
    vocab = 32
    params = [SP(temperature=0.0, logprobs=2), SP(seed=3, top_k=5, top_p=0.9, min_p=0.1,
                                                 repetition_penalty=1.2, min_tokens=4,
                                                 logit_bias={3: 1.0}, logprobs=1),
              SP(temperature=0.7)]
    md = metadata_from_params(params, vocab_size=vocab, prompt_token_ids=[[1], [2, 3], [4]],
                              output_token_ids=[[5], [], [6, 7]], eos_token_id=0)

    def meta(obj):
        return dataclasses.replace(obj, **{
            f.name: getattr(obj, f.name).to("meta") for f in dataclasses.fields(obj)
            if isinstance(getattr(obj, f.name), torch.Tensor)})

    md_meta = meta(md)
    md_meta.logit_rules = meta(md.logit_rules)
    cu = torch.tensor([0, 2, 2, 5], dtype=torch.int32, device="meta")
    for probs in (None, torch.empty(5, vocab, device="meta")):
        res = rejection_sample(torch.empty(8, vocab, device="meta"),
                               torch.empty(5, dtype=torch.int64, device="meta"), cu, probs,
                               md_meta, max_num_draft_tokens=3)
        assert res.output_token_ids.shape == (3, 4) and res.output_token_ids.is_meta
        assert res.logprobs.topk_ids.shape == (3, 4, 2)


def test_traces_as_one_graph():
    """fullgraph=True fails on any graph break (a .item(), a data-dependent branch): the
    verify step's sampling can be compiled (or captured) with the forward."""
    vocab = 32
    params = [SP(temperature=0.0, logprobs=1), SP(seed=3, top_k=5, top_p=0.9,
                                                 repetition_penalty=1.2, min_tokens=4)]
    md = metadata_from_params(params, vocab_size=vocab, prompt_token_ids=[[1], [2]],
                              output_token_ids=[[4], [5]], eos_token_id=0)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    logits = torch.randn(7, vocab, generator=gen(13))
    drafts = torch.cat([logits[:3].argmax(-1), torch.randint(vocab, (2,), generator=gen(14))])
    q = torch.softmax(torch.randn(5, vocab, generator=gen(15)), -1)
    compiled = torch.compile(rejection_sample, backend="eager", fullgraph=True)
    for probs in (None, q):  # both rows deterministic: greedy, seeded
        got = compiled(logits, drafts, cu, probs, md, max_num_draft_tokens=3)
        want = rejection_sample(logits, drafts, cu, probs, md, max_num_draft_tokens=3)
        assert torch.equal(got.output_token_ids, want.output_token_ids)
        assert got.num_emitted[0] == 4  # the greedy row's drafts are its argmaxes


@pytest.mark.gpu
def test_cuda_no_sync_and_seeded_tokens_match_cpu():
    vocab, k, n = 32000, 4, 16
    g = gen(9)
    params = [SP(seed=100 + r, temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1,
                 logprobs=2) if r % 3 else SP(temperature=0.0) for r in range(n)]
    num_drafts = [r % (k + 1) for r in range(n)]
    cu, _ = batch_rows(num_drafts)
    logits = torch.randn(n + sum(num_drafts), vocab, generator=g)
    drafts = torch.randint(vocab, (sum(num_drafts),), generator=g)
    q = torch.softmax(torch.randn(sum(num_drafts), vocab, generator=g) * 3, -1)
    kw = dict(prompt_token_ids=[[1, 2, 3]] * n, output_token_ids=[[4]] * n)
    md_cpu = metadata_from_params(params, vocab_size=vocab, **kw)
    md_gpu = metadata_from_params(params, vocab_size=vocab, device="cuda", **kw)
    args = [t.cuda() for t in (logits, drafts, cu, q)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = rejection_sample(*args, md_gpu, max_num_draft_tokens=k)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = rejection_sample(logits, drafts, cu, q, md_cpu, max_num_draft_tokens=k)
    assert torch.equal(res.output_token_ids.cpu(), want.output_token_ids)
