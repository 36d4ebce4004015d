"""The start-up progress callback every layer reports through.

`progress(stage, fraction)`: `stage` names what runs now ("loading weights", "capturing
CUDA graphs", ...); `fraction` in [0, 1] is how far it got, or None when unknown. The
library only calls it; the CLI draws it as a bar.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str, float | None], None]

# `progress(done, total)`: requests finished so far (LLM.generate, the benchmarks).
CountProgress = Callable[[int, int], None]
