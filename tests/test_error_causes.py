"""Errors name their real cause: a tokenizer that fails to load says why (and "no
tokenizer" only when there is none); a KV cache that does not fit says how much was
asked, how much there is, and what to lower."""

from __future__ import annotations

import shutil

import pytest
import torch

from llmfast import LLM
from llmfast.core.request import RequestRejected
from llmfast.worker.startup import kv_cache_sizing
from llmfast.worker.startup.kv_cache_sizing import KVCacheOutOfMemory
from tests.helpers.chat_model import make_chat_model
from tests.helpers.cli import assert_one_line_error, invoke


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_chat_model(tmp_path_factory.mktemp("causes") / "chat")


@pytest.fixture
def broken_tokenizer(chat_model, tmp_path):
    path = shutil.copytree(chat_model, tmp_path / "broken")
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"')
    return path


def test_broken_tokenizer_names_the_cause(broken_tokenizer):
    llm = LLM(str(broken_tokenizer), device="cpu", max_model_len=64)
    with pytest.raises(RequestRejected) as info:
        llm.generate("hello")
    message = str(info.value)
    assert "cannot load the tokenizer" in message and str(broken_tokenizer) in message
    assert "no tokenizer" not in message
    # Token ids still work.
    assert llm.generate({"prompt_token_ids": [5, 6]})[0].outputs[0].token_ids


def test_a_missing_tokenizer_entry_is_named_as_missing(chat_model, tmp_path):
    """transformers reads a tokenizer.json without `added_tokens` into a KeyError, whose
    message is the bare key: the error says that the entry is missing."""
    import json

    path = shutil.copytree(chat_model, tmp_path / "no-added-tokens")
    data = json.loads((path / "tokenizer.json").read_text())
    del data["added_tokens"]
    (path / "tokenizer.json").write_text(json.dumps(data))
    line = assert_one_line_error(invoke("generate", "hello", "--model", str(path),
                                        "--device", "cpu"), "cannot load the tokenizer")
    assert "no entry 'added_tokens'" in line


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_broken_tokenizer_through_the_cli(broken_tokenizer, command):
    args = [command, "hello"] if command == "generate" else [command]
    result = invoke(*args, "--model", str(broken_tokenizer), "--device", "cpu",
                    input="hi\n" if command == "chat" else None)
    line = assert_one_line_error(result, "cannot load the tokenizer")
    assert "random:" not in line and "no tokenizer" not in line


def test_weights_only_dir_says_there_is_none(chat_model, tmp_path):
    path = shutil.copytree(chat_model, tmp_path / "weights-only")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    result = invoke("generate", "hello", "--model", str(path), "--device", "cpu")
    line = assert_one_line_error(result, "has no tokenizer files")
    assert "random:" not in line


def _check_kv_message(message: str) -> None:
    assert "cannot allocate the KV cache" in message
    assert "102400.00 GiB asked" in message and "GiB available on cpu" in message
    assert "lower --kv-cache-memory" in message


def test_kv_cache_larger_than_ram_is_refused_before_allocating():
    result = invoke("bench", "--model", "random:tiny", "--device", "cpu", "--sizes", "1",
                    "--kv-cache-memory", "100TiB")
    _check_kv_message(assert_one_line_error(result))


def test_kv_cache_allocation_failure_is_named(monkeypatch):
    # Past the RAM check (as when other processes free memory meanwhile): the allocator
    # itself refuses, and that is reported the same way.
    monkeypatch.setattr(kv_cache_sizing, "check_kv_cache_fits_host", lambda *a, **k: None)
    with pytest.raises(KVCacheOutOfMemory) as info:
        LLM("random:tiny", device="cpu", kv_cache_memory=100 << 40)
    _check_kv_message(str(info.value))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kv_cache_out_of_gpu_memory_is_named():
    # random:tiny blocks are 4 KiB in bf16: 2**30 of them are 4 TiB, more than any GPU.
    with pytest.raises(KVCacheOutOfMemory) as info:
        LLM("random:tiny", device="cuda", num_gpu_blocks_override=1 << 30, enforce_eager=True)
    message = str(info.value)
    assert "4096.00 GiB asked" in message and "GiB available on cuda" in message
    assert "lower --num-gpu-blocks-override" in message
