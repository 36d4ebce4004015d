"""`LoadError`, the one error a model that cannot be loaded raises, and the refusal of
pickle checkpoints (loading them can run arbitrary code)."""

from __future__ import annotations

from pathlib import Path

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class LoadError(ValueError):
    """A model that cannot be loaded; the message is one user-facing line."""


def pickle_refusal(path: Path) -> LoadError:
    return LoadError(
        f"{path} is a pickle checkpoint, which llmfast refuses to load (it can run code); "
        "convert it to safetensors"
    )
