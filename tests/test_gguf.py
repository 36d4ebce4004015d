"""GGUF → HF directory conversion, checked against transformers' own GGUF loader and
against the HF model the GGUF was written from (tiny files written here, no hub)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from llmfast.models.formats.gguf import (
    GGUFError,
    convert_gguf_to_hf_dir,
    is_converted,
    unpermute_qk,
)
from llmfast.models.formats.gguf_metadata import _llama3_from_freqs
from tests.helpers.gguf_files import llamacpp_permute, tiny_llama, write_llama_gguf
from tests.helpers.tokenizers import MIXED_TEXT, train_byte_level_bpe

PROBE_IDS = [[5, 17, 200, 3, 99, 41, 7, 300]]


@pytest.fixture(scope="module")
def bpe():
    return train_byte_level_bpe()


@pytest.fixture(scope="module", params=["f32-untied", "q8_0-tied"])
def case(request, bpe, tmp_path_factory):
    import gguf

    tie = request.param.endswith("-tied")
    quant = gguf.GGMLQuantizationType.Q8_0 if request.param.startswith("q8_0") else None
    root = tmp_path_factory.mktemp(request.param)
    model = tiny_llama(bpe.get_vocab_size(), tie)
    path = write_llama_gguf(root / "tiny.gguf", model, bpe, quant)
    out = convert_gguf_to_hf_dir(path, root / "converted")
    return dict(model=model, gguf=path, out=out, tie=tie, quantized=quant is not None)


def hf_gguf_model(path: Path):
    """transformers' own reading of the GGUF file: the reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def test_weights_match_transformers_gguf_loader_and_source(case):
    from safetensors.torch import load_file

    ours = load_file(str(case["out"] / "model.safetensors"))
    reference = hf_gguf_model(case["gguf"]).state_dict()
    source = case["model"].state_dict()
    assert ("lm_head.weight" in ours) != case["tie"]
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, reference[name]), name
        if case["quantized"]:  # Q8_0: within quantisation error of the source
            assert torch.allclose(tensor, source[name], atol=2e-3), name
        else:  # F32: bit-exact, so the Q/K un-permutation really is the inverse
            assert torch.equal(tensor, source[name]), name
    assert is_converted(case["out"])


def test_logits_match(case):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(PROBE_IDS)
    ours = AutoModelForCausalLM.from_pretrained(str(case["out"]), dtype=torch.float32).eval()
    with torch.no_grad():
        got = ours(ids).logits
        want = hf_gguf_model(case["gguf"])(ids).logits
        source = case["model"](ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if not case["quantized"]:
        torch.testing.assert_close(got, source, rtol=1e-5, atol=1e-5)


def test_config_and_tokenizer(case, bpe):
    from llmfast.models.families import model_config_from_json
    from llmfast.tokenizer import load_tokenizer

    config = model_config_from_json(case["out"] / "config.json")
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.vocab_size == bpe.get_vocab_size()
    assert config.tie_word_embeddings == case["tie"]
    assert config.rope_theta == 10000.0 and config.rope_scaling.rope_type == "default"
    tok = load_tokenizer(case["out"])
    assert tok.encode(MIXED_TEXT) == bpe.encode(MIXED_TEXT).ids
    assert tok.eos_token_ids == (bpe.token_to_id("<|im_end|>"),)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_special_tokens_come_from_the_gguf_ids(case, bpe):
    """transformers 5.17's GGUF reader names BOS as EOS; the converter pins BOS/EOS to the
    GGUF's own ids whatever the reader made of them (here: a reader that got both wrong)."""
    import gguf
    from transformers import AutoTokenizer

    from llmfast.models.formats.gguf import _pin_special_tokens

    path = case["gguf"]
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.eos_token = tokenizer.bos_token = "<|endoftext|>"  # what a faulty reader gives
    _pin_special_tokens(tokenizer, gguf.GGUFReader(str(path)))
    assert tokenizer.eos_token_id == bpe.token_to_id("<|im_end|>")
    assert tokenizer.bos_token_id == bpe.token_to_id("<|im_start|>")


def test_unpermute_inverts_llamacpp_permute():
    w = torch.randn(6 * 8, 5)
    for heads in (6, 3):
        permuted = torch.from_numpy(llamacpp_permute(w.numpy(), heads))
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_qk(permuted, heads), w)


def test_other_architectures_refused(tmp_path, bpe):
    path = write_llama_gguf(tmp_path / "q.gguf", tiny_llama(bpe.get_vocab_size(), True), bpe,
                            arch="phi3")
    with pytest.raises(GGUFError, match="'phi3'.*converts 'llama', 'qwen2', 'qwen3'"):
        convert_gguf_to_hf_dir(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [0.9, 0.3, 0.01])
def test_corrupt_file_refused(case, tmp_path, keep):
    data = case["gguf"].read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(GGUFError) as info:
        convert_gguf_to_hf_dir(bad, tmp_path / "out")
    message = str(info.value)
    assert "bad.gguf" in message and "\n" not in message and "Traceback" not in message
    assert not (tmp_path / "out").exists()


def test_not_a_gguf_file(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04 definitely not gguf" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        convert_gguf_to_hf_dir(junk, tmp_path / "out")


def test_interrupted_conversion_leaves_no_directory(case, tmp_path, monkeypatch):
    import llmfast.models.formats.gguf as mod

    def boom(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(mod, "_write_tokenizer", boom)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf_to_hf_dir(case["gguf"], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_llama3_rope_freqs_recognised():
    theta, head_dim, factor = 500000.0, 64, 8.0
    freqs = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < 8192 / 4:
            freqs.append(1.0)
        elif wavelen > 8192:
            freqs.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / 3
            freqs.append(1 / ((1 - smooth) / factor + smooth))
    scaling = _llama3_from_freqs(np.array(freqs), theta, head_dim, "x.gguf")
    assert (scaling.rope_type, scaling.factor) == ("llama3", factor)
    with pytest.raises(GGUFError, match="rope_freqs"):
        _llama3_from_freqs(np.array(freqs) * 1.1, theta, head_dim, "x.gguf")
