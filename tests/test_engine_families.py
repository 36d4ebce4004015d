"""Engine equivalence for Mistral, Qwen2/2.5 and Qwen3 (Llama's is tests/test_engine.py):
batched greedy tokens equal HF transformers' on each prompt alone, for mixed-length
prompts sharing a prefix, under chunked prefill, preemption and prefix-cache hits; eager
for every family, piecewise-compiled (Inductor on CPU, ~20 s cold per model) for Qwen3 in
the default suite and the others under `-m slow`."""

from __future__ import annotations

import pytest

from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.workloads import random_workload as _workload
from tests.helpers.hf_oracle import greedy_oracle
from tests.test_engine import _check, _llm

FAMILIES = ("mistral", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def family_env(tmp_path_factory):
    """family -> (checkpoint, oracle), each built once per module."""
    envs = {}

    def get(family: str):
        if family not in envs:
            # Qwen2 ties its embeddings, as Qwen2.5-0.5B does; the others do not.
            path = make_hf_checkpoint(tmp_path_factory.mktemp(family) / "ckpt", family=family,
                                      tie=family == "qwen2")
            envs[family] = (path, greedy_oracle(load_hf_model(path)))
        return envs[family]

    return get


def _run_all_paths(ckpt, oracle, **kw):
    """One run that chunks prefills (16-token budget), preempts (40 blocks of 4 for 16
    prompts of up to 59 tokens) and hits cached blocks of the 20-token shared prefix."""
    prompts, lengths = _workload(11, shared_prefix=20)
    llm = _llm(ckpt, max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=40,
               **kw)
    outs = _check(llm, prompts, lengths, oracle)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0 and sum(o.num_cached_tokens for o in outs) > 0
    assert stats.kv_cache_usage == 0.0
    return llm


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_matches_hf(family_env, family):
    ckpt, oracle = family_env(family)
    _run_all_paths(ckpt, oracle)


@pytest.mark.parametrize("family", [
    pytest.param("mistral", marks=pytest.mark.slow),
    pytest.param("qwen2", marks=pytest.mark.slow),
    "qwen3",
])
def test_compiled_engine_matches_hf(family_env, family):
    ckpt, oracle = family_env(family)
    llm = _run_all_paths(ckpt, oracle, compile=True)
    assert llm.engine.runner.compiled.stats.one_graph
