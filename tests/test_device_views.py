"""The engine with its buffers' device views apart from their host views, on the CPU.

On a CPU `CpuGpuBuffer.gpu` and `StagingBuffer.gpu` are the host tensors themselves, so
a step that reads a device view its input preparation never copied to would still see
the right values; on CUDA it would read stale ones. Here each device view is a tensor
of its own, filled with junk until its first copy (as a GPU buffer holds whatever was
there), and the engine must still give the oracle's tokens: HF's greedy ones on the
CUDA default's path (full and piecewise graphs, async scheduling, RoPE in the attention
op), and the aliased views' tokens with every sampling feature on.
"""

from __future__ import annotations

import torch

from llmfast import SamplingParams
from llmfast.config import CudaGraphMode
from llmfast.worker import buffers
from tests.helpers.full_graphs import (
    arrival_workload,
    emulated_graph_engine,
    greedy_matches_hf,
    rope_in_the_op,
    run_with_arrivals,
)

JUNK = 77  # what a device view holds before its first copy


def _separate_device_views(monkeypatch) -> None:
    init = buffers.CpuGpuBuffer.__init__

    def separate_init(self, *shape, dtype, device):
        init(self, *shape, dtype=dtype, device=device)
        self.gpu = (torch.ones_like(self.cpu) if dtype == torch.bool
                    else torch.full_like(self.cpu, JUNK))

    def separate_grow(self, numel):
        numel = max(numel, 2 * self.cpu.numel(), 256)
        self.cpu = torch.empty(numel, dtype=self.dtype)
        self._np = self.cpu.numpy()
        self.gpu = torch.full((numel,), JUNK, dtype=self.dtype)

    monkeypatch.setattr(buffers.CpuGpuBuffer, "__init__", separate_init)
    monkeypatch.setattr(buffers.StagingBuffer, "_grow", separate_grow)


def test_cuda_default_path_with_separate_device_views_matches_hf(ckpt, oracle,
                                                                  monkeypatch, tmp_path):
    _separate_device_views(monkeypatch)
    rope_in_the_op(monkeypatch, tmp_path)
    engine = emulated_graph_engine(ckpt, CudaGraphMode.FULL_AND_PIECEWISE)
    assert engine.runner.inputs.input_ids.gpu is not engine.runner.inputs.input_ids.cpu
    greedy_matches_hf(engine, oracle)


def test_sampling_features_with_separate_device_views(ckpt, monkeypatch):
    # Penalties, seeds, logprobs, logit bias, min_tokens and stop ids read per-request
    # state from staged device views: the same tokens as with the views aliased.
    prompts, lengths, arrivals = arrival_workload(seed=3)
    params = [SamplingParams(temperature=0.8 if i % 2 else 0.0, top_p=0.9, top_k=20,
                             max_tokens=n, seed=100 + i, ignore_eos=True,
                             repetition_penalty=1.3, presence_penalty=0.5,
                             frequency_penalty=0.2, logprobs=3 if i % 3 == 0 else None,
                             logit_bias={5: 3.0} if i % 4 == 1 else None,
                             min_tokens=2, stop_token_ids=[9])
              for i, n in enumerate(lengths)]
    results = []
    for separate in (False, True):
        if separate:
            _separate_device_views(monkeypatch)
        engine = emulated_graph_engine(ckpt, None)
        engine.set_async_scheduling(True)
        results.append(run_with_arrivals(engine, prompts, params, arrivals))
    assert results[1] == results[0]
