"""Async scheduling on a GPU: steady-state steps never synchronise the host with the device
(except the one designated wait for the sampled ids), outputs equal the synchronous loop,
and the phase timer reports device time under CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from llmfast import LLM, SamplingParams
from llmfast.profiling.phase_timing import PhaseTimer
from llmfast.worker.step_output import PendingStep
from tests.test_async_scheduling import _run, _workload

pytestmark = pytest.mark.gpu

MODES = [pytest.param(True, id="eager"), pytest.param(False, id="graphs")]


def _gpu_llm(enforce_eager: bool, async_scheduling: bool = True, **kw):
    args = {"device": "cuda", "dtype": "float32", "max_model_len": 256, "max_num_seqs": 16,
            "max_num_batched_tokens": 512, "seed": 0, "enforce_eager": enforce_eager,
            "async_scheduling": async_scheduling}
    args.update(kw)
    return LLM("random:tiny", **args)


def _mixed_params():
    """Every sampler stage: greedy, seeded random with top-k/p, min-p, penalties,
    min_tokens (stop ids banned for a while), logprobs, logit bias and allowed ids."""
    return [
        SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=200,
                       ignore_eos=True),
        SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2,
                       frequency_penalty=0.3, presence_penalty=0.2, max_tokens=200,
                       ignore_eos=True),
        SamplingParams(temperature=0.7, min_tokens=150, stop_token_ids=(5, 6),
                       max_tokens=200),
        SamplingParams(temperature=0.9, seed=3, logit_bias={7: 2.0, 9: -3.0},
                       allowed_token_ids=list(range(5, 40)), max_tokens=200, ignore_eos=True),
    ]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("enforce_eager", MODES)
def test_steady_state_steps_never_sync(enforce_eager, async_scheduling, monkeypatch):
    engine = _gpu_llm(enforce_eager, async_scheduling).engine
    for i, params in enumerate(_mixed_params()):
        engine.add_request({"prompt_token_ids": [3 + i] * (10 + 7 * i)}, params)
    for _ in range(6):  # prefills, first decodes, lazy allocations
        engine.step()
    torch.cuda.synchronize()
    wait = PendingStep.wait
    waits = []

    def designated_wait(self):  # the one place the host may wait for the device
        torch.cuda.set_sync_debug_mode(0)
        try:
            waits.append(1)
            return wait(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(PendingStep, "wait", designated_wait)
    torch.cuda.set_sync_debug_mode("error")
    try:
        counts = [len(engine.step()) for _ in range(8)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert counts == [len(_mixed_params())] * 8 and len(waits) == 8


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("enforce_eager", MODES)
def test_prompt_logprobs_steps_never_sync(enforce_eager, async_scheduling, monkeypatch):
    """Scoring a 200-token prompt beside decoding requests (the CPU stand-in:
    tests/test_host_sync_free.py): no sync but the designated wait, and every prompt
    token gets a logprob."""
    engine = _gpu_llm(enforce_eager, async_scheduling).engine
    for i, params in enumerate(_mixed_params()):
        engine.add_request({"prompt_token_ids": [3 + i] * (10 + 7 * i)}, params)
    scoring = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=5)
    engine.add_request({"prompt_token_ids": list(range(3, 203))}, scoring)  # grows buffers
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    wait = PendingStep.wait

    def designated_wait(self):
        torch.cuda.set_sync_debug_mode(0)
        try:
            return wait(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(PendingStep, "wait", designated_wait)
    req_id = engine.add_request({"prompt_token_ids": list(range(4, 204))}, scoring)
    finished = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = finished[req_id]
    assert len(out.prompt_logprobs) == 200 and out.prompt_logprobs[0] is None
    assert all(entry[t] <= 0 and len(entry) in (5, 6)
               for t, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]))


@pytest.mark.parametrize("enforce_eager", MODES)
def test_async_outputs_equal_sync_on_cuda(enforce_eager):
    items = _workload(0)
    results = {}
    for mode in (False, True):
        engine = _gpu_llm(enforce_eager, mode, max_model_len=96, block_size=16,
                          num_gpu_blocks_override=24, max_num_batched_tokens=40,
                          max_num_seqs=12).engine
        results[mode], _ = _run(engine, items)
        manager = engine.scheduler.kv_cache_manager
        assert manager.get_num_free_blocks() == manager.num_usable_blocks
    for i, (tokens, reason, _, num_times) in results[False].items():
        other = results[True][i]
        assert (tokens, reason, num_times) == (other[0], other[1], other[3]), i


def test_phase_timer_shows_device_time_under_cuda_graphs():
    engine = _gpu_llm(False, True).engine
    for i in range(8):
        engine.add_request({"prompt_token_ids": [3 + i] * 20},
                           SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    stats = {}
    for mode in (False, True):
        engine.set_async_scheduling(mode)
        timer = PhaseTimer("cuda")
        engine.set_phase_timer(timer)
        for _ in range(10):
            engine.step()
        engine.set_phase_timer(None)
        stats[mode] = timer.summary()
    for mode in (False, True):
        forward = stats[mode]["forward"]
        assert forward.calls == 10 and forward.device_ms > 0
        assert stats[mode]["sample"].device_ms > 0
    # The synchronous loop updates only after the device finished: nothing to overlap
    # (20 us a call of slack: device times reach the host clock through one reference).
    sync_update = stats[False]["update"]
    assert sync_update.overlap_ms <= 0.2 * sync_update.host_ms + 0.02 * sync_update.calls
