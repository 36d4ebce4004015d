"""Helpers for the CLI tests (imported by them; not a pytest conftest): a tiny HF Llama
checkpoint with a small byte-level BPE tokenizer and a ChatML chat template, so chat and
generate run end to end on CPU in seconds."""

from __future__ import annotations

from pathlib import Path

from tests.checkpoints import make_hf_checkpoint

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2; eos = 2
CORPUS = [
    "hello there, how are you today? I am fine, thank you.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "Tell me a story about a small fast engine that answers questions.",
    "system user assistant: you are a helpful test model.",
] * 20


def save_tiny_tokenizer(path: Path, vocab_size: int = 320, chat_template: bool = True) -> int:
    """Train a byte-level BPE on a tiny corpus and save it as an HF fast tokenizer.
    Returns its size (the model's vocab must be at least that)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                 pad_token="<|endoftext|>")
    if chat_template:
        hf.chat_template = CHATML
    hf.save_pretrained(path)
    return len(hf)


def make_chat_model(path: Path, chat_template: bool = True, **overrides) -> Path:
    """A tiny random Llama + tokenizer directory that `llmfast chat/generate` can load."""
    size = save_tiny_tokenizer(path, chat_template=chat_template)
    kwargs = {"vocab_size": max(size, 320), "max_position_embeddings": 4096, **overrides}
    make_hf_checkpoint(path, **kwargs)
    return path
