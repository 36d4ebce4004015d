"""`WorkerProcess`: one `mp` worker, a fresh Python interpreter started with `subprocess`,
talking to the engine over its own socket pair.

Why not `multiprocessing.Process`: its spawn start method re-imports the user's main
module in every worker (a script without an `if __name__ == "__main__"` guard would start
its engine again, recursively), and its exit handler joins non-daemon children, which
would wait forever on a worker that waits for the engine. A plain child process that runs
`llmfast.executor.mp.worker_main` has neither problem; its death shows as end of file on the
socket and as a readable pidfd, so the engine waits on both with one `wait()`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

# The directory that holds this `llmfast` package: the worker must import the same one
# (a checkout on PYTHONPATH, say, rather than an installed copy).
PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])


class WorkerProcess:
    def __init__(self, rank: int, log_level: int) -> None:
        self.rank = rank
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        env["LLMFAST_WORKER_LOG_LEVEL"] = str(log_level)
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "llmfast.executor.mp.worker_main", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                # The engine's stdout carries results (`llmfast generate`): anything a
                # worker prints goes to stderr instead.
                stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else None)
        finally:
            theirs.close()  # the worker's copy is the only one left: its death is EOF here
        self.conn = Connection(ours.detach())
        # Readable once the process has exited (Linux >= 5.3); None elsewhere, where the
        # socket's end of file alone tells.
        self.pidfd: int | None = None
        if hasattr(os, "pidfd_open"):
            try:
                self.pidfd = os.pidfd_open(self.popen.pid)
            except OSError:
                self.pidfd = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_description(self) -> str | None:
        """How the process ended ("exit status 1", "killed by SIGKILL"), None if alive."""
        code = self.popen.poll()
        if code is None:
            return None
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit status {code}"

    def wait_exit(self, timeout_s: float) -> str:
        """Wait up to `timeout_s` for the process to end; its exit description (or
        "still running")."""
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return "still running"
        return self.exit_description() or "still running"

    def close_handles(self) -> None:
        self.conn.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def stop_workers(workers: list[WorkerProcess], grace_s: float) -> None:
    """End every worker and reap it: together they have `grace_s` to exit by themselves
    (after SHUTDOWN or end of file), then SIGTERM and a second short wait, then SIGKILL."""
    for signal_them in (None, "terminate", "kill"):
        alive = [w for w in workers if w.popen.poll() is None]
        if not alive:
            break
        for w in alive:
            if signal_them is not None:
                try:
                    getattr(w.popen, signal_them)()
                except OSError:
                    pass
        deadline = time.monotonic() + (grace_s if signal_them is None else 2.0)
        for w in alive:
            try:
                w.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for w in workers:
        w.popen.wait()  # SIGKILL has been sent to any still alive
        w.close_handles()


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False  # pytest's capture, a StringIO
    return True
