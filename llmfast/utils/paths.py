"""Where llmfast keeps files between runs (the default model, converted GGUF files).

Nothing is created here: callers `mkdir` the subdirectories they write, so importing or
resolving never touches the disk.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$LLMFAST_CACHE`, else `$XDG_CACHE_HOME/llmfast`, else `~/.cache/llmfast`.

    Empty variables count as unset (a common shell accident: `LLMFAST_CACHE= llmfast ...`).
    """
    explicit = os.environ.get("LLMFAST_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "llmfast"
    return Path.home() / ".cache" / "llmfast"
