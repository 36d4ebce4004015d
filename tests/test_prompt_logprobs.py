"""Prompt logprobs (SamplingParams.prompt_logprobs) against HF transformers' float32
log-softmax of the same tiny checkpoint: chunked prefill, a batch mixing requests with
and without them, the prefix cache (never a hit for such a request), preemption mid-prompt
(no entry twice), async scheduling, the mp executor under tensor parallelism, and
full-graph steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llmfast import LLM, SamplingParams
from llmfast.config import CudaGraphMode
from llmfast.core.request import RequestStatus
from llmfast.engine import LLMEngine
from llmfast.engine.args import EngineArgs
from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.engine_config import engine_config

TOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("prompt-logprobs") / "ckpt")


@pytest.fixture(scope="module")
def hf_logprobs(ckpt):
    """prompt -> HF's [len, vocab] float32 log-softmax of the logits at each position."""
    hf = load_hf_model(ckpt)

    def logprobs(prompt: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)

    return logprobs


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=g).tolist()


def _llm(ckpt, **kw) -> LLM:
    args = dict(device="cpu", max_model_len=128, block_size=4, seed=0)
    return LLM(str(ckpt), **{**args, **kw})


def _params(n: int | None, max_tokens: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, prompt_logprobs=n,
                          ignore_eos=True)


def check_against_hf(out, n: int, hf_logprobs) -> None:
    """Every entry: the prompt token's logprob first, then the top n; HF's values at
    every id, HF's top-n values, the prompt token's rank in HF's distribution."""
    prompt = out.prompt_token_ids
    entries, ranks = out.prompt_logprobs, out.prompt_logprob_ranks
    assert len(entries) == len(ranks) == len(prompt)
    assert entries[0] is None and ranks[0] is None
    want = hf_logprobs(prompt)
    for i in range(1, len(prompt)):
        row, token, entry = want[i - 1], prompt[i], entries[i]
        assert next(iter(entry)) == token
        for t, lp in entry.items():
            assert lp == pytest.approx(row[t].item(), abs=TOL)
        # n + 1 entries, or n when the prompt token is one of the top n.
        assert len(entry) in (n, n + 1)
        top = list(entry)[1:] if len(entry) == n + 1 else list(entry)
        assert sorted((entry[t] for t in top), reverse=True) == pytest.approx(
            row.topk(n).values.tolist(), abs=TOL)
        lo = int((row > row[token] + TOL).sum()) + 1
        hi = int((row >= row[token] - TOL).sum())
        assert lo <= ranks[i] <= hi


def test_chunked_batch_mixing_requests_with_and_without(ckpt, hf_logprobs):
    """A 100-token prompt over 16-token steps, next to short prompts that ask for none,
    for 0 (only the prompt token) and for 5 alternatives."""
    llm = _llm(ckpt, max_num_batched_tokens=16, max_num_seqs=4)
    prompts = [_prompt(0, 100), _prompt(1, 9), _prompt(2, 23), _prompt(3, 1)]
    ns = [3, None, 0, 5]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [_params(n, max_tokens=4) for n in ns])
    for out, n in zip(outs, ns):
        if n is None:
            assert out.prompt_logprobs is None and out.prompt_logprob_ranks is None
        else:
            check_against_hf(out, n, hf_logprobs)
    assert outs[3].prompt_logprobs == [None]  # one token: nothing to score
    # Sampling is untouched: the greedy tokens are those of a run without them.
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts],
                         [_params(None, max_tokens=4)] * 4)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_same_prompt_twice_takes_no_prefix_cache_hits(ckpt, hf_logprobs):
    llm = _llm(ckpt, max_num_batched_tokens=32)
    prompt = {"prompt_token_ids": _prompt(4, 40)}
    first = llm.generate(prompt, _params(2))[0]
    second = llm.generate(prompt, _params(2))[0]
    assert second.num_cached_tokens == 0
    check_against_hf(second, 2, hf_logprobs)
    assert second.prompt_logprobs[0] is None and first.prompt_logprobs[0] is None
    for got, want in zip(second.prompt_logprobs[1:], first.prompt_logprobs[1:], strict=True):
        assert got.keys() == want.keys() and got == pytest.approx(want)  # a flat dict
    # The blocks it computed are cached for others all the same.
    assert llm.generate(prompt, _params(None))[0].num_cached_tokens == 36


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_mid_prompt_has_each_entry_once(ckpt, hf_logprobs, async_scheduling):
    """40 blocks of 4 tokens for 6 requests of 60-token prompts (+ 24 generated): the
    third is preempted while its prompt is partly scored, and scores it again."""
    llm = _llm(ckpt, num_gpu_blocks_override=40, max_model_len=96,
               max_num_batched_tokens=16, async_scheduling=async_scheduling)
    engine = llm.engine
    params = _params(2, max_tokens=24)
    ids = [engine.add_request({"prompt_token_ids": _prompt(10 + i, 60)}, params)
           for i in range(6)]
    finished, preempted_mid_prompt = {}, False
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        for req_id, state in engine.output_processor.states.items():
            request = engine.scheduler.requests.get(req_id)
            if request is not None and request.status is RequestStatus.PREEMPTED:
                preempted_mid_prompt |= 1 < len(state.prompt_logprobs) < 60
    assert preempted_mid_prompt
    for req_id in ids:
        check_against_hf(finished[req_id], 2, hf_logprobs)


def test_mp_tensor_parallel_carries_prompt_logprobs(ckpt, hf_logprobs):
    llm = LLM(str(ckpt), device="cpu", max_model_len=96, block_size=4, seed=0,
              tensor_parallel_size=2, distributed_executor_backend="mp",
              max_num_batched_tokens=16, async_scheduling=True)
    try:
        prompts = [_prompt(20, 37), _prompt(21, 12)]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [_params(4, max_tokens=3), _params(None, max_tokens=3)])
        check_against_hf(outs[0], 4, hf_logprobs)
        assert outs[1].prompt_logprobs is None
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("value", [-1, 21, 1.5, "3", True])
def test_bad_prompt_logprobs_is_a_one_line_value_error(value):
    with pytest.raises(ValueError, match="prompt_logprobs") as exc:
        SamplingParams(prompt_logprobs=value)
    assert "\n" not in str(exc.value)


def test_one_token_prompt_chunks_in_full_graph_steps(ckpt, hf_logprobs):
    """A 2-token budget next to a decoding request: the other's prompt goes one token a
    step, in uniform-decode steps that replay a full graph (emulated on CPU), whose
    logits rows are the step's token rows."""
    args = EngineArgs(model=str(ckpt), device="cpu", max_model_len=64, block_size=4, seed=0,
                      compile=True, max_num_seqs=2, max_num_batched_tokens=2,
                      cuda_graph_sizes=(1, 2))
    config, source = engine_config(args)
    config = dataclasses.replace(config, compile=dataclasses.replace(
        config.compile, cuda_graph_mode=CudaGraphMode.FULL_AND_PIECEWISE,
        emulate_cuda_graphs=True))
    engine = LLMEngine(config, source)
    full = engine.runner.compiled.graphs.full
    engine.add_request({"prompt_token_ids": _prompt(30, 3)}, _params(None, max_tokens=20))
    engine.step()
    engine.step()  # its prompt is in: it decodes from now on
    req_id = engine.add_request({"prompt_token_ids": _prompt(31, 12)}, _params(3))
    before = full.num_replays
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert full.num_replays - before >= 10
    check_against_hf(outs[req_id], 3, hf_logprobs)
