"""`llmfast serve` says "serving ... at URL" only once every API process accepts on the
socket (launcher._watch reads each process's ready pipe; api_process writes one byte
after uvicorn's start-up). Before, the line came when the processes were started, up to
~18 s before a request was answered on a loaded 2-core machine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from llmfast.serve.launcher import _watch


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


@pytest.fixture
def processes():
    core, apis = _sleeper(), [_sleeper(), _sleeper()]
    yield SimpleNamespace(pid=core.pid, popen=core), apis
    for p in (core, *apis):
        p.kill()
        p.wait()


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_on_ready_runs_once_when_every_api_process_accepts(processes):
    core, apis = processes
    pipes = [os.pipe() for _ in apis]
    wake_r, wake_w = os.pipe()
    stop: list[int] = []
    calls: list[int] = []
    after_first: list[list[int]] = []

    def drive() -> None:
        os.write(pipes[0][1], b"r")
        os.close(pipes[0][1])
        time.sleep(0.3)  # _watch has read the first byte by now
        after_first.append(list(calls))
        os.write(pipes[1][1], b"r")
        os.close(pipes[1][1])
        _wait_for(lambda: calls)
        stop.append(signal.SIGTERM)
        os.write(wake_w, b"x")

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        failure = _watch(core, apis, wake_r, stop, [r for r, _ in pipes],
                         lambda: calls.append(1))
    finally:
        driver.join()
        os.close(wake_r)
        os.close(wake_w)
    assert failure is None
    assert after_first == [[]], "said ready with one API process still starting"
    assert calls == [1]


def test_no_ready_line_when_an_api_process_dies_starting(processes):
    """A process that exits before accepting closes its pipe without the byte: no
    "serving" line, and its exit is reported as the fault once none is left."""
    core, apis = processes
    pipes = [os.pipe() for _ in apis]
    wake_r, wake_w = os.pipe()
    calls: list[int] = []
    os.write(pipes[0][1], b"r")
    for (_, w), p in zip(pipes, apis):
        os.close(w)
        p.kill()
    try:
        failure = _watch(core, apis, wake_r, [], [r for r, _ in pipes],
                         lambda: calls.append(1))
    finally:
        os.close(wake_r)
        os.close(wake_w)
    assert calls == []
    assert failure is not None and "every API server process exited" in failure
