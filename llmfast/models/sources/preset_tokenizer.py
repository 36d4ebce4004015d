"""The tokenizer a `random:` preset carries, so that chat, generate and serve run on it.

Random weights come without a tokenizer. A preset borrows the default model's (SmolLM2's
byte-level BPE with a ChatML template, 49152 tokens) when that model is already in the
cache and its tokens fit in the preset's vocabulary. Otherwise it gets a byte-level
tokenizer built here in memory: one token per byte plus ChatML's three special tokens,
259 in all. Every preset's vocabulary holds that, and it needs no download, so a machine
without network can chat with a random model too. A random model samples from its whole
vocabulary; ids the tokenizer lacks decode to nothing.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from llmfast.tokenizer import Tokenizer, TokenizerError, load_tokenizer

logger = logging.getLogger(__name__)

BYTE_TOKENIZER_NAME = "byte-level ChatML (built in)"
CHATML_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
# The special tokens' roles, as transformers' tokenizer takes them and a template sees them.
SPECIAL_TOKEN_ROLES = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def preset_tokenizer(vocab_size: int, cache: Path | None = None) -> Tokenizer:
    """The default model's tokenizer if it is cached and fits `vocab_size`, else the
    built-in byte-level one."""
    from llmfast.models.sources.default_model import cached_default_model

    default_dir = cached_default_model(cache)
    if default_dir is not None:
        try:
            tokenizer = load_tokenizer(default_dir)
        except TokenizerError as e:
            logger.warning("%s; using the built-in byte-level tokenizer", e)
        else:
            if tokenizer.vocab_size <= vocab_size:
                logger.info("random weights with the tokenizer of %s", default_dir.name)
                return tokenizer
            logger.info(
                "the default model's tokenizer (%d tokens) exceeds the preset's vocabulary "
                "(%d); using the built-in byte-level one", tokenizer.vocab_size, vocab_size,
            )
    tokenizer = byte_level_tokenizer()
    if tokenizer.vocab_size > vocab_size:
        raise TokenizerError(
            f"a vocabulary of {vocab_size} cannot hold even the byte-level tokenizer"
        )
    return tokenizer


@functools.cache
def byte_level_tokenizer() -> Tokenizer:
    """Bytes 0-255 as tokens 0-255 (GPT-2's printable stand-ins for each byte), no merges,
    and the ChatML special tokens after them."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in enumerate(_byte_stand_ins())}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens(list(CHATML_SPECIAL_TOKENS))
    hf = ChatMLByteTokenizer(raw)
    return Tokenizer(hf, (int(hf.eos_token_id),), BYTE_TOKENIZER_NAME)


class ChatMLByteTokenizer:
    """The built-in tokenizer as the transformers tokenizer `Tokenizer` wraps: the calls
    it makes, answered by the `tokenizers` object and jinja2 without importing transformers.
    That import is ~1 s of Python holding the GIL (more beside a large site-packages: it
    reads every installed distribution's file list), all of it beside the engine's start in
    the tokenizer thread: on a random preset, the only thing that imported it.

    Renders its own ChatML template the way transformers does (a sandboxed environment,
    blocks trimmed); any other template (`--chat-template`) goes to a transformers
    `PreTrainedTokenizerFast` on the same `tokenizers` object, built at that first use."""

    chat_template = CHATML_TEMPLATE

    def __init__(self, backend: Any) -> None:
        self.backend = backend  # a tokenizers.Tokenizer
        self.eos_token_id = backend.token_to_id(SPECIAL_TOKEN_ROLES["eos_token"])
        self.bos_token_id = None
        self._transformers: Any = None  # the PreTrainedTokenizerFast, once needed

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def rust_decode(self) -> Any:
        """The decode `Tokenizer._rust_decode` calls directly (tokenizer.py)."""
        return self.backend.decode

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, as transformers' fast tokenizers call it: it lets go of the GIL
        # while it works (`encode` holds it: a long prompt stalls every other thread).
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = False,
                            chat_template: str | None = None, **template_kwargs: Any) -> Any:
        if chat_template is not None and chat_template != CHATML_TEMPLATE:
            return self._transformers_tokenizer().apply_chat_template(
                messages, tokenize=tokenize, add_generation_prompt=add_generation_prompt,
                chat_template=chat_template, **template_kwargs)
        if not messages:  # as transformers says it
            raise ValueError("Cannot apply chat template to an empty conversation")
        # The special tokens' names first: template kwargs may override them, as there.
        variables = {**SPECIAL_TOKEN_ROLES, **template_kwargs}
        text = _chatml_template().render(
            **variables, messages=messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _transformers_tokenizer(self) -> Any:
        if self._transformers is None:
            from transformers import PreTrainedTokenizerFast

            self._transformers = PreTrainedTokenizerFast(tokenizer_object=self.backend,
                                                         **SPECIAL_TOKEN_ROLES)
        return self._transformers


@functools.cache
def _chatml_template() -> Any:
    """CHATML_TEMPLATE compiled as transformers compiles chat templates."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    return env.from_string(CHATML_TEMPLATE)


def _byte_stand_ins() -> list[str]:
    """The character byte-level BPE writes for each byte value (index = byte): printable
    Latin-1 bytes stand for themselves, the other 68 map to chr(256), chr(257), ... in order.
    E.g. byte 0x21 "!" -> "!", byte 0x20 (space) -> chr(256 + 32) = "Ġ"."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = [], 0
    for byte in range(256):
        if byte in printable:
            out.append(chr(byte))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out
