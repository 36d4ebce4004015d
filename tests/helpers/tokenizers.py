"""Tiny tokenizers trained on the spot (no hub): a byte-level BPE with ChatML specials,
saved as an HF fast tokenizer."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

CORPUS = [
    "Hello world, this is a small test of the tokenizer.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 and more emoji 😀😀 in a row.",
    "中文字符 你好世界 日本語のテキスト 한국어",
    "naïve café résumé — “quotes” and ½ fractions",
    "numbers 12345 67890 and symbols !@#$%^&*()",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MIXED_TEXT = "Hi 😀 there, 你好世界! 👍🏽 naïve 🇫🇷 done."


def train_byte_level_bpe(vocab_size: int = 420, corpus: Sequence[str] = CORPUS * 3):
    """A GPT-2-style byte-level BPE (a `tokenizers.Tokenizer`); deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


def _wait_for_engine_tokenizer_loads() -> None:
    """An engine start that failed in this process (an in-process CLI test) leaves its
    tokenizer thread importing transformers: it is a daemon so that the error comes at
    once (tests/test_engine_startup.py). Importing transformers here meanwhile races that
    import, and transformers' lazy modules then raise "cannot import name
    PreTrainedTokenizerFast"."""
    for thread in threading.enumerate():
        if thread.name == "llmfast-tokenizer":
            thread.join(timeout=120)


def save_hf_tokenizer(tok, path: Path, chat_template: str | None = CHATML,
                      **special_tokens: str) -> Path:
    """Save `tok` as an HF fast tokenizer (eos <|im_end|>; unk <|endoftext|> unless other
    special tokens are given)."""
    _wait_for_engine_tokenizer_loads()
    from transformers import PreTrainedTokenizerFast

    special_tokens = special_tokens or {"unk_token": "<|endoftext|>"}
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", **special_tokens)
    if chat_template is not None:
        hf.chat_template = chat_template
    path.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(str(path))
    return path
