"""Tokenizer and chat template.

`Tokenizer` wraps a transformers tokenizer loaded from a local model directory (never
with remote code). The incremental detokenizer that turns sampled ids into text deltas
is the engine's (llmfast/engine/processing/detokenizer.py).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmfast.config import ConfigError
from llmfast.utils.errors import one_line

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TokenizerError(ConfigError):
    """A tokenizer problem the user must fix; the message is one line."""


@dataclass(frozen=True)
class Tokenizer:
    # A transformers PreTrainedTokenizerBase, or what answers the same calls (the random
    # presets' ChatMLByteTokenizer, models/sources/preset_tokenizer.py).
    hf: Any
    eos_token_ids: tuple[int, ...]
    name: str = ""
    chat_template: str | None = None  # replaces the model's own (`--chat-template`)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template or getattr(self.hf, "chat_template", None))

    @property
    def template_text(self) -> str | None:
        """The chat template's source (what tool-call markers it writes), if one."""
        template = self.chat_template or getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) else None

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer with `template` instead of the model's chat template; a template
        that does not compile is a TokenizerError now, not at the first chat."""
        check_chat_template(template)
        return dataclasses.replace(self, chat_template=template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def prompt_chars_bound(self, max_tokens: int) -> int | None:
        """A length in characters past which no text encodes to `max_tokens` tokens or
        fewer (None where the vocabulary cannot be read).

        One token stands for at most as many characters as its vocabulary string has
        (byte-level BPE: one character per byte, and a character is at least a byte;
        SentencePiece: its pieces; byte-fallback tokens such as <0x0A> have more), so a
        text of n characters has at least n / longest tokens. Times 4 for what a
        tokenizer's normalizer may do first (Unicode composition joins up to 3
        characters into one). E.g. longest 16, 2048 tokens: 131072 characters."""
        try:
            vocab = self.hf.get_vocab()
        except Exception:  # noqa: BLE001 - a tokenizer without one: no bound, no check
            return None
        longest = max(map(len, vocab), default=0)
        return 4 * max(longest, 1) * max_tokens if vocab else None

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # No clean-up of tokenization spaces: it rewrites " ." as "." depending on what
        # follows, which would make incremental decoding disagree with a full decode.
        if self._rust_decode is not None:
            return self._rust_decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            list(token_ids),
            skip_special_tokens=skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    @property
    def rust_tokenizer(self) -> Any | None:
        """The `tokenizers.Tokenizer` that `_rust_decode` calls, else None."""
        return getattr(self._rust_decode, "__self__", None)

    @functools.cached_property
    def _rust_decode(self) -> Callable[..., str] | None:
        """The `tokenizers` decode a fast HF tokenizer ends in, called directly: the same
        text as `hf.decode(..., clean_up_tokenization_spaces=False)` without its Python
        argument conversion (~13 us a call, a type check per id: at 256 running requests
        most of the engine's detokenisation time). None for a slow tokenizer or a class
        that overrides the decode path."""
        return _rust_decode(self.hf)

    @functools.cached_property
    def rust_id_bound(self) -> int | None:
        """One past the largest id the Rust tokenizer has (added tokens included), else
        None. The Rust decode skips an id it lacks, so a larger id decodes to nothing
        wherever it stands: e.g. most ids a random model samples over a vocabulary far
        larger than its preset's byte-level tokenizer."""
        backend = self.rust_tokenizer
        if backend is None:
            return None
        vocab = backend.get_vocab(with_added_tokens=True)
        return max(vocab.values()) + 1 if vocab else 0

    def render_chat(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        plain_fallback: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: Sequence[dict] | None = None,
    ) -> str:
        """The prompt text for `messages` (the chat template's output). `template_kwargs`
        are more variables for the template (vLLM's chat_template_kwargs, e.g. Qwen3's
        `enable_thinking`); `tools` OpenAI's tool definitions, which the template
        describes to the model in its own words."""
        _check_messages(messages)
        template_kwargs = _check_template_kwargs(template_kwargs)
        if tools:
            template_kwargs = {**template_kwargs, "tools": list(tools)}
        if not self.has_chat_template:
            if not plain_fallback:
                model = f"the model {self.name}" if self.name else "this model"
                raise TokenizerError(
                    f"{model} has no chat template; use a plain prompt "
                    "(or allow the plain 'role: content' fallback format)"
                )
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")
        try:
            return self.hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                chat_template=self.chat_template, **template_kwargs,
            )
        except Exception as e:  # jinja errors, incl. the template's own raise_exception()
            raise TokenizerError(f"the chat template failed: {one_line(e)}") from None

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        plain_fallback: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: Sequence[dict] | None = None,
    ) -> list[int]:
        """Token ids of the chat prompt. The template writes its own special tokens (BOS
        included), so the rendered text is encoded without adding any; the plain fallback
        format gets the tokenizer's usual ones."""
        return self.chat_prompt(messages, add_generation_prompt, plain_fallback,
                                template_kwargs, tools)[1]

    def chat_prompt(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        plain_fallback: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: Sequence[dict] | None = None,
    ) -> tuple[str, list[int]]:
        """The chat prompt's text and token ids (see `apply_chat_template`)."""
        text = self.render_chat(messages, add_generation_prompt, plain_fallback,
                                template_kwargs, tools)
        return text, self.encode(text, add_special_tokens=not self.has_chat_template)


# apply_chat_template's own parameters: a template variable of one of these names would
# not reach the template (or would change how it is applied).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def _check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    if not kwargs:
        return {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TokenizerError("chat template kwargs must be an object of named values")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise TokenizerError(f"chat template kwargs cannot set {', '.join(reserved)}")
    return kwargs


def check_chat_template(template: str) -> None:
    """TokenizerError (one line) unless `template` compiles as transformers will render
    it: its Jinja environment has extensions and tags of its own ({% break %},
    {% generation %}) that a plain `jinja2.Environment` refuses."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers that renders otherwise: the closest check
        def _compile_jinja_template(text: str) -> Any:
            return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    try:
        _compile_jinja_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(
            f"the chat template does not parse: line {e.lineno}: {e.message}") from None


def _rust_decode(hf: Any) -> Callable[..., str] | None:
    direct = getattr(hf, "rust_decode", None)  # a wrapper of a `tokenizers` object, e.g.
    if direct is not None:  # the random presets' (models/sources/preset_tokenizer.py)
        return direct
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    cls = type(hf)
    backend = getattr(hf, "_tokenizer", None)
    if (isinstance(hf, PreTrainedTokenizerFast) and backend is not None
            and cls._decode is PreTrainedTokenizerFast._decode
            and cls.decode is PreTrainedTokenizerBase.decode):
        return backend.decode
    return None


def has_tokenizer_files(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / f).is_file() for f in _TOKENIZER_FILES)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    model_dir = Path(model_dir)
    if not has_tokenizer_files(model_dir):
        raise TokenizerError(f"no tokenizer files in {model_dir}")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(
            str(model_dir), trust_remote_code=False, local_files_only=True
        )
    except Exception as e:
        raise TokenizerError(f"cannot load the tokenizer in {model_dir}: {one_line(e)}") from None
    return Tokenizer(hf, _eos_token_ids(hf, model_dir), model_dir.name)


def _eos_token_ids(hf: Any, model_dir: Path) -> tuple[int, ...]:
    """The tokenizer's EOS, then those of generation_config.json and config.json: chat
    models often stop on an end-of-turn token that only the generation config names."""
    ids: list[int] = []
    if hf.eos_token_id is not None:
        ids.append(int(hf.eos_token_id))
    for name in ("generation_config.json", "config.json"):
        try:
            value = json.loads((model_dir / name).read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        values = value if isinstance(value, list) else [value]
        ids.extend(int(v) for v in values if isinstance(v, int))
    return tuple(dict.fromkeys(ids))


def _check_messages(messages: list[dict[str, str]]) -> None:
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
            m.get("content"), str
        ):
            raise TokenizerError(f"a chat message needs string 'role' and 'content': {m!r:.80}")
