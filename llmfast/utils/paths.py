"""Where llmfast keeps files between runs (the default model, converted GGUF files).

Nothing is created here: callers `mkdir` the subdirectories they write, so importing or
resolving never touches the disk.
"""

from __future__ import annotations

import os
from pathlib import Path


def expand_user(path: str | Path, what: str) -> Path:
    """`Path(path).expanduser()`; where `~` cannot be expanded (`~nosuchuser/...`, or no
    home directory at all) a ValueError naming `what` (e.g. "--chat-template") instead
    of pathlib's RuntimeError, which the CLI would report as a bug."""
    try:
        return Path(path).expanduser()
    except RuntimeError:
        raise ValueError(f"{what} {str(path)!r}: cannot expand '~' (no such user, or no "
                         "home directory)") from None


def cache_dir() -> Path:
    """`$LLMFAST_CACHE`, else `$XDG_CACHE_HOME/llmfast`, else `~/.cache/llmfast`; a
    ValueError where the one chosen names a home directory that cannot be found.

    Empty variables count as unset (a common shell accident: `LLMFAST_CACHE= llmfast ...`).
    """
    explicit = os.environ.get("LLMFAST_CACHE")
    if explicit:
        return expand_user(explicit, "$LLMFAST_CACHE")
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return expand_user(xdg, "$XDG_CACHE_HOME") / "llmfast"
    return expand_user("~", "the llmfast cache (no $LLMFAST_CACHE or $XDG_CACHE_HOME)") \
        / ".cache" / "llmfast"
