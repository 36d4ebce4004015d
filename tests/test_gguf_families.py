"""Qwen2 and Qwen3 GGUF files (written here from random HF models with the `gguf`
package, as llama.cpp lays them out: no Q/K permutation, q/k/v biases for qwen2, q/k
norms for qwen3) convert to HF directories that hold the source weights bit for bit, and
llmfast then generates what the source model generates."""

from __future__ import annotations

import pytest
import torch

from llmfast import LLM, SamplingParams
from llmfast.models.families import model_config_from_json
from llmfast.models.formats.gguf import convert_gguf_to_hf_dir
from tests.helpers.gguf_files import tiny_llama, write_llama_gguf
from tests.helpers.tokenizers import MIXED_TEXT, train_byte_level_bpe
from tests.helpers.hf_oracle import hf_greedy
from tests.test_gguf import hf_gguf_model


@pytest.fixture(scope="module")
def bpe():
    return train_byte_level_bpe()


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def case(request, bpe, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    # Qwen2.5-0.5B ties its embeddings; Qwen3-8B does not.
    model = tiny_llama(bpe.get_vocab_size(), tie=family == "qwen2", family=family)
    with torch.no_grad():  # biases and q/k norms away from 0 and 1, so misplacing one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    path = write_llama_gguf(root / f"{family}.gguf", model, bpe, arch=family)
    return dict(family=family, model=model, gguf=path,
                out=convert_gguf_to_hf_dir(path, root / "out"))


def test_weights_bit_exact(case):
    from safetensors.torch import load_file

    ours = load_file(str(case["out"] / "model.safetensors"))
    source = case["model"].state_dict()
    if case["model"].config.tie_word_embeddings:
        source.pop("lm_head.weight")
    assert set(ours) == set(source)
    assert any(n.endswith("q_proj.bias") for n in ours) == (case["family"] == "qwen2")
    assert any(n.endswith("q_norm.weight") for n in ours) == (case["family"] == "qwen3")
    for name, tensor in ours.items():
        assert torch.equal(tensor, source[name]), name
    if case["family"] == "qwen2":
        # transformers' own GGUF reader agrees (its qwen3 reading ignores key_length and
        # takes head_dim 128, so it cannot read this tiny qwen3 file at all).
        reference = hf_gguf_model(case["gguf"]).state_dict()
        for name, tensor in ours.items():
            assert torch.equal(tensor, reference[name]), name


def test_config_and_tokenizer(case, bpe):
    from llmfast.tokenizer import load_tokenizer

    config = model_config_from_json(case["out"] / "config.json")
    family = case["family"]
    assert config.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
        family]
    assert (config.qkv_bias, config.qk_norm) == (family == "qwen2", family == "qwen3")
    assert config.tie_word_embeddings == (family == "qwen2")
    assert load_tokenizer(case["out"]).encode(MIXED_TEXT) == bpe.encode(MIXED_TEXT).ids


def test_generates_what_the_source_model_generates(case):
    check_generates_like_source(case["out"], case["model"])


def check_generates_like_source(out_dir, model) -> None:
    """Greedy tokens of the converted directory equal the source HF model's."""
    prompts = [[5, 17, 200, 3, 99, 41, 7, 300], [9, 8, 7], list(range(40, 70))]
    llm = LLM(str(out_dir), device="cpu", block_size=4, max_model_len=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(model, prompt, 6)


def test_gemma3_gguf_generates_what_the_source_model_generates(bpe, tmp_path):
    """A Gemma 3 GGUF as llama.cpp writes it (norms stored as 1 + weight, the window in
    the metadata, every sixth layer global, local RoPE base 10000, attention scaled by
    head_dim): converted, it holds the source weights (to float32 rounding of the norms'
    +1 -1) and generates the source model's tokens past its 8-token window."""
    from safetensors.torch import load_file

    model = tiny_llama(bpe.get_vocab_size(), tie=True, family="gemma3_text",
                       num_hidden_layers=6, sliding_window=8, query_pre_attn_scalar=16,
                       rms_norm_eps=1e-6)
    path = write_llama_gguf(tmp_path / "gemma3.gguf", model, bpe, arch="gemma3")
    out = convert_gguf_to_hf_dir(path, tmp_path / "out")
    config = model_config_from_json(out / "config.json")
    assert config.architecture == "Gemma3ForCausalLM" and config.sliding_window == 8
    assert list(config.layer_types) == list(model.config.layer_types) == (
        ["sliding_attention"] * 5 + ["full_attention"])
    ours, source = load_file(str(out / "model.safetensors")), model.state_dict()
    source.pop("lm_head.weight")
    assert set(ours) == set(source)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, source[name], atol=1e-6, rtol=0)
    prompts = [list(range(40, 70)), [9, 8, 7]]
    llm = LLM(str(out), device="cpu", block_size=4, max_model_len=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, got in zip(prompts, outs):
        assert got.outputs[0].token_ids == hf_greedy(model, prompt, 12)
