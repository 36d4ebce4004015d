"""`llmfast serve`'s main process: it starts the engine core in a process of its own
(llmfast/engine/core_process.py), then the frontends, and watches them all.

- `--api-servers 0`: one frontend, in this process (uvicorn on this thread).
- `--api-servers N`: N API server processes (api_process.py) share the listening socket,
  each a frontend with its own tokenizer and its own connection to the core; this process
  only watches. The processes keep their request metrics in files of one directory
  (prometheus_client's multiprocess mode), so whichever answers `/metrics` reports the
  whole server's counts.

Faults. The core's process ending (or the core stopping for good: a worker died) ends
every live request with a 503 error event (each frontend watches the core's process),
then the server stops with one error line and exit status 1. An API process that dies
takes only its own requests with it (the core aborts them); when none is left the server
stops with an error. SIGTERM or Ctrl-C (which reaches only this process: the children run
in sessions of their own) ends every live request with a 503 error event, stops the
frontends, then the core, and this process ends by the same signal, as uvicorn does. A
child whose parent dies exits by itself (`exit_when_orphaned`).
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from llmfast.engine.core_process import CoreProcessSpec, CoreReady
from llmfast.serve.api.metrics import METRICS_DIR_ENV, SHARED_METRICS_ENV
from llmfast.utils.child_processes import child_env, child_stdout

logger = logging.getLogger(__name__)

EXIT_GRACE_S = 15.0  # for the frontends to finish their responses after a stop
FAILURE_GRACE_S = 2.0  # for the frontends to write their error events after a core failure


class ServerStopped(ChildProcessError):
    """The server stopped on a fault (the core or every API process gone); one line."""


class CoreHandle:
    """The engine core's process, started and ready."""

    def __init__(self, config, source, log_level: int) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="llmfast-core-")
        self.input_address = f"ipc://{self._dir.name}/input"
        self.output_address = f"ipc://{self._dir.name}/output"
        spec_r, spec_w = os.pipe()
        ready_r, ready_w = os.pipe()
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "llmfast.engine.core_process", str(spec_r),
                 str(ready_w)], pass_fds=(spec_r, ready_w), env=child_env(),
                stdin=subprocess.DEVNULL, start_new_session=True, stdout=child_stdout())
        finally:
            os.close(spec_r)
            os.close(ready_w)
        with os.fdopen(spec_w, "wb") as f:
            pickle.dump(CoreProcessSpec(config, source, self.input_address,
                                        self.output_address, log_level), f)
        try:
            with os.fdopen(ready_r, "rb") as f:
                ready = pickle.load(f)
        except (EOFError, pickle.UnpicklingError):
            ready = None
        if not isinstance(ready, CoreReady):
            self.stop(grace_s=2.0)
            raise ServerStopped(ready if isinstance(ready, str) else
                                "the engine core process exited while starting (exit code "
                                f"{self.popen.returncode})")
        self.ready: CoreReady = ready

    @property
    def pid(self) -> int:
        return self.popen.pid

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (the core ends its loop and its workers), then SIGKILL after `grace_s`."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._dir.cleanup()


@dataclass(frozen=True)
class ApiProcessSpec:
    frontend: object  # FrontendSpec
    config: object  # ServeConfig
    index: int
    access_log: bool
    log_level: int


def serve_in_process(core: CoreHandle, spec, sock: socket.socket, config, *,
                     access_log: bool, on_ready: Callable[[], None] | None = None) -> None:
    """One frontend in this process, uvicorn on this thread; until SIGTERM / Ctrl-C
    (uvicorn then re-raises the signal) or a core failure (ServerStopped). `on_ready`
    runs once uvicorn accepts on the socket."""
    import uvicorn

    from llmfast.serve.api.app import build_app
    from llmfast.serve.frontend import Frontend

    front = Frontend(spec, index=0)
    app = build_app(front, config)

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started and on_ready is not None:
                on_ready()

        def handle_exit(self, sig, frame) -> None:  # a signal handler, on the loop's thread
            if not self.should_exit:
                front.stop_threadsafe("the server is shutting down")
            super().handle_exit(sig, frame)

    server = _Server(uvicorn.Config(app, log_level="info", access_log=access_log,
                                    timeout_graceful_shutdown=10, lifespan="on"))

    def on_failure() -> None:
        # The error events are queued; uvicorn's graceful stop writes them out.
        front._loop.call_later(FAILURE_GRACE_S / 4, setattr, server, "should_exit", True)

    front.on_failure = on_failure
    try:
        server.run(sockets=[sock])
    finally:
        core.stop()
    if front.failure is not None:
        raise ServerStopped(f"the engine stopped: {front.failure}")


def serve_with_api_processes(core: CoreHandle, spec, sock: socket.socket, config,
                             num_api_servers: int, *, access_log: bool,
                             on_ready: Callable[[], None] | None = None) -> None:
    """N API server processes; this process watches them and the core. `on_ready` runs
    once every API process accepts on the socket (they start in seconds: importing
    FastAPI, loading the tokenizer; connections queue meanwhile). Ends by the signal that
    stopped it, or with ServerStopped."""
    sock.listen(2048)  # connections queue while the API processes start
    stop_signal: list[int] = []
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def on_signal(signum, frame) -> None:
        if not stop_signal:
            stop_signal.append(signum)
        try:
            os.write(wake_w, b"x")
        except OSError:
            pass

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    metrics_dir = tempfile.TemporaryDirectory(prefix=f"llmfast-metrics-{os.getpid()}-")
    apis: list[subprocess.Popen] = []
    ready_fds: list[int] = []
    failure = None
    try:
        env = {**child_env(), METRICS_DIR_ENV: metrics_dir.name,
               SHARED_METRICS_ENV: metrics_dir.name}
        for i in range(num_api_servers):
            if stop_signal:
                break
            popen, ready_r = _start_api_process(
                ApiProcessSpec(spec, config, i, access_log,
                               logging.getLogger().getEffectiveLevel()), sock, env)
            apis.append(popen)
            ready_fds.append(ready_r)
        sock.close()  # the API processes hold it; none is accepted here
        failure = _watch(core, apis, wake_r, stop_signal, ready_fds, on_ready)
        if failure is not None and core.popen.poll() is not None:
            time.sleep(FAILURE_GRACE_S)  # the frontends write their error events
    finally:
        for p in apis:  # each ends its live requests with an error event, then exits
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + EXIT_GRACE_S
        for p in apis:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        core.stop()
        metrics_dir.cleanup()
        os.close(wake_r)
        os.close(wake_w)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure is not None:
        raise ServerStopped(failure)
    if stop_signal:
        signal.raise_signal(stop_signal[0])


def _start_api_process(spec: ApiProcessSpec, sock: socket.socket, env: dict
                       ) -> tuple[subprocess.Popen, int]:
    """The process, and the read end of its ready pipe (one byte once it accepts)."""
    spec_r, spec_w = os.pipe()
    ready_r, ready_w = os.pipe()
    try:
        popen = subprocess.Popen(
            [sys.executable, "-m", "llmfast.serve.api_process", str(spec_r),
             str(sock.fileno()), str(ready_w)], pass_fds=(spec_r, sock.fileno(), ready_w),
            env=env, stdin=subprocess.DEVNULL, start_new_session=True,
            stdout=child_stdout())
    except BaseException:
        os.close(ready_r)
        raise
    finally:
        os.close(spec_r)
        os.close(ready_w)
    with os.fdopen(spec_w, "wb") as f:
        pickle.dump(spec, f)
    return popen, ready_r


def _watch(core: CoreHandle, apis: list[subprocess.Popen], wake_r: int,
           stop_signal: list[int], ready_fds: list[int],
           on_ready: Callable[[], None] | None) -> str | None:
    """Until a signal (None) or a fault (its one-line description). Calls `on_ready` once
    every API process has said it accepts (a process that dies first closes its pipe
    without a byte: its exit is reported below instead)."""
    fds = {os.pidfd_open(core.pid): None}
    for i, p in enumerate(apis):
        fds[os.pidfd_open(p.pid)] = i
    alive = set(range(len(apis)))
    starting, started = set(ready_fds), 0
    try:
        while not stop_signal:
            try:
                ready, _, _ = select.select([wake_r, *starting, *fds], [], [])
            except InterruptedError:
                continue
            for fd in ready:
                if fd == wake_r:
                    continue
                if fd in starting:
                    starting.discard(fd)
                    started += os.read(fd, 1) == b"r"
                    os.close(fd)
                    if not starting and started == len(ready_fds) and on_ready is not None:
                        on_ready()
                    continue
                index = fds.pop(fd)
                os.close(fd)
                if index is None:
                    code = core.popen.wait()
                    logger.error("the engine core process exited (exit code %s)", code)
                    return f"the engine core process exited (exit code {code})"
                code = apis[index].wait()
                alive.discard(index)
                logger.error("API server process %d (pid %d) exited (exit code %s)", index,
                             apis[index].pid, code)
                if not alive:
                    codes = ", ".join(str(p.returncode) for p in apis)
                    return (f"every API server process exited (exit codes {codes}); the "
                            "server stopped")
        return None
    finally:
        for fd in (*fds, *starting):
            os.close(fd)
