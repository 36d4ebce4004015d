"""GGUF → HF directory conversion, checked against transformers' own GGUF loader and
against the HF model the GGUF was written from (tiny files written here, no hub)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from llmfast.models.gguf import (
    GGUFError,
    _llama3_from_freqs,
    convert_gguf_to_hf_dir,
    is_converted,
    unpermute_qk,
)
from tests.test_tokenizer import CHATML, MIXED_TEXT, SPECIALS, train_byte_level_bpe

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
# HF → GGUF names, as llama.cpp's converter writes them.
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
PROBE_IDS = [[5, 17, 200, 3, 99, 41, 7, 300]]


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def tiny_llama(vocab_size: int, tie: bool, seed: int = 0, family: str = "llama"):
    """A tiny random HF model of `family` (an HF model_type; Llama unless told)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **TINY, vocab_size=vocab_size, tie_word_embeddings=tie)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norms too: a norm weight that is dropped or misplaced must show.
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    return model


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)  # kind: weight or bias
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def write_llama_gguf(path: Path, model, tokenizer, quant=None, arch: str = "llama") -> Path:
    """A GGUF as llama.cpp writes it: for arch llama permuted Q/K, optional `quant` for
    matrices (the embedding then gets F16, to cover a third tensor type)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template(CHATML)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            data = llamacpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llamacpp_permute(data, cfg.num_key_value_heads)
        if quant is not None and data.ndim == 2:
            qtype = gguf.GGMLQuantizationType.F16 if "embed" in name else quant
            if "embed" in name:
                w.add_tensor(gguf_name(name), data.astype(np.float16))
            else:
                w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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
    from llmfast.config import ModelConfig
    from llmfast.tokenizer import load_tokenizer

    config = ModelConfig.from_json(case["out"] / "config.json")
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 16)
    assert config.vocab_size == bpe.get_vocab_size()
    assert config.tie_word_embeddings == case["tie"]
    assert config.rope_theta == 10000.0 and config.rope_scaling.rope_type == "default"
    tok = load_tokenizer(case["out"])
    assert tok.encode(MIXED_TEXT) == bpe.encode(MIXED_TEXT).ids
    assert tok.eos_token_ids == (bpe.token_to_id("<|im_end|>"),)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


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
    import llmfast.models.gguf as mod

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
