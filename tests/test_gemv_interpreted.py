"""The fused decoder layers (models/fused_layer.py: the projections' GEMV with the norms,
SiLU-and-mul and residual adds) in the engine (`--gemv triton --gemv-fuse`), as far as a
CPU goes: a tiny Llama checkpoint with every Triton kernel run by the interpreter in a
child process, eager and then compiled with emulated full and piecewise CUDA graphs (the
skinny_linear op inside the compiled pieces, its choice by rows at run time), against
HF's greedy tokens."""

from __future__ import annotations

import json

import pytest

from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.interpreted import run_interpreted
from tests.helpers.hf_oracle import greedy_oracle
from tests.helpers.full_graphs import arrival_workload

_CHILD = """
import json
from llmfast import SamplingParams
from llmfast.config import CudaGraphMode
from tests.helpers.gemv import record_gemv_rows
from tests.helpers.full_graphs import arrival_workload, emulated_graph_engine, run_with_arrivals

path = {path!r}
prompts, lengths, arrivals = arrival_workload()
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
gemv = dict(gemv="triton", gemv_fuse=True)
with record_gemv_rows() as calls:
    eager = run_with_arrivals(emulated_graph_engine(path, None, **gemv), prompts, params, arrivals)
    full = emulated_graph_engine(path, CudaGraphMode.FULL_AND_PIECEWISE, **gemv)
    graphs = run_with_arrivals(full, prompts, params, arrivals)
print(json.dumps({{"eager": eager, "graphs": graphs, "gemv_rows": sorted(set(calls)),
                  "full_replays": full.runner.compiled.graphs.full.num_replays}}))
"""


@pytest.mark.slow
def test_engine_with_fused_gemv_layers_matches_hf(tmp_path):
    path = make_hf_checkpoint(tmp_path / "ckpt", family="llama")
    result = run_interpreted(_CHILD.format(path=str(path)), timeout_s=1500,
                             LLMFAST_LAYER_KERNELS="0",
                             LLMFAST_CACHE=str(tmp_path / "cache"))
    # Decode steps of 1..6 rows took the GEMV; prefill chunks past 16 rows did not.
    assert result["gemv_rows"] and max(result["gemv_rows"]) <= 16
    assert result["full_replays"] > 0
    oracle = greedy_oracle(load_hf_model(path))
    prompts, lengths, _ = arrival_workload()
    want = [oracle(p, n) for p, n in zip(prompts, lengths)]
    assert result["eager"] == want, json.dumps(result)[:500]
    assert result["graphs"] == want
