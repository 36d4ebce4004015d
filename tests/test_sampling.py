"""Sampler tests: seeded batch invariance, filters, penalties, min_tokens, logprobs, no sync."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from llmfast.sampling_params import SamplingParams, seed_to_int64
from llmfast.worker.sampling.sampler import (
    Sampler,
    apply_logit_rules,
    apply_penalties,
    seeded_exponential,
)
from llmfast.worker.sampling.sampling_metadata import (
    SamplingMetadata,
    worst_case_sampling_metadata,
)
from tests.helpers.sampling import metadata_from_params

SP = SamplingParams


def make_md(params, vocab_size, **kw) -> SamplingMetadata:
    return metadata_from_params(params, vocab_size=vocab_size, **kw)


def sample(logits, params, **kw):
    return Sampler()(logits, make_md(params, logits.shape[-1], **kw))


def rand_logits(n, vocab_size, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab_size, generator=g) * scale


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---- seeded sampling ---------------------------------------------------------------


def test_seeded_exponential_is_a_pure_function_of_seed_step_token():
    seeds = torch.tensor([seed_to_int64(s) for s in (1, 2, 1, 2**64 - 1, 2**63)])
    steps = torch.tensor([0, 0, 5, 0, 0])
    q = seeded_exponential(seeds, steps, 64)
    # Same (seed, step) in another batch position / batch size -> same noise.
    q_single = seeded_exponential(seeds[2:3], steps[2:3], 64)
    assert torch.equal(q[2], q_single[0])
    assert not torch.equal(q[0], q[1])  # seed matters
    assert not torch.equal(q[0], q[2])  # step matters
    assert (q >= 0).all() and torch.isfinite(q).all()


def test_seeded_exponential_has_exp1_moments():
    seeds = torch.arange(64, dtype=torch.int64)
    q = seeded_exponential(seeds, torch.zeros(64, dtype=torch.int64), 8192)
    assert abs(q.mean().item() - 1.0) < 0.01
    assert abs(q.var().item() - 1.0) < 0.03
    # Neighbouring tokens and neighbouring steps look independent.
    flat = q.flatten() - 1.0
    assert abs((flat[1:] * flat[:-1]).mean().item()) < 0.01
    q_next = seeded_exponential(seeds, torch.ones(64, dtype=torch.int64), 8192)
    assert abs(((q - 1) * (q_next - 1)).mean().item()) < 0.01


ROW_CONFIGS = [
    dict(temperature=0.9),
    dict(temperature=1.3, top_k=20),
    dict(temperature=0.7, top_p=0.85),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=1.1, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.3,
         presence_penalty=0.5, frequency_penalty=0.3, logprobs=2),
]


@pytest.mark.parametrize("cfg", ROW_CONFIGS)
def test_seeded_row_is_independent_of_batch_composition(cfg):
    vocab_size = 500
    target = rand_logits(1, vocab_size, seed=1)
    others = rand_logits(7, vocab_size, seed=2)
    batch_logits = torch.cat([others[:3], target, others[3:]])
    mine = SP(seed=1234, **cfg)
    neighbours = [
        SP(temperature=0.0), SP(temperature=0.8, top_p=0.5), SP(seed=1234),
        SP(temperature=1.0, top_k=3, repetition_penalty=2.0), SP(temperature=0.0, logprobs=5),
        SP(temperature=2.0, min_p=0.3, seed=99), SP(temperature=0.5, frequency_penalty=1.0),
    ]
    params = neighbours[:3] + [mine] + neighbours[3:]
    prompt = [[1, 2, 3, 4]]
    alone, in_batch = [], []
    for step in range(12):
        out = [step % 5, 7, 7]
        alone.append(int(sample(target, [mine], steps=[step], prompt_token_ids=prompt,
                                output_token_ids=[out]).sampled_token_ids[0]))
        res = sample(batch_logits, params, steps=[step * 3 + i for i in range(8)][:3] + [step]
                     + [step + 100 + i for i in range(4)], prompt_token_ids=prompt * 8,
                     output_token_ids=[[5, 6]] * 3 + [out] + [[9]] * 4)
        in_batch.append(int(res.sampled_token_ids[3]))
    assert alone == in_batch
    assert len(set(alone)) > 1  # different steps draw differently


def test_unseeded_rows_use_the_global_generator():
    logits = torch.zeros(4, 1000)
    torch.manual_seed(0)
    a = sample(logits, [SP()] * 4).sampled_token_ids
    torch.manual_seed(0)
    b = sample(logits, [SP()] * 4).sampled_token_ids
    c = sample(logits, [SP()] * 4).sampled_token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


# ---- distributions and filters -----------------------------------------------------


@pytest.mark.parametrize("mode", ["seeds", "steps", "unseeded"])
def test_temperature_sampling_matches_softmax(mode):
    n, temperature = 20000, 0.7
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.0, 1.5, 0.2])
    if mode == "seeds":
        params, steps = [SP(temperature=temperature, seed=s) for s in range(n)], None
    elif mode == "steps":
        params, steps = [SP(temperature=temperature, seed=7)] * n, list(range(n))
    else:
        torch.manual_seed(0)
        params, steps = [SP(temperature=temperature)] * n, None
    ids = sample(logits.expand(n, -1), params, steps=steps).sampled_token_ids
    counts = torch.bincount(ids, minlength=8).float()
    # 7 degrees of freedom: P(chi2 > 30) ~ 1e-4.
    assert chi_square(counts, torch.softmax(logits / temperature, -1)) < 30


def allowed_set(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Naive oracle: temperature -> top-k -> top-p -> min-p on one row."""
    probs = torch.softmax(logits.double() / p.temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if p.top_k:
        order = order[: p.top_k]
    total = sum(probs[i] for i in order)
    kept, mass = [], 0.0
    for i in order:
        kept.append(i)
        mass += probs[i] / total
        if mass >= p.top_p:
            break
    top = probs[kept[0]]
    return {i for i in kept if probs[i] >= p.min_p * top}


FILTERS = [
    SP(top_k=5),
    SP(top_p=0.6, temperature=1.5),
    SP(min_p=0.2),
    SP(top_k=10, top_p=0.8, min_p=0.05, temperature=1.2),
    SP(top_k=1, temperature=3.0),
    SP(top_p=0.01),
]


def check_filtered_samples(logits, rows, ids):
    for f in FILTERS:
        got = {t for r, t in enumerate(ids) if rows[r] is f}
        if not got:
            continue
        allowed = allowed_set(logits, f)
        assert got <= allowed, (f, got - allowed)
        if len(allowed) <= 10:
            assert got == allowed  # nothing allowed is filtered out (n is large enough)


@pytest.mark.parametrize("mixed", [False, True])
def test_filters_never_emit_outside_allowed_set(mixed):
    vocab_size, n = 32, 3000
    logits = rand_logits(1, vocab_size, seed=3, scale=1.5)[0]
    # One batch per filter config, or every config in one batch (row r uses r % 6).
    batches = [[FILTERS[r % len(FILTERS)] for r in range(n)]] if mixed else [
        [f] * (n // 3) for f in FILTERS]
    for rows in batches:
        params = [dataclasses.replace(p, seed=r) for r, p in enumerate(rows)]
        ids = sample(logits.expand(len(rows), -1), params).sampled_token_ids.tolist()
        check_filtered_samples(logits, rows, ids)


def test_tiny_top_p_keeps_the_most_likely_token():
    logits = rand_logits(64, 4096, seed=4, scale=0.01)  # near-uniform: cumsum rounding bites
    params = [SP(top_p=1e-8, seed=r) for r in range(64)]
    assert torch.equal(sample(logits, params).sampled_token_ids, logits.argmax(-1))


def test_min_p_and_top_k_only_paths():
    # A batch with top_k but no top_p takes the sort-free topk threshold path.
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]]).expand(2000, -1)
    params = [SP(top_k=2 + r % 2, seed=r) for r in range(2000)]
    ids = sample(logits, params).sampled_token_ids
    assert set(ids[0::2].tolist()) == {0, 1} and set(ids[1::2].tolist()) == {0, 1, 2}


# ---- penalties and min_tokens ------------------------------------------------------


def naive_penalties(logits, prompt, output, p: SamplingParams):
    out = logits.clone()
    for tok in range(logits.shape[0]):
        x = out[tok].item()
        if tok in prompt or tok in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        count = output.count(tok)
        x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
        out[tok] = x
    return out


def test_penalties_match_naive_oracle():
    vocab_size = 20
    logits = rand_logits(4, vocab_size, seed=5)
    params = [
        SP(repetition_penalty=1.5, logprobs=20),
        SP(presence_penalty=0.7, frequency_penalty=0.4),
        SP(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.5),
        SP(),
    ]
    prompts = [[0, 1, 2, 2], [3], [4, 5, 6, 7, 8, 19], [1, 2]]
    outputs = [[2, 9, 9], [3, 3, 3, 10], [], [11, 11]]
    md = make_md(params, vocab_size, prompt_token_ids=prompts, output_token_ids=outputs)
    got = apply_penalties(logits, md)
    for r in range(4):
        want = naive_penalties(logits[r], prompts[r], outputs[r], params[r])
        torch.testing.assert_close(got[r], want)
    # The returned logprobs are log_softmax of exactly these penalised logits.
    res = Sampler()(logits, md)
    lp = torch.log_softmax(got, -1)
    torch.testing.assert_close(res.logprobs.topk_logprobs, lp.sort(-1, descending=True).values)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    eos, vocab_size = 3, 10
    logits = torch.zeros(1, vocab_size)
    logits[0, eos], logits[0, 5] = 10.0, 9.0  # eos, then stop id 5, are the favourites
    p = SP(temperature=0.0, min_tokens=4, stop_token_ids=(5,))
    for step in range(6):
        tok = int(sample(logits, [p], steps=[step], eos_token_id=eos).sampled_token_ids[0])
        assert tok == (eos if step >= 4 else 0)  # argmax of the rest ties -> first index
    # Random rows too, and ignore_eos keeps eos allowed but still bans stop ids.
    n = 500
    rows = [SP(min_tokens=2, stop_token_ids=(5,), seed=r, ignore_eos=r % 2 == 1) for r in range(n)]
    ids = sample(logits.expand(n, -1), rows, steps=[1] * n, eos_token_id=eos).sampled_token_ids
    assert not (ids == 5).any()
    assert not (ids[0::2] == eos).any() and (ids[1::2] == eos).all()
    # A row that reached min_tokens is unaffected by another row still below it.
    rows = [SP(temperature=0.0, min_tokens=4), SP(temperature=0.0, min_tokens=2)]
    ids = sample(logits.expand(2, -1), rows, steps=[2, 2], eos_token_id=eos).sampled_token_ids
    assert ids.tolist() == [5, eos]  # row 0 bans only eos; 5 is no stop id here


def naive_logit_rules(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    out = row.clone()
    if p.allowed_token_ids is not None:
        for t in range(len(out)):
            if t not in p.allowed_token_ids:
                out[t] = -math.inf
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    return out


def test_logit_rules_match_naive_oracle_and_bind_every_sampler_path():
    vocab_size = 30
    logits = rand_logits(5, vocab_size, seed=11)
    params = [SP(logit_bias={3: 100.0, 7: -2.5}), SP(allowed_token_ids=[4, 9, 28]),
              SP(temperature=0.0, logit_bias={0: 1.0, 9: -100.0}, allowed_token_ids=[9, 12]),
              SP(temperature=0.0), SP(top_p=0.9, allowed_token_ids=[5, 6], logprobs=2)]
    md = make_md(params, vocab_size)
    got = apply_logit_rules(logits.clone(), md)
    for r, p in enumerate(params):
        torch.testing.assert_close(got[r], naive_logit_rules(logits[r], p))
    # Through the sampler: a +100 bias wins, allowed sets bind greedy and random rows
    # alike (the biased-down 9 loses to 12), the plain greedy row is untouched, and
    # logprobs are those of the edited logits.
    for seed in range(20):
        res = Sampler()(logits, make_md([dataclasses.replace(p, seed=seed) for p in params],
                                        vocab_size))
        ids = res.sampled_token_ids.tolist()
        assert ids[0] == 3 and ids[1] in (4, 9, 28) and ids[2] == 12
        assert ids[3] == int(logits[3].argmax()) and ids[4] in (5, 6)
    lp = torch.log_softmax(got, -1)
    torch.testing.assert_close(res.logprobs.topk_logprobs[4], lp[4].topk(2).values)


def test_logit_rules_out_of_vocabulary_ids_are_named():
    p = SP(logit_bias={5: 1.0, 40: 2.0})
    assert p.token_ids_outside(50) is None
    assert p.token_ids_outside(40) == ("logit_bias has token id 40, outside the vocabulary "
                                       "[0, 40)")
    assert "allowed_token_ids has token id 7" in SP(allowed_token_ids=[7]).token_ids_outside(7)
    assert SP(logit_bias={}).has_logit_rules is False and hash(p) == hash(p)


# ---- greedy, logprobs, no-sync -----------------------------------------------------


def test_greedy_rows_and_logprobs_match_oracle():
    vocab_size = 50
    logits = rand_logits(6, vocab_size, seed=8)
    params = [SP(temperature=0.0, logprobs=3), SP(seed=1), SP(temperature=0.0),
              SP(temperature=0.5, top_k=4, logprobs=0), SP(temperature=0.0, seed=3), SP()]
    res = sample(logits, params)
    ids = res.sampled_token_ids
    assert ids.dtype == torch.int64 and ids.shape == (6,)
    greedy = [0, 2, 4]
    assert torch.equal(ids[greedy], logits.argmax(-1)[greedy])
    lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(res.logprobs.sampled_logprobs, lp.gather(1, ids[:, None])[:, 0])
    want_lp, want_ids = lp.topk(3, -1)
    assert torch.equal(res.logprobs.topk_ids, want_ids)
    torch.testing.assert_close(res.logprobs.topk_logprobs, want_lp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_greedy_fast_path_and_input_not_mutated(dtype):
    logits = rand_logits(3, 40, seed=9).to(dtype)
    before = logits.clone()
    res = sample(logits, [SP(temperature=0.0)] * 3)
    assert torch.equal(res.sampled_token_ids, logits.argmax(-1)) and res.logprobs is None
    sample(logits, [SP(repetition_penalty=1.2, top_p=0.9, min_p=0.1, seed=1, logprobs=1)] * 3,
           output_token_ids=[[1, 2]] * 3, prompt_token_ids=[[3]] * 3)
    assert torch.equal(logits, before)


def test_worst_case_metadata_turns_every_stage_on_consistently():
    """The start-up memory profile samples with this metadata: every stage must run (no
    skip flag set), and its flags must agree with its tensors, i.e. sample what the same
    requests built from SamplingParams sample."""
    n, vocab = 6, 64
    md = worst_case_sampling_metadata(n, vocab, torch.device("cpu"))
    flags = [f.name for f in dataclasses.fields(md) if f.name.startswith(("no_", "all_"))]
    assert flags and not any(getattr(md, f) for f in flags)
    assert md.max_num_logprobs == 20 and md.max_top_k == vocab // 2
    params = [SamplingParams(temperature=0.0) if r % 2 == 0 else
              SamplingParams(temperature=0.8, top_k=vocab // 2, top_p=0.9, min_p=0.01, seed=r)
              for r in range(n)]
    params = [dataclasses.replace(p, repetition_penalty=1.1, presence_penalty=0.1,
                                  frequency_penalty=0.1, min_tokens=1, stop_token_ids=[0],
                                  logprobs=20, logit_bias={r % vocab: 1.0},
                                  allowed_token_ids=[r, r + 1] if r % 4 == 1 else None)
              for r, p in enumerate(params)]
    ref = metadata_from_params(params, vocab_size=vocab,
                               prompt_token_ids=[[r % vocab] for r in range(n)])
    ref.seeds = md.seeds  # the same draws; the seeds' values do not matter here
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
    got, want = Sampler()(logits, md), Sampler()(logits, ref)
    assert torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    assert torch.equal(got.logprobs.topk_ids, want.logprobs.topk_ids)
    assert not (got.sampled_token_ids == 0).any()  # the pending min_tokens ban holds


def test_forward_runs_on_meta_tensors_so_it_never_reads_device_values():
    # Any .item()/.tolist()/.cpu(), Python branch on a tensor or data-dependent shape
    # raises on meta tensors, so finishing with every stage on proves forward is sync-free.
    vocab_size = 64
    params = [SP(temperature=0.0, logprobs=2),
              SP(top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.2, presence_penalty=0.3,
                 frequency_penalty=0.2, seed=3, min_tokens=5, logprobs=4,
                 logit_bias={3: 2.0}, allowed_token_ids=[3, 9, 11]),
              SP(temperature=0.7, top_k=2)]
    md = make_md(params, vocab_size, prompt_token_ids=[[1, 2], [3], [4, 5, 6]],
                 output_token_ids=[[7], [8, 8], []], eos_token_id=0)
    assert not (md.all_greedy or md.all_random or md.no_penalties or md.no_top_k or md.no_top_p
                or md.no_min_p or md.no_min_tokens or md.no_seeds or md.no_logit_rules)
    meta = dataclasses.replace(md, **{
        f.name: getattr(md, f.name).to("meta") for f in dataclasses.fields(md)
        if isinstance(getattr(md, f.name), torch.Tensor)})
    meta.logit_rules = dataclasses.replace(md.logit_rules, **{
        f.name: getattr(md.logit_rules, f.name).to("meta")
        for f in dataclasses.fields(md.logit_rules)})
    for no_top_p in (False, True):  # the sort path and the topk-threshold path
        res = Sampler()(torch.empty(3, vocab_size, device="meta"),
                        dataclasses.replace(meta, no_top_p=no_top_p))
        assert res.sampled_token_ids.shape == (3,) and res.sampled_token_ids.is_meta
        assert res.logprobs.topk_ids.shape == (3, 4)


def test_forward_traces_as_one_graph():
    # fullgraph=True fails on any graph break, e.g. a data-dependent branch or .item().
    vocab_size = 64
    params = [SP(temperature=0.0, logprobs=1, logit_bias={4: 3.0}),
              SP(top_k=5, top_p=0.9, min_p=0.1, seed=3, repetition_penalty=1.2, min_tokens=5,
                 allowed_token_ids=[0, 7, 9, 30])]
    md = make_md(params, vocab_size, prompt_token_ids=[[1], [2]], output_token_ids=[[3], []],
                 eos_token_id=0)
    logits = rand_logits(2, vocab_size, seed=12)
    compiled = torch.compile(Sampler(), backend="eager", fullgraph=True)
    ids = compiled(logits, md).sampled_token_ids
    assert torch.equal(ids, Sampler()(logits, md).sampled_token_ids)  # both rows deterministic


@pytest.mark.gpu
def test_cuda_no_sync_and_seeded_tokens_match_cpu():
    """The sampler itself never syncs. Its inputs are built first, outside the check:
    `from_params` makes them with torch.tensor(list, device="cuda"), which does sync (the
    engine fills them from pinned buffers instead, checked in tests/test_async_gpu.py)."""
    vocab_size, n = 32000, 16
    logits = rand_logits(n, vocab_size, seed=11)
    params = [SP(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01, repetition_penalty=1.1,
                 frequency_penalty=0.2, seed=100 + r, logprobs=2, min_tokens=r % 3)
              for r in range(n)]
    kw = dict(steps=list(range(n)), prompt_token_ids=[[1, 2, 3]] * n,
              output_token_ids=[[4, 5]] * n, eos_token_id=2)
    md_cpu = make_md(params, vocab_size, **kw)
    md_gpu = make_md(params, vocab_size, device="cuda", **kw)
    logits_gpu = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = Sampler()(logits_gpu, md_gpu)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    cpu_ids = Sampler()(logits, md_cpu).sampled_token_ids
    assert torch.equal(res.sampled_token_ids.cpu(), cpu_ids)


# ---- SamplingParams validation -----------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-0.1), dict(temperature=math.nan), dict(top_p=0.0), dict(top_p=1.5),
    dict(top_k=-2), dict(min_p=1.5), dict(repetition_penalty=0.0), dict(presence_penalty=3.0),
    dict(frequency_penalty=-2.5), dict(max_tokens=0), dict(min_tokens=20, max_tokens=10),
    dict(seed=-1), dict(stop=("",)), dict(stop_token_ids=(-1,)), dict(logprobs=21),
    dict(logit_bias={"3": 1.0}), dict(logit_bias={3: 100.5}), dict(logit_bias={-1: 1.0}),
    dict(logit_bias={3: math.inf}), dict(logit_bias=[3]), dict(allowed_token_ids=[]),
    dict(allowed_token_ids=[-2]), dict(allowed_token_ids=[1.5]),
])
def test_bad_sampling_params_raise_one_line_value_error(kwargs):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    assert "\n" not in str(exc.value) and str(exc.value)


def test_top_k_minus_one_means_off_and_greedy_property():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams().greedy
