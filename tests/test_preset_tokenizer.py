"""Random presets carry a tokenizer: the cached default model's when it fits, else the
built-in byte-level ChatML one; chat and generate run on them (no download anywhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from llmfast.cli.main import app
from llmfast.models.sources.default_model import DEFAULT_MODEL_NAME, cached_default_model
from llmfast.models.formats.gguf import CONVERSION_VERSION, MARKER_NAME
from llmfast.models.sources.model_source import resolve_model
from llmfast.models.sources.preset_tokenizer import (
    BYTE_TOKENIZER_NAME,
    CHATML_TEMPLATE,
    byte_level_tokenizer,
    preset_tokenizer,
)
from llmfast.models.sources.random_presets import RANDOM_PRESETS
from llmfast.tokenizer import Tokenizer, TokenizerError
from tests.helpers.chat_model import save_tiny_tokenizer

TEXT = "Grüße, 世界! <|im_start|> tabs\tand\nnewlines"


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMFAST_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def cached_default(empty_cache):
    """A finished default-model conversion in the cache (its tokenizer is what matters)."""
    target = empty_cache / "models" / DEFAULT_MODEL_NAME
    size = save_tiny_tokenizer(target)
    (target / MARKER_NAME).write_text(json.dumps({"format_version": CONVERSION_VERSION}))
    assert cached_default_model() == target
    return size


def test_byte_level_tokenizer_without_the_default_model(empty_cache):
    assert cached_default_model() is None
    for preset in RANDOM_PRESETS:
        tokenizer = resolve_model(f"random:{preset}").load_tokenizer()
        assert tokenizer.name == BYTE_TOKENIZER_NAME
        assert tokenizer.vocab_size == 259 <= RANDOM_PRESETS[preset].vocab_size
    ids = tokenizer.encode(TEXT)
    assert ids[:3] == list("Grü".encode()[:3])  # one token per byte
    assert tokenizer.decode(ids, skip_special_tokens=False) == TEXT
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tokenizer.decode(chat, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token_ids == (tokenizer.hf.convert_tokens_to_ids("<|im_end|>"),)
    # A random model samples ids past the tokenizer: they decode to nothing.
    assert tokenizer.decode([104, 100_000, 105]) == "hi"
    assert not empty_cache.exists()  # nothing written


def test_byte_level_tokenizer_answers_as_transformers_does():
    """The oracle: transformers' PreTrainedTokenizerFast on a copy of the same `tokenizers`
    object (what the built-in tokenizer was before it stopped importing transformers)."""
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = byte_level_tokenizer()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=RawTokenizer.from_str(tokenizer.rust_tokenizer.to_str()),
        eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML_TEMPLATE
    assert tokenizer.vocab_size == len(hf) and tokenizer.bos_token_id == hf.bos_token_id
    assert tokenizer.eos_token_ids == (hf.eos_token_id,)
    texts = [TEXT, "", " leading space", "<|im_end|><|endoftext|>", "emoji 🎉 and \x00"]
    for text in texts:
        for special in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special)
            for skip in (True, False):
                expected = hf.decode(ids + [100_000], skip_special_tokens=skip,
                                     clean_up_tokenization_spaces=False)
                assert tokenizer.decode(ids + [100_000], skip_special_tokens=skip) == expected
                assert tokenizer.hf.decode(ids + [100_000], skip_special_tokens=skip) == expected
    chats = [[{"role": "user", "content": TEXT}],
             [{"role": "system", "content": "be {{ brief }}"},
              {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    for chat in chats:
        for prompt in (True, False):
            expected = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=prompt)
            assert tokenizer.render_chat(chat, add_generation_prompt=prompt) == expected
            assert tokenizer.apply_chat_template(chat, add_generation_prompt=prompt) == (
                hf.encode(expected, add_special_tokens=False))
    # Template variables (vLLM's chat_template_kwargs), the special tokens' names among
    # them, render as there (ChatML reads none of them); an empty conversation is refused
    # alike.
    kwargs = {"flavour": "mint", "eos_token": "<END>", "pad_token": "<PAD>"}
    assert tokenizer.render_chat(chats[1], template_kwargs=kwargs) == (
        hf.apply_chat_template(chats[1], tokenize=False, add_generation_prompt=True,
                               **kwargs))
    for t in (tokenizer, Tokenizer(hf, (hf.eos_token_id,))):
        with pytest.raises(TokenizerError, match="empty conversation"):
            t.render_chat([])
    # Another template (`--chat-template`) is transformers' to render.
    custom = "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}{% endfor %}"
    assert tokenizer.with_chat_template(custom).render_chat(chats[1]) == (
        hf.apply_chat_template(chats[1], tokenize=False, chat_template=custom,
                               add_generation_prompt=True))


def test_random_preset_engine_leaves_transformers_unimported(tmp_path):
    """A random preset's engine (its tokenizer resolved as `--model random:tiny` does,
    with no default model cached), a text prompt and a chat: no transformers module
    imported, ~1 s of import holding the GIL beside the engine's own start."""
    code = ("import sys\n"
            "from llmfast import LLM, SamplingParams\n"
            "llm = LLM('random:tiny', device='cpu')\n"
            "params = SamplingParams(max_tokens=2, ignore_eos=True)\n"
            "assert len(llm.generate(['hello'], params)[0].outputs[0].token_ids) == 2\n"
            "llm.chat([[{'role': 'user', 'content': 'hi'}]], params)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))\n")
    env = {**os.environ, "LLMFAST_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_default_model_tokenizer_when_cached_and_fitting(cached_default):
    tokenizer = resolve_model("random:tiny").load_tokenizer()
    assert tokenizer.name == DEFAULT_MODEL_NAME and tokenizer.vocab_size == cached_default
    # A vocabulary too small for it gets the byte-level one instead.
    assert preset_tokenizer(vocab_size=cached_default - 1).name == BYTE_TOKENIZER_NAME


def test_broken_default_tokenizer_falls_back(cached_default, empty_cache):
    target = empty_cache / "models" / DEFAULT_MODEL_NAME
    (target / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE"')
    assert resolve_model("random:tiny").load_tokenizer().name == BYTE_TOKENIZER_NAME


def test_chat_and_generate_on_a_random_preset(empty_cache):
    runner = CliRunner()
    common = ["--model", "random:tiny", "--device", "cpu", "--temperature", "0",
              "--max-tokens", "5", "--ignore-eos"]
    chat = runner.invoke(app, ["chat", *common], input=b"hello there\n")
    assert chat.exit_code == 0, chat.output
    out = runner.invoke(app, ["generate", "hello", *common, "--json", "-"])
    assert out.exit_code == 0, out.output
    (record,) = json.loads(out.stdout)
    assert len(record["token_ids"]) == 5
    # The text is the byte tokenizer's decoding of the sampled ids.
    tokenizer = resolve_model("random:tiny").load_tokenizer()
    assert record["text"] == tokenizer.decode(record["token_ids"])


@pytest.mark.slow
def test_chat_on_qwen3_preset_cpu(empty_cache):
    """Real size (0.6B parameters, 2.4 GB in fp32): a turn of chat on CPU."""
    from llmfast import LLM
    from llmfast.cli.chat.session import ChatSession, ChatSettings

    llm = LLM("random:qwen3-0.6b", device="cpu", max_model_len=128)
    session = ChatSession(llm, ChatSettings(temperature=0.0, max_tokens=4, ignore_eos=True))
    result = session.reply("hello", lambda delta: None)
    assert result.num_output_tokens == 4
