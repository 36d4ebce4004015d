"""Engine runs on the Triton interpreter, in a child process: TRITON_INTERPRET must be set
before Triton is imported, and this process imported it long ago. The child runs a
snippet that prints one JSON line last; its result comes back as a dict."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.triton_compat import CHILD_PRELUDE


def run_interpreted(code: str, timeout_s: float, **env: str) -> dict:
    """The JSON that `code` printed last, run by a fresh interpreter with
    TRITON_INTERPRET=1, this process's import path and `env` on top."""
    child_env = dict(os.environ, TRITON_INTERPRET="1",
                     PYTHONPATH=os.pathsep.join(filter(None, sys.path)), **env)
    code = CHILD_PRELUDE + code
    proc = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True,
                          text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
