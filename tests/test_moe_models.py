"""Mixtures of experts (Qwen3-MoE, Mixtral) on the one decoder: logits equal HF
transformers' (fp32) on tiny random checkpoints that transformers wrote; the engine's
batched greedy tokens equal HF's under chunked prefill, preemption and prefix-cache hits;
config.json and checkpoint mismatches in the experts are refused before loading."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmfast.config import ConfigError
from llmfast.models.families import hf_dict_from_model_config, model_config_from_hf
from llmfast.models.loading.load_error import LoadError
from llmfast.models.sources.model_source import resolve_model
from llmfast.models.sources.random_presets import RANDOM_PRESETS
from llmfast.models.sparse_moe import SparseMoeBlock
from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.hf_oracle import greedy_oracle
from tests.test_engine_families import _run_all_paths
from tests.test_model import _check_prefill_then_decode, _load_ours

MOE_FAMILIES = ("qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def moe_env(tmp_path_factory):
    """family -> (checkpoint, oracle), each built once per module."""
    envs = {}

    def get(family: str):
        if family not in envs:
            path = make_hf_checkpoint(tmp_path_factory.mktemp(family) / "ckpt", family=family)
            envs[family] = (path, greedy_oracle(load_hf_model(path)))
        return envs[family]

    return get


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logits_match_hf(moe_env, family):
    path, _ = moe_env(family)
    config = resolve_model(str(path)).config
    assert config.num_experts == 4 and config.num_experts_per_tok == 2
    model = _load_ours(path)
    sparse = [i for i, layer in enumerate(model.model.layers)
              if isinstance(layer.mlp, SparseMoeBlock)]
    # Qwen3-MoE's tiny config keeps layer 1 dense (mlp_only_layers).
    assert sparse == ([0, 2] if family == "qwen3_moe" else [0, 1])
    _check_prefill_then_decode(path, prompt_len=30)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_engine_matches_hf(moe_env, family):
    ckpt, oracle = moe_env(family)
    _run_all_paths(ckpt, oracle)


@pytest.mark.parametrize("family", [pytest.param("mixtral", marks=pytest.mark.slow),
                                    "qwen3_moe"])
def test_compiled_engine_matches_hf(moe_env, family):
    ckpt, oracle = moe_env(family)
    llm = _run_all_paths(ckpt, oracle, compile=True)
    assert llm.engine.runner.compiled.stats.one_graph


# ------------------------------------------------------------------ config.json reading

# The fields that matter of the published config.json files.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
    "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False,
    "vocab_size": 32000, "bos_token_id": 1, "eos_token_id": 2,
}


def _same_shapes(config, preset) -> bool:
    """Equal but for the token ids and the stored dtype (the presets list every eos)."""
    return dataclasses.replace(config, eos_token_ids=(), torch_dtype="float32") == \
        dataclasses.replace(preset, eos_token_ids=(), torch_dtype="float32")


def test_real_configs_read_into_expert_options():
    qwen = model_config_from_hf(QWEN3_30B_A3B)
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (
        128, 8, 768)
    assert qwen.norm_topk_prob and qwen.dense_layers == () and qwen.qk_norm
    assert _same_shapes(qwen, RANDOM_PRESETS["qwen3-30b-a3b"])
    mixtral = model_config_from_hf(MIXTRAL_8X7B)
    assert (mixtral.num_experts, mixtral.num_experts_per_tok) == (8, 2)
    assert mixtral.moe_intermediate_size == 14336 and mixtral.norm_topk_prob
    assert _same_shapes(mixtral, RANDOM_PRESETS["mixtral-8x7b"])
    # decoder_sparse_step 2 and mlp_only_layers: HF's rule for which layers stay dense.
    stepped = model_config_from_hf({**QWEN3_30B_A3B, "num_hidden_layers": 6,
                                    "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert stepped.dense_layers == (0, 2, 3, 4)
    assert [stepped.is_sparse_layer(i) for i in range(6)] == [False, True, False, False,
                                                              False, True]


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "mixtral-8x7b"])
def test_preset_config_round_trips_through_config_json(preset):
    config = RANDOM_PRESETS[preset]
    assert model_config_from_hf(json.loads(json.dumps(hf_dict_from_model_config(config)))) \
        == config


@pytest.mark.parametrize(("change", "message"), [
    ({"num_experts_per_tok": 200}, "exceeds num_experts"),
    ({"num_experts": -1}, "num_experts must be a positive"),
    ({"moe_intermediate_size": None}, "moe_intermediate_size"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
])
def test_bad_expert_configs_refused(change, message):
    cfg = {k: v for k, v in {**QWEN3_30B_A3B, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf(cfg)


# ------------------------------------------------------------------ checkpoint checks


def _rewrite(path, edit) -> None:
    """Apply `edit` to the checkpoint's tensor dict and write it back."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize(("family", "edit", "message"), [
    # An expert more than config.json says.
    ("qwen3_moe", lambda t: t.__setitem__(
        "model.layers.0.mlp.experts.4.gate_proj.weight",
        t["model.layers.0.mlp.experts.0.gate_proj.weight"].clone()), "expert 4 .* 4 experts"),
    # An expert missing.
    ("mixtral", lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w2.weight"),
     r"lacks the weights of expert 3 for model\.layers\.1\.mlp\.experts\.down_weight "
     r"\(config.json says 4 experts\)"),
    # An expert's columns not the config's moe_intermediate_size.
    ("qwen3_moe", lambda t: t.__setitem__(
        "model.layers.2.mlp.experts.1.up_proj.weight", torch.zeros(16, 64)),
     r"experts\.1\.up_proj\.weight has shape \(16, 64\), config.json implies \(32, 64\)"),
    # A router for more experts.
    ("mixtral", lambda t: t.__setitem__("model.layers.0.block_sparse_moe.gate.weight",
                                        torch.zeros(5, 64)), r"shape \(5, 64\)"),
])
def test_checkpoint_expert_mismatch_refused(tmp_path, family, edit, message):
    path = make_hf_checkpoint(tmp_path / "ckpt", family=family)
    _rewrite(path, edit)
    with pytest.raises(LoadError, match=message):
        _load_ours(path)


# ------------------------------------------------------------------ sizes


def _meta_model(config):
    from llmfast.models.decoder import DecoderForCausalLM
    from llmfast.models.loading.loader import allocate_as

    with allocate_as(torch.device("meta"), torch.bfloat16):
        return DecoderForCausalLM(config, max_positions=16)


@pytest.mark.parametrize(("preset", "total_b", "active_b"), [
    ("qwen3-30b-a3b", 30.5, 3.3),  # as Qwen's model card counts them
    ("mixtral-8x7b", 46.7, 12.9),  # Mistral's announcement
])
def test_presets_have_the_published_sizes(preset, total_b, active_b):
    """Total parameters, and the bytes a batch-1 decode step reads (the active experts,
    the LM head; the input embedding's rows only): the active-weight roofline's bytes."""
    from llmfast.models.weight_bytes import decode_weight_bytes, weight_bytes
    from tests.helpers.weight_bytes import expected_decode_weight_bytes

    config = RANDOM_PRESETS[preset]
    model = _meta_model(config)
    assert weight_bytes(model) / 2 / 1e9 == pytest.approx(total_b, rel=0.01)
    embed = config.vocab_size * config.hidden_size
    active = decode_weight_bytes(model) / 2 + embed  # published counts include it
    assert active / 1e9 == pytest.approx(active_b, rel=0.02)
    assert decode_weight_bytes(model) == expected_decode_weight_bytes(config, element_size=2)


def test_decode_weight_bytes_of_a_tensor_parallel_rank(moe_env):
    from llmfast.distributed import TensorParallelGroup
    from llmfast.models.decoder import DecoderForCausalLM
    from llmfast.models.weight_bytes import decode_weight_bytes
    from tests.helpers.weight_bytes import expected_decode_weight_bytes

    path, _ = moe_env("qwen3_moe")
    config = resolve_model(str(path)).config
    for rank in range(2):
        with torch.device("meta"):
            model = DecoderForCausalLM(config, max_positions=16,
                                       tp=TensorParallelGroup(rank=rank, world_size=2))
        assert decode_weight_bytes(model) == expected_decode_weight_bytes(config, 2, rank)


def test_fp8_keeps_router_and_experts_and_runs(moe_env):
    """--quantization fp8 quantizes the attention projections (and a dense layer's MLP),
    keeps the router and the stacked experts in the model dtype, and the engine runs."""
    from llmfast import LLM, SamplingParams
    from llmfast.kernels.cpu.linear import Linear
    from llmfast.models.quantization.fp8 import Fp8Linear

    path, _ = moe_env("qwen3_moe")
    llm = LLM(str(path), quantization="fp8", device="cpu", max_model_len=64, block_size=4)
    layers = llm.engine.runner.model.model.layers
    assert type(layers[0].mlp.gate) is Linear and isinstance(layers[0].self_attn.qkv_proj,
                                                               Fp8Linear)
    assert layers[0].mlp.experts.gate_up_weight.dtype == torch.float32
    assert isinstance(layers[1].mlp.gate_up_proj, Fp8Linear)  # the dense layer's MLP
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
