"""`one_line`: an exception's message as the single line a user-facing error shows.

llmfast's own errors (ConfigError, LoadError, RequestRejected, ...) carry one line by
design; errors from libraries (transformers, gguf, jinja) may carry pages, so their
first line is what gets quoted inside ours.
"""

from __future__ import annotations


def one_line(error: BaseException, max_chars: int | None = 200) -> str:
    """The first non-blank line of `error`'s message (its type name if there is none),
    cut to `max_chars` (None: whole)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(error).__name__
    if isinstance(error, KeyError) and len(error.args) == 1 and text == repr(error.args[0]):
        text = f"no entry {text}"  # a bare key reads as nothing: "'added_tokens'"
    return text if max_chars is None else text[:max_chars]
