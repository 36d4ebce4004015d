"""Mixtures of experts from GGUF: Qwen3-MoE (qwen3moe) and Mixtral (a llama with
experts, Q/K permuted), written here from random HF models with the `gguf` package as
llama.cpp lays them out (the router `ffn_gate_inp`, the experts stacked in
`ffn_{gate,up,down}_exps`), convert to HF directories holding the source's per-expert
weights bit for bit (as transformers' save_pretrained writes them), and llmfast then
generates what the source model generates."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from llmfast.models.families import model_config_from_json
from llmfast.models.formats.gguf import convert_gguf_to_hf_dir
from llmfast.models.formats.gguf_metadata import GGUFError
from tests.helpers.gguf_files import tiny_llama, write_llama_gguf
from tests.helpers.tokenizers import train_byte_level_bpe
from tests.test_gguf_families import check_generates_like_source

ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}


@pytest.fixture(scope="module")
def bpe():
    return train_byte_level_bpe()


@pytest.fixture(scope="module", params=list(ARCH))
def case(request, bpe, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    model = tiny_llama(bpe.get_vocab_size(), tie=False, family=family)
    model.save_pretrained(root / "hf")  # per-expert tensors, as checkpoints hold them
    path = write_llama_gguf(root / f"{family}.gguf", model, bpe, arch=ARCH[family])
    return dict(family=family, model=model, gguf=path, hf=root / "hf",
                out=convert_gguf_to_hf_dir(path, root / "out"))


def test_weights_bit_exact(case):
    ours = load_file(str(case["out"] / "model.safetensors"))
    source = load_file(str(case["hf"] / "model.safetensors"))
    assert set(ours) == set(source)
    assert sum(".experts.3." in n for n in ours) == 3 * 2  # 3 projections, 2 layers
    for name, tensor in ours.items():
        assert torch.equal(tensor, source[name]), name


def test_config(case):
    config = model_config_from_json(case["out"] / "config.json")
    assert config.architecture == {"qwen3_moe": "Qwen3MoeForCausalLM",
                                   "mixtral": "MixtralForCausalLM"}[case["family"]]
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)
    assert config.moe_intermediate_size == 32 and config.norm_topk_prob


def test_generates_what_the_source_model_generates(case):
    check_generates_like_source(case["out"], case["model"])


def test_missing_top_k_refused(bpe, tmp_path):
    """A qwen3moe file without expert_used_count: a one-line error, nothing written."""
    import gguf

    model = tiny_llama(bpe.get_vocab_size(), tie=False, family="qwen3_moe")
    path = write_llama_gguf(tmp_path / "m.gguf", model, bpe, arch="qwen3moe")
    # Rewrite the file without the key.
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "qwen3moe")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture",
                                                            "qwen3moe.expert_used_count"):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for t in reader.tensors:
        writer.add_tensor(t.name, t.data, raw_shape=list(reversed(t.shape.tolist())),
                          raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="lacks the metadata qwen3moe.expert_used_count"):
        convert_gguf_to_hf_dir(tmp_path / "bad.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
