"""Mistral, Qwen2/2.5 and Qwen3 next to Llama: the one decoder with each family's options
gives HF transformers' logits (fp32, atol 1e-4 as for Llama) on tiny random checkpoints
that transformers wrote; config.json of each family reads into the right options."""

from __future__ import annotations

import json

import pytest

from llmfast.config import ConfigError
from llmfast.models.families import hf_dict_from_model_config, model_config_from_hf
from llmfast.models.loading.load_error import LoadError
from llmfast.models.sources.model_source import resolve_model
from llmfast.models.sources.random_presets import RANDOM_PRESETS
from tests.helpers.checkpoints import make_hf_checkpoint
from tests.helpers.hf_baseline import assert_hf_baseline_logits
from tests.test_model import _check_prefill_then_decode

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "rope_theta": 10000.0}


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("mistral", {}),
        ("qwen2", {}),  # q/k/v biases
        ("qwen3", {}),  # per-head q/k RMSNorm
        ("qwen3", {"rope_parameters": YARN}),  # the long-context setting Qwen documents
        ("llama", {"attention_bias": True}),  # biases on q, k, v and o_proj
    ],
    ids=["mistral", "qwen2", "qwen3", "qwen3-yarn", "llama-bias"],
)
def test_logits_match_hf(tmp_path, family, overrides):
    path = make_hf_checkpoint(tmp_path / "ckpt", family=family, **overrides)
    config = resolve_model(str(path)).config
    assert config.architecture.lower().startswith(family)
    if "rope_parameters" in overrides:
        assert config.rope_scaling.rope_type == "yarn" and config.rope_scaling.factor == 4.0
    # A 30-token prompt and 5 decodes: many rows of the (scaled) rotation table.
    _check_prefill_then_decode(path, prompt_len=30)


# ------------------------------------------------------------------ config.json reading

# The fields that matter of real config.json files (HF hub, as published).
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24,
    "num_key_value_heads": 2, "max_position_embeddings": 32768, "max_window_layers": 21,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "head_dim": 128, "hidden_size": 1024, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
    "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 151936,
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
}
MISTRAL_7B_V01 = {
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
    "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
    "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
}


def test_real_configs_read_into_family_options():
    qwen25 = model_config_from_hf(QWEN25_05B)
    assert (qwen25.qkv_bias, qwen25.o_bias, qwen25.qk_norm) == (True, False, False)
    assert qwen25.sliding_window is None  # use_sliding_window is false
    assert qwen25.head_dim == 64 and qwen25.tie_word_embeddings
    qwen3 = model_config_from_hf(QWEN3_06B)
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm) == (False, False, True)
    assert qwen3.head_dim == 128 and qwen3.sliding_window is None
    mistral = model_config_from_hf(MISTRAL_7B_V01)
    assert mistral.sliding_window == 4096 and not mistral.qkv_bias
    # Qwen3 without head_dim: transformers' default is 128, not hidden / heads (64 here).
    no_head_dim = {k: v for k, v in QWEN3_06B.items() if k != "head_dim"}
    assert model_config_from_hf(no_head_dim).head_dim == 128
    # Qwen's window applies only to layers from max_window_layers on.
    sliding = {**QWEN25_05B, "use_sliding_window": True}
    assert model_config_from_hf(sliding).sliding_window == 32768
    assert model_config_from_hf({**sliding, "max_window_layers": 24}).sliding_window is None


@pytest.mark.parametrize("preset", sorted(RANDOM_PRESETS))
def test_presets_round_trip_through_config_json(preset):
    """Each preset written as config.json reads back equal, and transformers builds the
    same shapes from it (what `bench --baseline hf` relies on)."""
    from transformers import AutoConfig

    config = RANDOM_PRESETS[preset]
    hf_dict = hf_dict_from_model_config(config)
    assert model_config_from_hf(hf_dict) == config
    hf = AutoConfig.for_model(hf_dict["model_type"], **{
        k: v for k, v in hf_dict.items() if k != "model_type"})
    assert hf.head_dim == config.head_dim
    assert hf.num_key_value_heads == config.num_key_value_heads
    assert getattr(hf, "attention_bias", config.o_bias) == config.o_bias


def test_presets_have_real_shapes():
    qwen3 = RANDOM_PRESETS["qwen3-8b"]
    assert (qwen3.hidden_size, qwen3.num_hidden_layers, qwen3.head_dim) == (4096, 36, 128)
    assert qwen3.qk_norm and not qwen3.tie_word_embeddings
    assert RANDOM_PRESETS["qwen2.5-0.5b"].qkv_bias
    assert RANDOM_PRESETS["qwen3-0.6b"].tie_word_embeddings
    mistral = RANDOM_PRESETS["mistral-7b"]
    assert mistral.architecture == "MistralForCausalLM" and mistral.vocab_size == 32768


# ------------------------------------------------------------------------- refusals


def _one_line(exc: Exception) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg
    return msg


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Phi3ForCausalLM"], "model_type": "phi3"}))
    with pytest.raises(LoadError) as e:
        resolve_model(str(tmp_path))
    msg = _one_line(e.value)
    assert "Phi3ForCausalLM" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM"):
        assert arch in msg


@pytest.mark.parametrize(("change", "fragment"), [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "longrope"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.7,
                       "mscale_all_dim": 0.7, "original_max_position_embeddings": 4096}},
     "mscale"),
])
def test_unsupported_options_refused(change, fragment):
    with pytest.raises(ConfigError) as e:
        model_config_from_hf({**QWEN3_06B, **change})
    assert fragment in _one_line(e.value)


def test_sliding_window_model_runs_past_its_window(tmp_path):
    """A windowed model is neither clamped nor refused: its attention keeps to the
    window (tests/test_sliding_models.py checks the tokens)."""
    from llmfast import LLM

    path = make_hf_checkpoint(tmp_path / "ckpt", family="mistral", sliding_window=32)
    llm = LLM(str(path), device="cpu", max_model_len=64, block_size=4)
    assert llm.engine.config.scheduler.max_model_len == 64


# The mixtures of experts' fields (4 experts, top 2; Mixtral's experts are its MLP size;
# Qwen3-MoE's layer 1 dense).
_EXPERTS = {
    "Qwen3MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True, dense_layers=(1,)),
    "MixtralForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                               norm_topk_prob=True),
}


@pytest.mark.parametrize("architecture", ["MistralForCausalLM", "Qwen2ForCausalLM",
                                          "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                          "MixtralForCausalLM"])
def test_random_weights_map_to_the_hf_family(architecture):
    """`bench --baseline hf` on a random preset: HF's model of the same family, given
    llmfast's random weights, computes the same logits (checks the unfused mapping, biases
    and q/k norms included, and the preset's config.json)."""
    import torch

    from llmfast.models.families import family_config

    config = family_config(
        architecture, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=300,
        tie_word_embeddings=architecture == "Qwen2ForCausalLM", max_position_embeddings=64,
        **_EXPERTS.get(architecture, {}))

    def perturb(name, p):  # random weights give norms of 1 and biases of ~0.02: make them show
        p.mul_(torch.empty_like(p).uniform_(0.5, 1.5)) if "norm" in name else p.mul_(5.0)

    assert_hf_baseline_logits(config, list(range(7, 27)), perturb)


# bf16 against HF's fp32: measured on these tiny models (CPU) the largest error is ~3.5% of
# the largest |logit| and the mean error ~1.6% of the logits' spread; a missing bias or
# norm is off by far more.
BF16_MAX_ERR, BF16_MEAN_ERR = 0.06, 0.03


def assert_bf16_logits_close(got, want):
    err = (got.float() - want.float()).abs()
    assert err.max() <= BF16_MAX_ERR * want.abs().max(), err.max()
    assert err.mean() <= BF16_MEAN_ERR * want.std(), err.mean()


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_bf16_logits_close_to_hf_fp32(tmp_path, family):
    import torch

    from llmfast.models.loading.loader import build_model
    from tests.helpers.checkpoints import load_hf_model
    from tests.helpers.paged import PagedSequences

    path = make_hf_checkpoint(tmp_path / "ckpt", family=family)
    ours = build_model(resolve_model(str(path)), torch.bfloat16, "cpu", max_positions=128)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (40, 7)]
    got = PagedSequences(ours, 2, 64).step({0: prompts[0], 1: prompts[1]})
    with torch.inference_mode():
        hf = load_hf_model(path)
        want = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert_bf16_logits_close(got, want)
