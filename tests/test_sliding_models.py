"""Sliding-window models at full context: tiny random Mistral (window 16 on every layer)
and Qwen2 (use_sliding_window, window 16 from max_window_layers on: one global layer,
one sliding) give HF transformers' greedy tokens on prompts and generations longer than
the window, batched, under chunked prefill, preemption and prefix-cache hits."""

from __future__ import annotations

import random

import pytest

from llmfast.config import ModelConfig
from llmfast.models.families import hf_dict_from_model_config, model_config_from_hf
from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.hf_oracle import greedy_oracle
from tests.test_engine import _check, _llm

WINDOW = 16
CHECKPOINTS = {
    "mistral": dict(family="mistral", sliding_window=WINDOW),
    "qwen2": dict(family="qwen2", sliding_window=WINDOW, use_sliding_window=True,
                  max_window_layers=1),
}


def long_workload(seed: int, shared_prefix: int = 20) -> tuple[list[list[int]], list[int]]:
    """12 prompts of a shared prefix plus 1-39 ids, each generating 10-34 tokens: most
    run past the window, some prompts alone do."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 256) for _ in range(shared_prefix)]
    prompts = [prefix + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))]
               for _ in range(12)]
    return prompts, [rng.randrange(10, 35) for _ in prompts]


@pytest.fixture(scope="module")
def sliding_env(tmp_path_factory):
    envs = {}

    def get(name: str):
        if name not in envs:
            path = make_hf_checkpoint(tmp_path_factory.mktemp(name) / "ckpt",
                                      **CHECKPOINTS[name])
            envs[name] = (path, greedy_oracle(load_hf_model(path)))
        return envs[name]

    return get


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_sliding_window_model_matches_hf_past_the_window(sliding_env, name):
    ckpt, oracle = sliding_env(name)
    prompts, lengths = long_workload(3)
    assert max(len(p) + n for p, n in zip(prompts, lengths)) > 3 * WINDOW
    # Mistral's blocks leave the window and are freed (tests/test_sliding_kv_cache.py):
    # fewer of them still preempt.
    blocks = 33 if name == "mistral" else 48
    llm = _llm(ckpt, max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=blocks)
    assert llm.engine.config.scheduler.max_model_len == 128  # not clamped to the window
    outs = _check(llm, prompts, lengths, oracle)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0 and sum(o.num_cached_tokens for o in outs) > 0
    windows = [layer.window for layer in llm.engine.runner.model.attention_layers()]
    assert windows == ([WINDOW, WINDOW] if name == "mistral" else [None, WINDOW])


def test_layer_windows_read_from_config():
    qwen = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "vocab_size": 256, "sliding_window": 32,
            "use_sliding_window": True, "max_window_layers": 3}
    config = model_config_from_hf(qwen)
    assert [config.layer_window(i) for i in range(4)] == [None, None, None, 32]
    assert model_config_from_hf({**qwen, "use_sliding_window": False}).sliding_window is None
    # transformers 5's layer_types win over the Qwen flags
    typed = {**qwen, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert [model_config_from_hf(typed).layer_window(i) for i in range(4)] == [32, None] * 2
    back = model_config_from_hf(hf_dict_from_model_config(config))
    assert back.layer_types == config.layer_types and back.sliding_window == 32
    mistral = {**qwen, "architectures": ["MistralForCausalLM"]}
    assert [model_config_from_hf(mistral).layer_window(i) for i in range(4)] == [32] * 4


def test_bad_layer_types_refused():
    from llmfast.config import ConfigError

    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=4, intermediate_size=8, vocab_size=8,
                    sliding_window=4, layer_types=("sliding_attention",))


@pytest.mark.slow
def test_compiled_sliding_window_model_matches_hf(sliding_env):
    """Piecewise-compiled (Inductor on CPU): the window passes through the split graph."""
    ckpt, oracle = sliding_env("qwen2")
    prompts, lengths = long_workload(4)
    llm = _llm(ckpt, max_num_batched_tokens=16, max_num_seqs=8, compile=True)
    _check(llm, prompts, lengths, oracle)
    assert llm.engine.runner.compiled.stats.one_graph
