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
from multiprocessing.connection import Connection

from llmfast.utils.child_processes import child_env, child_stdout


class WorkerProcess:
    def __init__(self, rank: int, log_level: int) -> None:
        self.rank = rank
        ours, theirs = socket.socketpair()
        env = child_env()
        env["LLMFAST_WORKER_LOG_LEVEL"] = str(log_level)
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "llmfast.executor.mp.worker_main", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                stdout=child_stdout())
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
