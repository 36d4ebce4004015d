"""Helper processes that run this `llmfast` (mp workers, API server processes): how they
are started, how they notice that their parent is gone, and how they are reaped."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

# The directory that holds this `llmfast` package: a child must import the same one (a
# checkout on PYTHONPATH, say, rather than an installed copy).
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
PARENT_CHECK_INTERVAL_S = 0.5


def child_python_path(pythonpath: str | None) -> str:
    """`pythonpath` with this package's root first."""
    return os.pathsep.join(p for p in (PACKAGE_ROOT, pythonpath) if p)


def child_env() -> dict[str, str]:
    """This process's environment with this package's root first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = child_python_path(env.get("PYTHONPATH"))
    return env


def child_stdout() -> int | None:
    """Where a child's stdout goes: our stderr (our stdout may carry results, as
    `llmfast generate`'s does), or inherited when stderr has no file (pytest's capture)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def exit_when_orphaned() -> None:
    """In a child: exit at once if the parent process dies (a thread, checking twice a
    second), even while the child is blocked on something the parent would have ended."""
    parent_pid = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_INTERVAL_S)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, daemon=True, name="llmfast-parent-watch").start()


class Child(Protocol):
    popen: subprocess.Popen

    def close_handles(self) -> None: ...


def stop_children(children: list[Child], grace_s: float) -> None:
    """End every child and reap it: together they have `grace_s` to exit by themselves
    (after being told to, or at end of file), then SIGTERM and a second short wait, then
    SIGKILL; then close our ends of their pipes."""
    for signal_them in (None, "terminate", "kill"):
        alive = [c for c in children if c.popen.poll() is None]
        if not alive:
            break
        for c in alive:
            if signal_them is not None:
                try:
                    getattr(c.popen, signal_them)()
                except OSError:
                    pass
        deadline = time.monotonic() + (grace_s if signal_them is None else 2.0)
        for c in alive:
            try:
                c.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for c in children:
        c.popen.wait()  # SIGKILL has been sent to any still alive
        c.close_handles()
