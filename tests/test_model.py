"""The llmfast Llama over a paged KV cache equals HF transformers on the same weights."""

from __future__ import annotations

import json

import pytest
import torch

from llmfast.models.loading.load_error import LoadError
from llmfast.models.loading.loader import build_model
from llmfast.models.sources.model_source import ModelSource, resolve_model
from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.paged import PagedSequences

ATOL = 1e-4


def _load_ours(path) -> torch.nn.Module:
    return build_model(resolve_model(str(path)), torch.float32, "cpu", max_positions=512)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _check_prefill_then_decode(path, prompt_len: int = 11, steps: int = 5) -> None:
    ours, hf = _load_ours(path), load_hf_model(path)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (prompt_len, 5)]
    paged = PagedSequences(ours, num_seqs=2, max_len=64)
    # Step 1: both prompts prefilled in one mixed batch.
    logits = paged.step({0: prompts[0], 1: prompts[1]})
    expected = torch.cat([_hf_logits(hf, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    # Then single-token decodes for both, greedy, each compared with HF on the whole text.
    seqs = [list(p) for p in prompts]
    for _ in range(steps):
        nxt = [int(_hf_logits(hf, s)[-1].argmax()) for s in seqs]
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits = paged.step({0: [nxt[0]], 1: [nxt[1]]})
        expected = torch.stack([_hf_logits(hf, s)[-1] for s in seqs])
        torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("sharded", [False, True])
def test_matches_hf(tmp_path, tie, sharded):
    path = make_hf_checkpoint(tmp_path / "ckpt", tie=tie, sharded=sharded)
    if sharded:
        assert (path / "model.safetensors.index.json").exists()
    _check_prefill_then_decode(path)


def test_matches_hf_llama3_rope_scaling(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
               "rope_theta": 500000.0}
    path = make_hf_checkpoint(tmp_path / "ckpt", rope_scaling=scaling)
    cfg = resolve_model(str(path)).config
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_theta == 500000.0
    _check_prefill_then_decode(path, prompt_len=30)


def test_chunked_prefill_matches_single_prefill(tmp_path):
    """A prompt fed in chunks over a cached prefix gives the same logits."""
    path = make_hf_checkpoint(tmp_path / "ckpt")
    ours, hf = _load_ours(path), load_hf_model(path)
    prompt = torch.randint(3, 256, (23,), generator=torch.Generator().manual_seed(3)).tolist()
    paged = PagedSequences(ours, num_seqs=1, max_len=32)
    chunks = [paged.step({0: prompt[a:b]}) for a, b in ((0, 7), (7, 8), (8, 23))]
    torch.testing.assert_close(torch.cat(chunks), _hf_logits(hf, prompt), atol=ATOL, rtol=0)


def test_random_presets_build_with_real_shapes():
    src = resolve_model("random:tiny")
    assert src.is_random
    model = build_model(src, torch.float32, "cpu", max_positions=64, seed=0)
    again = build_model(src, torch.float32, "cpu", max_positions=64, seed=0)
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n
    cfg = resolve_model("random:llama-3.1-8b").config
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim) == (4096, 8, 128)
    assert resolve_model("random:smollm2-135m").config.tie_word_embeddings


# ----------------------------------------------------------------------------- bad input


def _one_line(exc: Exception) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg and "Traceback" not in msg
    return msg


def test_missing_path():
    with pytest.raises(LoadError) as e:
        resolve_model("/nonexistent/model")
    assert "does not exist" in _one_line(e.value)


def test_hub_id_is_not_fetched():
    with pytest.raises(LoadError) as e:
        resolve_model("meta-llama/Llama-3.2-1B")
    assert "never downloads" in _one_line(e.value)


def test_dir_without_config(tmp_path):
    with pytest.raises(LoadError) as e:
        resolve_model(str(tmp_path))
    assert "config.json" in _one_line(e.value)


def test_non_llama_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(LoadError) as e:
        resolve_model(str(tmp_path))
    assert "GPT2LMHeadModel" in _one_line(e.value)


def test_unsupported_rope_type(tmp_path):
    path = make_hf_checkpoint(tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError) as e:
        resolve_model(str(path))
    assert "dynamic" in _one_line(e.value) and "yarn" in str(e.value)


def test_truncated_safetensors(tmp_path):
    path = make_hf_checkpoint(tmp_path / "ckpt")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(LoadError) as e:
        build_model(resolve_model(str(path)), torch.float32, "cpu", max_positions=64)
    assert "corrupt or truncated" in _one_line(e.value)


def test_missing_tensor_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_hf_checkpoint(tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LoadError) as e:
        build_model(resolve_model(str(path)), torch.float32, "cpu", max_positions=64)
    assert "qkv_proj" in _one_line(e.value)


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt"])
def test_pickle_checkpoints_refused(tmp_path, name):
    path = make_hf_checkpoint(tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    (path / name).write_bytes(b"\x80\x04not really a pickle")
    for spec in (str(path), str(path / name)):
        with pytest.raises(LoadError) as e:
            src = resolve_model(spec)
            build_model(src, torch.float32, "cpu", max_positions=64)
        assert "pickle" in _one_line(e.value)


def test_unknown_random_preset():
    with pytest.raises(LoadError) as e:
        resolve_model("random:llama-9000")
    assert "llama-9000" in _one_line(e.value) and "tiny" in str(e.value)


def test_model_source_name():
    assert ModelSource("random:tiny", None, resolve_model("random:tiny").config).name == "random:tiny"
