"""Gemma 3 text (`Gemma3ForCausalLM`) on the one decoder: a tiny random checkpoint written
by HF transformers (three layers, sliding-global-sliding, window 16) gives HF's logits
and, batched through the engine, HF's greedy tokens on prompts and generations longer
than the window, under chunked prefill, preemption and prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from llmfast.models.families import hf_dict_from_model_config, model_config_from_hf
from llmfast.models.sources.random_presets import RANDOM_PRESETS
from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.hf_baseline import assert_hf_baseline_logits
from tests.helpers.hf_oracle import greedy_oracle
from tests.test_engine import _check, _llm
from tests.test_sliding_models import long_workload


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = make_hf_checkpoint(tmp_path_factory.mktemp("gemma3") / "ckpt", family="gemma3_text",
                              tie=True)
    return path, load_hf_model(path)


def test_config_reads_gemma_options(gemma):
    import json

    config = model_config_from_hf(json.loads((gemma[0] / "config.json").read_text()))
    assert config.architecture == "Gemma3ForCausalLM"
    assert config.norm_offset and config.sandwich_norms and config.embed_scale
    assert config.qk_norm and config.hidden_act == "gelu_pytorch_tanh"
    assert config.rope_local_theta == 100.0 and config.rope_theta == 10000.0
    assert config.attention_scale == 24**-0.5 and config.final_logit_softcapping == 3.0
    assert [config.layer_window(i) for i in range(3)] == [16, None, 16]


def test_logits_match_hf_past_the_window(gemma):
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model
    from tests.helpers.paged import PagedSequences

    path, hf = gemma
    ours = build_model(resolve_model(str(path)), torch.float32, "cpu", max_positions=128)
    prompt = [(7 * i + 3) % 250 + 3 for i in range(50)]  # 50 tokens, window 16
    got = PagedSequences(ours, num_seqs=1, max_len=64).step({0: prompt})
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_engine_matches_hf_past_the_window(gemma):
    path, hf = gemma
    prompts, lengths = long_workload(5)
    # Three KV-cache groups of one layer each (core/kv_cache_groups.py): a block id is
    # one layer's page, and 56 of them (51 hold one 128-token sequence) still preempt.
    llm = _llm(path, max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=56)
    outs = _check(llm, prompts, lengths, greedy_oracle(hf))
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0 and sum(o.num_cached_tokens for o in outs) > 0


@pytest.mark.parametrize("preset, hidden, layers, window", [
    ("gemma-3-1b", 1152, 26, 512), ("gemma-3-4b", 2560, 34, 1024)])
def test_presets_are_gemma3_shapes(preset, hidden, layers, window):
    from transformers import AutoConfig

    config = RANDOM_PRESETS[preset]
    assert (config.hidden_size, config.num_hidden_layers, config.sliding_window) == (
        hidden, layers, window)
    hf_dict = hf_dict_from_model_config(config)
    hf = AutoConfig.for_model("gemma3_text", **{k: v for k, v in hf_dict.items()
                                                 if k != "model_type"})
    assert list(hf.layer_types) == list(config.layer_types)
    assert hf.layer_types.count("full_attention") == layers // 6  # 5 sliding : 1 global
    assert hf.query_pre_attn_scalar == 256 and hf.sliding_window == window


def test_random_weights_map_to_hf_gemma3():
    """The HF baseline of a random Gemma 3 (bench/hf.py: llmfast's weights copied into
    HF's model, its embedding scale restored) computes llmfast's logits past the window."""
    from llmfast.models.families import family_config

    config = family_config(
        "Gemma3ForCausalLM", hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=300,
        tie_word_embeddings=True, max_position_embeddings=128, sliding_window=8,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=32.0, rope_local_theta=100.0)

    def perturb(name, p):  # random weights: norms of 0 (scale 1), small projections
        p.uniform_(-0.5, 0.5) if "norm" in name else p.mul_(5.0)

    assert_hf_baseline_logits(config, list(range(7, 37)), perturb)


@pytest.mark.slow
def test_compiled_engine_matches_hf(gemma):
    """Piecewise-compiled (Inductor on CPU): the sandwich layers and the per-layer
    windows and RoPE tables through the split graph."""
    path, hf = gemma
    prompts, lengths = long_workload(6)
    llm = _llm(path, max_num_batched_tokens=16, max_num_seqs=8, compile=True)
    _check(llm, prompts, lengths, greedy_oracle(hf))
    assert llm.engine.runner.compiled.stats.one_graph
