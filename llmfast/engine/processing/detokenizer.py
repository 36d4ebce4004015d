"""`IncrementalDetokenizer`: a stream of sampled token ids as text deltas, with constant
work per token, vLLM-style: it decodes a short window of ids twice (without and with the
new token) and emits the difference, which handles both byte-level BPE (characters split
over several tokens) and SentencePiece (a leading "▁" that is a space only when
something precedes it). The frontends run it (the output processor); the engine core sees
only token ids."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

_REPLACEMENT = "\ufffd"  # what decoding yields for bytes that are not (yet) valid UTF-8


class _Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for a growing sequence of output tokens.

    Offsets into `_ids` (a tail of the prompt, then the outputs):
    `_prefix` .. `_read` is context already emitted (decoded only so that a leading
    space or a multi-token character comes out right), `_read` .. end is not emitted yet.
    A delta is emitted once the text does not end in U+FFFD (an incomplete UTF-8
    character); then the window slides to start where the last delta began. Each token
    costs two decodes of a few ids, whatever the length of the sequence.

    With a fast tokenizer the same window runs in Rust (`tokenizers`' DecodeStream: one
    call per token, ~3x less host time than the two decodes from Python), and the
    offsets above follow it, so `append` and `flush` carry on in Python from where it
    stands. Not for a prompt tail that ends mid-character: only the Python path keeps
    that fragment out of the first delta.
    """

    PROMPT_WINDOW = 5  # prompt tokens decoded as context for the first output token

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = [int(t) for t in prompt_token_ids[-self.PROMPT_WINDOW :]]
        self._num_prompt = len(self._ids)
        self._prefix = 0
        self._read = len(self._ids)
        self._prefix_text: str | None = None  # decode of _ids[_prefix:_read], cached
        self._pieces: list[str] = []
        self._backend = getattr(tokenizer, "rust_tokenizer", None)
        self._stream = self._open_stream() if self._backend is not None else None
        # Ids from here on decode to nothing (see Tokenizer.rust_id_bound), so adding
        # one emits nothing and is not decoded: the window slides only when text comes
        # out, and a run of them (a random model over a large vocabulary) would make
        # every step decode a longer window. They stay in `_ids` (the Python window
        # decodes them, to nothing).
        self._id_bound = (getattr(tokenizer, "rust_id_bound", None)
                          if self._backend is not None else None)

    def _open_stream(self) -> Any | None:
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:  # tokenizers < 0.21
            return None
        prompt = self._ids[: self._read]
        if prompt:
            self._prefix_text = self._decode(prompt)  # the Python path's first prefix
            if self._prefix_text.endswith(_REPLACEMENT):
                return None
        stream = DecodeStream(skip_special_tokens=self._skip)
        if prompt:  # as context: the same window as the Python path's first one
            stream.step(self._backend, prompt)
        return stream

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_prompt :]

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Append sampled ids; return the new text (possibly "")."""
        if len(new_token_ids) == 1:  # a decode step: nothing to join
            delta = self._add_token(int(new_token_ids[0]))
        else:
            delta = "".join([self._add_token(t) for t in map(int, new_token_ids)])
        if delta:
            self._pieces.append(delta)
        return delta

    def _add_token(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._id_bound is not None and token_id >= self._id_bound:
            return ""
        if self._stream is None:
            return self._step(final=False)
        chunk = self._stream.step(self._backend, token_id)
        if not chunk:
            return ""
        # The Rust window slid: so do the offsets.
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = None
        return chunk

    def append(self, new_token_ids: Sequence[int]) -> None:
        """Append sampled ids without decoding them: the next `add_tokens` or `flush`
        decodes them with the rest, in one window (two decodes, whatever the count). For
        a request whose text is only read when it ends."""
        self._stream = None  # the Rust window would not see these ids
        self._ids.extend(map(int, new_token_ids))

    def flush(self) -> str:
        """At the end of a request: emit held-back text even if it ends mid-character."""
        self._stream = None  # the Python window emits what the Rust one holds back
        delta = self._step(final=True) if self._read < len(self._ids) else ""
        if delta:
            self._pieces.append(delta)
        return delta

    def _step(self, final: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix : self._read])
        prefix_text = self._prefix_text
        new_text = self._decode(self._ids[self._prefix :])
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""  # wait for the rest of the character
        # Normally new_text extends prefix_text. Only the first window can end inside a
        # character (the prompt's last token), so compare instead of assuming.
        start = len(prefix_text)
        if not new_text.startswith(prefix_text):
            start = _common_prefix_length(prefix_text, new_text)
        delta = new_text[start:]
        if not delta:
            return ""  # e.g. a skipped special token: keep the window, nothing to show
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = None
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)


def _common_prefix_length(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
