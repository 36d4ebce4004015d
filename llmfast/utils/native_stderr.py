"""Lines that native libraries write straight to file descriptor 2, dropped.

torch's profiler (Kineto) prints `USDT:... profiler_start` / `profiler_stop` (and, with
KINETO_LOG_LEVEL set, `STAGE:` lines) from C++ on every start and stop, whatever the log
level: noise in a command's output. Python's sys.stderr cannot filter them; this points
fd 2 at a temporary file for the duration of a short block (the profiler's start or stop,
not the traced work, so a progress display on stderr is untouched) and writes back every
line that does not start with one of the prefixes.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

PROFILER_NOISE = ("USDT:", "STAGE:")


@contextlib.contextmanager
def native_stderr_without(prefixes: tuple[str, ...] = PROFILER_NOISE) -> Iterator[None]:
    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(AttributeError, ValueError, OSError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            lines = captured.read().decode("utf-8", "replace").splitlines(keepends=True)
            kept = "".join(line for line in lines if not line.startswith(prefixes))
            if kept:
                os.write(2, kept.encode())
