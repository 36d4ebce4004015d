"""`llmfast serve --api-servers N`: the engine loop in the main process, the HTTP servers
in N processes of their own (api_process.py) sharing the listening socket.

Why: with the HTTP server on the engine's process (`--api-servers 0`), every streamed
chunk's JSON, SSE framing and socket write holds the same GIL as the engine's step, so
at hundreds of concurrent streams the host work of serving is added to every step. Here
the main thread only schedules, steps, detokenises and routes, as vLLM's engine core
does; each API process turns deltas into HTTP on its own core.

Each API process talks to the loop over two pipes (commands in, outputs out; protocol in
engine_client.py). A request's outputs go back to the process that took it. SIGTERM or
Ctrl-C here stops the loop: every live request ends with a 503 error event, the API
processes are told to stop, and they exit once their responses are done. An API process
that dies takes its requests with it (aborted, blocks freed); when none is left the
server stops.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from llmfast.engine import LLMEngine
from llmfast.serve.api_process import ApiProcessSpec
from llmfast.serve.api.app import ServeConfig
from llmfast.serve.engine_client import add_error_kind, encode_item
from llmfast.serve.engine_loop import (
    IDLE_HEALTH_CHECK_S,
    EngineLoop,
    _Abort,
    _Add,
    _Stop,
    engine_limits,
)

logger = logging.getLogger(__name__)

# The directory holding this `llmfast` package, for the API processes' imports.
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXIT_GRACE_S = 15.0  # for the API processes to finish their responses after "stop"


@dataclass(frozen=True, slots=True)
class _RemoteStream:
    """An HTTP request of API process `api`."""

    api: int
    request_id: str
    engine_ids: tuple[str, ...]


class ApiProcess:
    def __init__(self, index: int, listen: socket.socket, spec: ApiProcessSpec) -> None:
        self.index = index
        self.alive = True
        cmd_ours, cmd_theirs = socket.socketpair()
        out_ours, out_theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_ROOT, env.get("PYTHONPATH"))
                                            if p)
        fds = (cmd_theirs.fileno(), out_theirs.fileno(), listen.fileno())
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "llmfast.serve.api_process", *map(str, fds)],
                pass_fds=fds, env=env, stdin=subprocess.DEVNULL,
                stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else None)
        finally:
            cmd_theirs.close()
            out_theirs.close()
        self.commands = Connection(cmd_ours.detach())  # read here
        self.outputs = Connection(out_ours.detach())  # written here
        self.outputs.send(spec)


class ProcessEngineLoop(EngineLoop):
    def __init__(self, engine: LLMEngine, apis: list[ApiProcess]) -> None:
        super().__init__(engine)
        self.apis = apis
        self._pending: collections.deque = collections.deque()
        self.stop_message: str | None = None
        self._stop_delivered = False
        self.lost_every_api = False  # the last API process died: the server stops (error)
        # A signal handler writes here to end a wait at once.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def request_stop(self, message: str = "the server is shutting down") -> None:
        """From a signal handler: stop before the next step."""
        if self.stop_message is None:
            self.stop_message = message
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    def serve(self) -> None:
        """The loop until asked to stop; then tell the API processes to stop."""
        self.run()
        if self.failure is not None:
            self._broadcast(("failed", self.failure))
            # /health now says why; requests get a 503 from the API processes, which
            # know. Adds already on their way are answered here, until told to stop.
            while self.stop_message is None and any(a.alive for a in self.apis):
                self._wait_for_work(IDLE_HEALTH_CHECK_S)
                self._fail_pending_adds(f"the engine stopped: {self.failure}")
        self._broadcast(("stop", self.stop_message or "the server is shutting down"))

    def _apply_add(self, command: _Add) -> None:
        if self.apis[command.stream.api].alive:  # else nobody would read its outputs
            super()._apply_add(command)

    # ------------------------------------------------------------------ carrier hooks

    def _next_command(self):
        if self.stop_message is not None and not self._stop_delivered:
            self._stop_delivered = True
            return _Stop(self.stop_message)
        if not self._pending:
            self._receive()
        return self._pending.popleft() if self._pending else None

    def _receive(self) -> None:
        for api in self.apis:
            try:
                while api.alive and api.commands.poll():
                    self._pending.append(self._command(api, api.commands.recv()))
            except (EOFError, OSError):
                self._api_gone(api)

    @staticmethod
    def _command(api: ApiProcess, message: tuple) -> _Add | _Abort:
        if message[0] == "add":
            _, add_id, request_id, engine_ids, prompts, params, with_text = message
            return _Add(_RemoteStream(api.index, request_id, engine_ids), prompts, params,
                        (api.index, add_id), with_text)
        if message[0] == "abort":
            return _Abort(message[1])
        raise RuntimeError(f"unknown message from API process {api.index}: {message[0]!r}")

    def _wait_for_work(self, timeout: float) -> bool:
        waiting = [a.commands for a in self.apis if a.alive] + [self._wake_r]
        ready = wait(waiting, timeout)
        if self._wake_r in ready:
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
        return bool(ready)

    def _emit(self, batch) -> None:
        by_api = defaultdict(list)
        for stream, item in batch:
            by_api[stream.api].append(encode_item(stream.request_id, item))
        for index, items in by_api.items():
            self._send(self.apis[index], ("out", items))

    def _answer_add(self, command: _Add, prepared, error) -> None:
        index, add_id = command.done
        if error is None:
            message = ("added", add_id, prepared, None, None)
        else:
            message = ("added", add_id, None, add_error_kind(error), str(error))
        self._send(self.apis[index], message)

    def _stats_changed(self) -> None:
        self._broadcast(("stats", self.stats, self.num_steps))

    # ------------------------------------------------------------------ the pipes

    def _broadcast(self, message: tuple) -> None:
        for api in self.apis:
            self._send(api, message)

    def _send(self, api: ApiProcess, message: tuple) -> None:
        if not api.alive:
            return
        try:
            api.outputs.send(message)
        except (OSError, ValueError):
            self._api_gone(api)

    def _api_gone(self, api: ApiProcess) -> None:
        """Its requests have nobody to answer to: abort them, freeing their blocks."""
        if not api.alive:
            return
        api.alive = False
        logger.error("API server process %d (pid %d) exited", api.index, api.popen.pid)
        for req_id, route in list(self._routes.items()):
            if route.stream.api == api.index:
                del self._routes[req_id]
                self.engine.abort(req_id)
        if not any(a.alive for a in self.apis) and self.stop_message is None:
            self.lost_every_api = True
            self.request_stop("the API server processes exited")


def serve_with_api_processes(engine: LLMEngine, listen: socket.socket, config: ServeConfig,
                             num_api_servers: int, *, access_log: bool = False) -> None:
    """Serve until SIGTERM / Ctrl-C with `num_api_servers` HTTP processes."""
    listen.listen(2048)  # connections queue while the API processes start
    spec = ApiProcessSpec(config, engine_limits(engine), engine.stats(), access_log,
                          logging.getLogger().getEffectiveLevel())
    apis = [ApiProcess(i, listen, spec) for i in range(num_api_servers)]
    loop = ProcessEngineLoop(engine, apis)

    def on_signal(signum, frame) -> None:
        loop.request_stop("the server is shutting down")

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        loop.serve()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _stop_processes(apis, EXIT_GRACE_S)
    if loop.lost_every_api:
        codes = ", ".join(str(a.popen.returncode) for a in apis)
        raise ChildProcessError(f"every API server process exited (exit codes {codes}); "
                                "the server stopped")


def _stop_processes(apis: list[ApiProcess], grace_s: float) -> None:
    """Wait `grace_s` for the API processes to exit after "stop", then SIGTERM, SIGKILL."""
    for signal_them in (None, "terminate", "kill"):
        alive = [a for a in apis if a.popen.poll() is None]
        if not alive:
            break
        for a in alive:
            if signal_them is not None:
                try:
                    getattr(a.popen, signal_them)()
                except OSError:
                    pass
        deadline = time.monotonic() + (grace_s if signal_them is None else 2.0)
        for a in alive:
            try:
                a.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for a in apis:
        a.popen.wait()
        a.commands.close()
        a.outputs.close()


def _has_fileno(stream) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True
