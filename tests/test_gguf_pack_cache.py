"""The start-up cache of packed GGUF linears (models/quantization/gguf_pack_cache.py): a
second start reads the packed tensors instead of decoding the blocks, and gets the same
model; a damaged file is ignored and rewritten; the key follows the file's contents."""

from __future__ import annotations

import pytest
import torch

from llmfast.kernels.cpu.int4_linear import Int4Linear
from tests.helpers.gguf_files import tiny_llama, write_llama_gguf
from tests.helpers.tokenizers import train_byte_level_bpe

K_SIZES = dict(hidden_size=256, intermediate_size=256, head_dim=64)
PROMPTS = [[5, 9, 14, 3, 22, 7], [30, 2, 2, 41]]
NEXT_IDS = [11, 8]


@pytest.fixture(scope="module")
def bpe():
    return train_byte_level_bpe()


# Q4_1: one plane read as is; Q6_K: four planes through a column index (x_index).
@pytest.fixture(scope="module", params=["Q4_1", "Q6_K"])
def tiny_gguf(request, bpe, tmp_path_factory):
    import gguf

    model = tiny_llama(bpe.get_vocab_size(), tie=True, **K_SIZES)
    path = tmp_path_factory.mktemp(request.param) / "tiny.gguf"
    return write_llama_gguf(path, model, bpe, gguf.GGMLQuantizationType[request.param],
                            quant_embedding=True)


def _build(path):
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model

    return build_model(resolve_model(str(path)), torch.float32, "cpu", max_positions=128,
                       quantization="gguf")


def _packed_state(model):
    return {f"{name}.{k}": v for name, m in model.named_modules() if isinstance(m, Int4Linear)
            for k, v in [*m.named_parameters(), ("x_index", m.x_index)] if v is not None}


def test_second_start_reads_the_cache(tiny_gguf, tmp_path, monkeypatch):
    from llmfast.models.quantization import gguf as gguf_quant
    from llmfast.models.quantization.gguf_pack_cache import pack_cache_path
    from tests.helpers.tp_runs import paged_logits

    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path))
    first = _build(tiny_gguf)
    cache_file = pack_cache_path(tiny_gguf)
    assert cache_file.is_file() and cache_file.parent == tmp_path / "gguf-packed"

    def no_decoding(*args, **kwargs):
        raise AssertionError("blocks decoded although the cache holds them")

    monkeypatch.setattr(gguf_quant, "decode_blocks", no_decoding)
    second = _build(tiny_gguf)
    want, got = _packed_state(first), _packed_state(second)
    assert want.keys() == got.keys() and len(want) > 0
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), name
    assert (paged_logits(first, PROMPTS, NEXT_IDS) == paged_logits(second, PROMPTS,
                                                                     NEXT_IDS)).all()


def test_damaged_cache_is_rebuilt(tiny_gguf, tmp_path, monkeypatch, caplog):
    from llmfast.models.quantization.gguf_pack_cache import pack_cache_path

    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path))
    want = _packed_state(_build(tiny_gguf))
    cache_file = pack_cache_path(tiny_gguf)
    cache_file.write_bytes(cache_file.read_bytes()[:100])
    with caplog.at_level("WARNING"):
        got = _packed_state(_build(tiny_gguf))
    assert "ignoring the packed-weight cache" in caplog.text
    assert all(torch.equal(want[name], got[name]) for name in want)
    assert cache_file.stat().st_size > 100  # rewritten whole


def test_key_follows_contents_and_layout(tiny_gguf, tmp_path, monkeypatch):
    from llmfast.models.quantization import gguf_pack_cache

    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path))
    key = gguf_pack_cache.pack_cache_path(tiny_gguf)
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    assert gguf_pack_cache.pack_cache_path(copy) == key  # contents, not the path
    data = bytearray(tiny_gguf.read_bytes())
    data[-1] ^= 1
    copy.write_bytes(bytes(data))
    assert gguf_pack_cache.pack_cache_path(copy) != key
    monkeypatch.setattr(gguf_pack_cache, "PACK_LAYOUT_VERSION",
                        gguf_pack_cache.PACK_LAYOUT_VERSION + 1)
    assert gguf_pack_cache.pack_cache_path(tiny_gguf) != key


def test_write_prunes_stale_packs(tiny_gguf, tmp_path, monkeypatch):
    """A pack written under a new key (here a layout bump) deletes the same GGUF's pack
    under the old key, files of the naming before packs carried their GGUF's hash, and
    a crashed write's old temporary; other GGUF files' packs, a write in progress and
    foreign files stay."""
    import os
    import time

    from llmfast.models.quantization import gguf_pack_cache

    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path))
    _build(tiny_gguf)
    old = gguf_pack_cache.pack_cache_path(tiny_gguf)
    assert old.is_file()
    folder = old.parent
    legacy = folder / ("0" * 24 + ".safetensors")
    other_gguf = folder / ("f" * 16 + "-" + "1" * 24 + ".safetensors")
    crashed, in_progress, foreign = folder / "tmpold.tmp", folder / "tmpnew.tmp", folder / "notes.txt"
    for f in (legacy, other_gguf, crashed, in_progress, foreign):
        f.write_bytes(b"x")
    hours_ago = time.time() - 2 * gguf_pack_cache.STALE_TMP_SECONDS
    os.utime(crashed, (hours_ago, hours_ago))
    _build(tiny_gguf)  # a hit: nothing written, nothing pruned
    assert legacy.is_file() and crashed.is_file()

    monkeypatch.setattr(gguf_pack_cache, "PACK_LAYOUT_VERSION",
                        gguf_pack_cache.PACK_LAYOUT_VERSION + 1)
    _build(tiny_gguf)
    new = gguf_pack_cache.pack_cache_path(tiny_gguf)
    assert new != old and new.is_file()
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        p.name for p in (new, other_gguf, in_progress, foreign))
