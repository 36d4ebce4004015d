"""The start-up progress callback every layer reports through.

`progress(stage, fraction)`: `stage` names what runs now ("loading weights", "capturing
CUDA graphs", ...); `fraction` in [0, 1] is how far it got, or None when unknown. The
library only calls it; the CLI draws it as a bar.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, float | None], None]


class OnceStage(str):
    """A stage label for work done once per model (its download, its conversion): the
    CLI shows such a stage as a plain line even where it draws no bar (stderr not a
    terminal), since it can take a while with nothing else to show for it."""


def once_stages(progress: Progress) -> Progress:
    """`progress`, with every stage reported through it marked as a `OnceStage`."""
    return lambda stage, fraction: progress(OnceStage(stage), fraction)

# `progress(done, total)`: requests finished so far (LLM.generate, the benchmarks).
CountProgress = Callable[[int, int], None]
