"""The CUDA path of a mixture of experts as far as a CPU goes: the engine on a tiny
Qwen3-MoE checkpoint with every Triton kernel (the fused MoE layer, attention) run by the
Triton interpreter in a child process, eager and then compiled with emulated full and
piecewise CUDA graphs (static shapes, captured buffers), against HF's greedy tokens."""

from __future__ import annotations

import json

import pytest

from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.interpreted import run_interpreted
from tests.helpers.hf_oracle import greedy_oracle
from tests.helpers.full_graphs import arrival_workload

_CHILD = """
import json, sys
from llmfast import SamplingParams
from llmfast.config import CudaGraphMode
from tests.helpers.full_graphs import arrival_workload, emulated_graph_engine, run_with_arrivals

path = {path!r}
prompts, lengths, arrivals = arrival_workload()
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
eager = run_with_arrivals(emulated_graph_engine(path, None), prompts, params, arrivals)
full = emulated_graph_engine(path, CudaGraphMode.FULL_AND_PIECEWISE)
graphs = run_with_arrivals(full, prompts, params, arrivals)
print(json.dumps({{"eager": eager, "graphs": graphs,
                  "full_replays": full.runner.compiled.graphs.full.num_replays,
                  "triton_moe": "llmfast.kernels.moe.triton_moe" in sys.modules}}))
"""


@pytest.mark.slow
def test_engine_with_interpreted_triton_moe_matches_hf(tmp_path):
    path = make_hf_checkpoint(tmp_path / "ckpt", family="qwen3_moe")
    result = run_interpreted(_CHILD.format(path=str(path)), timeout_s=1500,
                             LLMFAST_LAYER_KERNELS="0", LLMFAST_CACHE=str(tmp_path / "cache"))
    assert result["triton_moe"] and result["full_replays"] > 0
    oracle = greedy_oracle(load_hf_model(path))
    prompts, lengths, _ = arrival_workload()
    want = [oracle(p, n) for p, n in zip(prompts, lengths)]
    assert result["eager"] == want, json.dumps(result)[:500]
    assert result["graphs"] == want
