"""Tokenizer wrapper, chat template and the incremental detokenizer, on tiny tokenizers
trained here (no hub)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from llmfast.models.sources.preset_tokenizer import byte_level_tokenizer
from llmfast.engine.processing.detokenizer import IncrementalDetokenizer
from llmfast.tokenizer import TokenizerError, load_tokenizer
from tests.helpers.chat_model import make_chat_model
from tests.helpers.tokenizers import MIXED_TEXT, save_hf_tokenizer, train_byte_level_bpe


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory) -> Path:
    return save_hf_tokenizer(train_byte_level_bpe(), tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory) -> Path:
    """SentencePiece-style: words carry a leading '▁' that decodes to a space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(["hello world again and again", "the world says hello"] * 3, trainer)
    return save_hf_tokenizer(tok, tmp_path_factory.mktemp("sp"), chat_template=None)


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    deltas = [detok.add_tokens([i]) for i in ids]
    return deltas + [detok.flush()]


def test_encode_decode_and_eos(byte_dir):
    (byte_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    try:
        tok = load_tokenizer(byte_dir)
    finally:
        (byte_dir / "generation_config.json").unlink()
    ids = tok.encode(MIXED_TEXT)
    assert tok.decode(ids) == MIXED_TEXT
    # The tokenizer's own EOS first, then the generation config's, without duplicates.
    assert tok.eos_token_ids == (tok.hf.convert_tokens_to_ids("<|im_end|>"), 7)


def test_chat_template(byte_dir):
    tok = load_tokenizer(byte_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(messages)
    expected = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids, skip_special_tokens=False) == expected
    # Special tokens stay whole (one id each), not spelled out in bytes.
    assert ids[0] == tok.hf.convert_tokens_to_ids("<|im_start|>")
    with pytest.raises(TokenizerError, match="role"):
        tok.apply_chat_template([{"content": "no role"}])


def test_missing_chat_template(tmp_path):
    tok = load_tokenizer(save_hf_tokenizer(train_byte_level_bpe(), tmp_path / "t", None))
    messages = [{"role": "user", "content": "hello"}]
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template(messages)
    ids = tok.apply_chat_template(messages, plain_fallback=True)
    assert tok.decode(ids) == "user: hello\nassistant:"
    with pytest.raises(TokenizerError, match="no tokenizer files"):
        load_tokenizer(tmp_path)


def test_multibyte_characters_never_broken(byte_dir):
    tok = load_tokenizer(byte_dir)
    ids = tok.encode(MIXED_TEXT, add_special_tokens=False)
    # The test means something only if some character is split across tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, tok.encode("prompt: "))
    deltas = stream(detok, ids)
    assert "".join(deltas) == MIXED_TEXT == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert detok.output_token_ids == ids


def test_prompt_ending_mid_character(byte_dir):
    tok = load_tokenizer(byte_dir)
    ids = tok.encode("你好世界", add_special_tokens=False)
    # Split where the prompt alone decodes to an incomplete character.
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok, ids[:cut])
    text = "".join(stream(detok, ids[cut:]))
    prompt_text = tok.decode(ids[:cut]).rstrip("\ufffd")
    assert prompt_text + text == "你好世界"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_sequences_match_full_decode(byte_dir, skip_special_tokens):
    tok = load_tokenizer(byte_dir)
    rng = random.Random(0)
    vocab = tok.vocab_size
    checked = 0
    for _ in range(80):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        if tok.decode(prompt, skip_special_tokens).endswith("\ufffd"):
            # A prompt ending mid-character joins the output's first bytes into one
            # character, so the output alone is not the reference then; tested below.
            continue
        output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
        deltas = stream(detok, output)
        full = tok.decode(output, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == full
        # Only the final flush may end mid-character.
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])
        checked += 1
    assert checked >= 40


def test_sentencepiece_leading_space(metaspace_dir):
    tok = load_tokenizer(metaspace_dir)
    prompt = tok.encode("hello", add_special_tokens=False)
    output = tok.encode("hello world again", add_special_tokens=False)[len(prompt) :]
    # Alone, the output's first word loses its "▁" space; after the prompt it keeps it.
    assert tok.decode(output) == "world again"
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(stream(detok, output)) == " world again"
    # Without a prompt the first word starts the text: no space.
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(stream(detok, output)) == "world again"


def test_constant_work_per_token(byte_dir):
    tok = load_tokenizer(byte_dir)

    class Counting:
        longest = 0

        def decode(self, ids, skip_special_tokens=True):
            Counting.longest = max(Counting.longest, len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode(MIXED_TEXT * 40, add_special_tokens=False)
    detok = IncrementalDetokenizer(Counting(), tok.encode("a long prompt " * 50))
    assert "".join(stream(detok, ids)) == MIXED_TEXT * 40
    assert len(ids) > 500 and Counting.longest <= 12


@pytest.mark.parametrize("which", ["byte_dir", "metaspace_dir"])
def test_direct_rust_decode_equals_transformers_decode(which, request):
    """`Tokenizer.decode` calls the `tokenizers` decode directly for a fast tokenizer:
    the same text as transformers' decode (no clean-up), special tokens and partial
    UTF-8 characters included."""
    tok = load_tokenizer(request.getfixturevalue(which))
    assert tok._rust_decode is not None  # the direct path is the one under test
    rng = random.Random(1)
    vocab = len(tok.hf)
    for _ in range(400):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), (ids, skip)


def test_a_tokenizer_class_with_its_own_decode_keeps_it(byte_dir):
    """A transformers class that overrides `_decode` (some do: Whisper, CodeGen...) is
    called through transformers, not around it."""
    from transformers import PreTrainedTokenizerFast

    class ShoutingTokenizer(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    tok = load_tokenizer(byte_dir)
    shouting = type(tok)(ShoutingTokenizer.from_pretrained(str(byte_dir)), tok.eos_token_ids)
    assert shouting._rust_decode is None
    ids = tok.encode("hello world", add_special_tokens=False)
    assert shouting.decode(ids) == "HELLO WORLD" and tok.decode(ids) == "hello world"


class _PythonOnly:
    """The same tokenizer without its Rust handle: IncrementalDetokenizer's Python path."""

    def __init__(self, tok) -> None:
        self.decode = tok.decode


@pytest.mark.parametrize("which", ["byte_dir", "metaspace_dir"])
def test_rust_decode_stream_gives_the_python_paths_deltas(which, request):
    """With a fast tokenizer the window runs in `tokenizers`' DecodeStream: the same
    deltas as the Python path, token by token, for clean and mid-character prompt tails,
    several ids per call, skipped special tokens, and `append` / `flush` taking over
    mid-stream."""
    tok = load_tokenizer(request.getfixturevalue(which))
    python_only = _PythonOnly(tok)
    rng = random.Random(2)
    vocab = len(tok.hf)
    streamed = 0
    for case in range(300):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        skip = case % 2 == 0
        rust = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        ref = IncrementalDetokenizer(python_only, prompt, skip_special_tokens=skip)
        assert ref._stream is None
        streamed += rust._stream is not None
        cut = rng.randrange(len(output) + 1)  # deferred (append) from here on, some cases
        i = 0
        while i < len(output):
            step = output[i:i + rng.choice((1, 1, 1, 2, 3))]
            if case % 3 == 0 and i >= cut:
                rust.append(step)
                ref.append(step)
                assert rust._stream is None
            else:
                assert rust.add_tokens(step) == ref.add_tokens(step), (prompt, output[:i + 1])
            i += len(step)
        assert rust.flush() == ref.flush()
        assert rust.text == ref.text
    assert streamed >= 150  # most prompt tails decode whole: the Rust path was tested


class _CountingStream:
    """A DecodeStream stand-in that counts the ids it is stepped with."""

    def __init__(self, stream) -> None:
        self.stream, self.ids = stream, []

    def step(self, backend, token_id):
        self.ids.append(token_id)
        return self.stream.step(backend, token_id)


@pytest.mark.parametrize("which", ["byte_dir", "metaspace_dir"])
def test_ids_past_the_tokenizer_decode_to_nothing_without_a_decode(which, request):
    """A random model samples over a vocabulary larger than its tokenizer's: those ids
    are not decoded (they decode to nothing), with the same deltas as the Python path
    that decodes them, and the Rust window is stepped only with the tokenizer's ids."""
    tok = load_tokenizer(request.getfixturevalue(which))
    bound = tok.rust_id_bound
    assert bound == len(tok.hf)
    assert tok.decode([bound, bound + 7, 10 ** 6]) == ""
    python_only = _PythonOnly(tok)
    rng = random.Random(3)
    streamed = 0
    for case in range(200):
        prompt = [rng.randrange(bound) for _ in range(rng.randrange(0, 6))]
        # Mostly ids past the tokenizer, as from a 128k-vocabulary random model.
        output = [rng.randrange(bound) if rng.random() < 0.3 else rng.randrange(bound, 4 * bound)
                  for _ in range(rng.randrange(1, 40))]
        skip = case % 2 == 0
        rust = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        ref = IncrementalDetokenizer(python_only, prompt, skip_special_tokens=skip)
        counting = None
        if rust._stream is not None:
            rust._stream = counting = _CountingStream(rust._stream)
        for t in output:
            assert rust.add_tokens([t]) == ref.add_tokens([t]), (prompt, output)
        if counting is not None:
            assert counting.ids == [t for t in output if t < bound]
            streamed += 1
        assert rust.flush() == ref.flush()
        assert rust.text == ref.text and rust.output_token_ids == output
    assert streamed >= 100


@pytest.mark.parametrize("which", ["trained byte-level BPE", "random presets' byte tokenizer"])
def test_prompt_chars_bound_holds_for_any_text(tmp_path, which):
    """No text past the bound fits: every text has at least len / longest tokens (checked
    on texts of ASCII, accented and CJK letters, emoji and special-token strings), and
    the bound is 4 x longest x the token budget."""
    tok = (load_tokenizer(make_chat_model(tmp_path / "m")) if which.startswith("trained")
           else byte_level_tokenizer())
    longest = max(map(len, tok.hf.get_vocab()))
    assert tok.prompt_chars_bound(100) == 4 * longest * 100
    rng = random.Random(0)
    pieces = ["hello", " world", "é", "ü", "漢字", "🙂", "<|im_start|>", "<|im_end|>", "\n",
              "  ", "ab" * 20, "-" * 30]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
        assert len(tok.encode(text, add_special_tokens=False)) * longest >= len(text), text
