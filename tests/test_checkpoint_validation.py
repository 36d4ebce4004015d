"""config.json and the checkpoint agree, or loading fails with one line naming the
mismatch, before anything is allocated. Each case edits a checkpoint that transformers
wrote and that loads correctly (tests/test_model.py checks it against HF)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmfast.models.loading.load_error import LoadError
from llmfast.models.loading.loader import build_model
from llmfast.models.sources.model_source import resolve_model
from llmfast.models.loading.validate import check_weights_fit
from tests.helpers.checkpoints import make_hf_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("validate") / "base")


@pytest.fixture
def ckpt(base, tmp_path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "ckpt"))


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _load(path: Path) -> torch.nn.Module:
    return build_model(resolve_model(str(path)), torch.float32, "cpu", max_positions=64)


def _load_error(path: Path) -> str:
    with pytest.raises(LoadError) as info:
        _load(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def _logits(model, ids=(5, 17, 99)) -> torch.Tensor:
    from tests.helpers.paged import PagedSequences

    return PagedSequences(model, num_seqs=1, max_len=16).step({0: list(ids)})


def test_config_with_a_layer_fewer_than_the_weights(ckpt):
    _edit_config(ckpt, num_hidden_layers=1)
    message = _load_error(ckpt)
    assert "layer 1" in message and "num_hidden_layers=1" in message


def test_config_with_a_layer_more_than_the_weights(ckpt):
    _edit_config(ckpt, num_hidden_layers=3)
    assert "model.layers.2." in _load_error(ckpt)


def test_absurd_sizes_fail_before_building(ckpt):
    _edit_config(ckpt, num_hidden_layers=1_000_000_000)
    with pytest.raises(LoadError) as info:
        resolve_model(str(ckpt))  # the config alone: nothing built yet
    assert "num_hidden_layers=1000000000" in str(info.value)


def test_weights_larger_than_memory_fail_before_allocating(ckpt):
    # ~1 TiB of fp32 embedding and head: refused from the meta-device model's size.
    _edit_config(ckpt, vocab_size=1 << 22, hidden_size=1 << 15, num_attention_heads=512,
                 num_key_value_heads=512, head_dim=64)
    assert "GiB is available on cpu" in _load_error(ckpt)


def test_weights_fit_arithmetic():
    with torch.device("meta"):
        layer = torch.nn.Linear(1024, 1024, bias=False)
    check_weights_fit(layer, torch.bfloat16, torch.device("cpu"), 2 * 1024 * 1024)
    with pytest.raises(ValueError, match="need 0.0 GiB in float32"):
        check_weights_fit(layer, torch.float32, torch.device("cpu"), 4 * 1024 * 1024 - 1)


def test_tensor_with_the_wrong_shape(ckpt):
    _edit_config(ckpt, intermediate_size=96)
    message = _load_error(ckpt)
    # Whichever MLP tensor comes first: gate/up (128, 64) vs (96, 64), down the transpose.
    assert ".mlp." in message and "config.json implies" in message
    assert ("(128, 64)" in message and "(96, 64)" in message) or (
        "(64, 128)" in message and "(64, 96)" in message)


def test_unexpected_tensor(ckpt):
    _edit_tensors(ckpt, lambda t: t.__setitem__("model.extra_norm.weight", torch.ones(64)))
    assert "model.extra_norm.weight" in _load_error(ckpt)


def test_ignorable_tensors_are_skipped(ckpt, base):
    def add(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        tensors["model.rotary_emb.inv_freq"] = torch.ones(8)

    _edit_tensors(ckpt, add)
    torch.testing.assert_close(_logits(_load(ckpt)), _logits(_load(base)), atol=0, rtol=0)


def test_tied_checkpoint_that_still_stores_the_head(tmp_path):
    path = make_hf_checkpoint(tmp_path / "tied", tie=True)
    reference = _logits(_load(path))
    _edit_tensors(path, lambda t: t.__setitem__(
        "lm_head.weight", t["model.embed_tokens.weight"].clone()))
    torch.testing.assert_close(_logits(_load(path)), reference, atol=0, rtol=0)


@pytest.mark.parametrize("act", ["gelu", "relu"])  # (gelu_pytorch_tanh: Gemma's GeGLU)
def test_unsupported_activation(ckpt, act):
    _edit_config(ckpt, hidden_act=act)
    with pytest.raises(LoadError, match=f"hidden_act='{act}'"):
        resolve_model(str(ckpt))


@pytest.mark.parametrize("change, words", [
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -5.0}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "low_freq_factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5}}, "factor"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                           "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                           "original_max_position_embeddings": 8192}}, "low_freq_factor <"),
])
def test_unsupported_rope_settings(ckpt, change, words):
    _edit_config(ckpt, **change)
    with pytest.raises(LoadError) as info:
        resolve_model(str(ckpt))
    assert words in str(info.value)


def test_silu_under_its_other_name_loads(ckpt, base):
    _edit_config(ckpt, hidden_act="swish")
    torch.testing.assert_close(_logits(_load(ckpt)), _logits(_load(base)), atol=0, rtol=0)
