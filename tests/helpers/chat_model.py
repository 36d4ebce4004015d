"""A tiny HF Llama checkpoint with a small byte-level BPE tokenizer and a ChatML chat
template, so chat and generate run end to end on CPU in seconds."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.checkpoints import make_hf_checkpoint
from tests.helpers.tokenizers import save_hf_tokenizer, train_byte_level_bpe

CHAT_CORPUS = [
    "hello there, how are you today? I am fine, thank you.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Tell me a story about a small fast engine that answers questions.",
    "system user assistant: you are a helpful test model.",
] * 20


def save_tiny_tokenizer(path: Path, vocab_size: int = 320, chat_template: bool = True) -> int:
    """Train a byte-level BPE on a tiny chat corpus and save it as an HF fast tokenizer
    (ids 0, 1, 2: <|endoftext|>, <|im_start|>, <|im_end|>; eos <|im_end|>). Returns its
    size (the model's vocab must be at least that)."""
    tok = train_byte_level_bpe(vocab_size, CHAT_CORPUS)
    kwargs = {} if chat_template else {"chat_template": None}
    save_hf_tokenizer(tok, path, pad_token="<|endoftext|>", **kwargs)
    return tok.get_vocab_size()


def make_chat_model(path: Path, chat_template: bool = True, **overrides) -> Path:
    """A tiny random Llama + tokenizer directory that `llmfast chat/generate` can load."""
    size = save_tiny_tokenizer(path, chat_template=chat_template)
    kwargs = {"vocab_size": max(size, 320), "max_position_embeddings": 4096, **overrides}
    make_hf_checkpoint(path, **kwargs)
    return path
