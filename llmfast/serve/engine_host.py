"""`llmfast serve --api-servers N`: the engine loop in the main process, the HTTP servers
in N processes of their own (api_process.py) sharing the listening socket.

Why: with the HTTP server on the engine's process (`--api-servers 0`), every streamed
chunk's JSON, SSE framing and socket write holds the same GIL as the engine's step, so
at hundreds of concurrent streams the host work of serving is added to every step. Here
the main thread only schedules, steps, detokenises and routes, as vLLM's engine core
does; each API process turns deltas into HTTP on its own core.

Each API process talks to the loop over two pipes (commands in, outputs out; protocol in
engine_client.py). A request's outputs go back to the process that took it. The loop
never blocks on an API process: outputs wait in a per-process outbox, written as the
pipe takes them, so one process that stalls (a long GC pause, a debugger) delays only
its own streams; one that makes no progress for `API_STALL_S` is killed and treated as
dead. A dead API process takes its requests with it (aborted, blocks freed); when none
is left the server stops with an error. The processes keep their request metrics in
files of one directory (prometheus_client's multiprocess mode), so whichever answers
`/metrics` reports the whole server's counts.

SIGTERM or Ctrl-C here stops the loop: every live request ends with a 503 error event,
the API processes (in a session of their own: the terminal's Ctrl-C reaches only this
process) are told to stop and exit once their responses are done, and this process then
ends by the same signal, as uvicorn does.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from multiprocessing.connection import Connection

from llmfast.engine import LLMEngine
from llmfast.serve.api.app import ServeConfig
from llmfast.serve.api.metrics import METRICS_DIR_ENV, SHARED_METRICS_ENV
from llmfast.serve.api_process import ApiProcessSpec
from llmfast.serve.engine_client import call_error_kind, encode_item
from llmfast.serve.engine_loop import EngineLoop, engine_limits
from llmfast.serve.loop_commands import AbortCommand, AddCommand, QueryCommand, StopCommand
from llmfast.utils.child_processes import child_env, child_stdout, stop_children

logger = logging.getLogger(__name__)

EXIT_GRACE_S = 15.0  # for the API processes to finish their responses after "stop"
API_STALL_S = 30.0  # an API process that reads nothing of its outputs this long is killed


class ApiProcess:
    """One API server process and the engine's ends of its pipes."""

    def __init__(self, index: int, listen: socket.socket, spec: ApiProcessSpec,
                 metrics_dir: str) -> None:
        self.index = index
        self.alive = True
        cmd_ours, cmd_theirs = socket.socketpair()
        out_ours, out_theirs = socket.socketpair()
        fds = (cmd_theirs.fileno(), out_theirs.fileno(), listen.fileno())
        try:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "llmfast.serve.api_process", *map(str, fds)],
                # prometheus_client reads the variable when it is imported: each API
                # process keeps its counts in files there, and /metrics sums them all.
                pass_fds=fds, env={**child_env(), METRICS_DIR_ENV: metrics_dir,
                                   SHARED_METRICS_ENV: metrics_dir},
                stdin=subprocess.DEVNULL,
                start_new_session=True, stdout=child_stdout())
        finally:
            cmd_theirs.close()
            out_theirs.close()
        self.commands = Connection(cmd_ours.detach())  # read here, blocking reads
        out_ours.setblocking(False)
        self.outputs = out_ours  # written here, never blocking: see `flush`
        self._outbox: collections.deque[memoryview] = collections.deque()
        self.last_progress = time.monotonic()  # the last time the outbox was empty or moved
        self.stats_sent: tuple | None = None
        self.queue(spec)

    def queue(self, message: object) -> None:
        """Queue `message` framed as `Connection.send` frames it (the API process reads
        it with `Connection.recv`), and write what the pipe takes now."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if not self._outbox:
            self.last_progress = time.monotonic()
        self._outbox.append(memoryview(struct.pack("!i", len(payload)) + payload))
        self.flush()

    @property
    def backlogged(self) -> bool:
        return bool(self._outbox)

    def flush(self) -> None:
        """Write queued outputs until the pipe is full. OSError: the process is gone."""
        outbox = self._outbox
        while outbox:
            try:
                sent = self.outputs.send(outbox[0])
            except BlockingIOError:
                return
            self.last_progress = time.monotonic()
            if sent == len(outbox[0]):
                outbox.popleft()
            else:
                outbox[0] = outbox[0][sent:]

    def stalled(self, now: float) -> bool:
        return self.backlogged and now - self.last_progress > API_STALL_S

    def close_handles(self) -> None:
        self.commands.close()
        self.outputs.close()


class ProcessEngineLoop(EngineLoop):
    def __init__(self, engine: LLMEngine, apis: list[ApiProcess]) -> None:
        super().__init__(engine)
        self.apis = apis
        self._pending: collections.deque = collections.deque()
        self.stop_message: str | None = None
        self.stop_signal: int | None = None  # the signal that stopped the server, if one did
        self._stop_delivered = False
        self.lost_every_api = False  # the last API process died: the server stops (error)
        # A signal handler writes here to end a wait at once.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)

    def request_stop(self, message: str = "the server is shutting down") -> None:
        """From a signal handler too: stop before the next step."""
        if self.stop_message is None:
            self.stop_message = message
        self._wake_up()

    def _wake_up(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (a wake-up is pending anyway) or closed
            pass

    def serve(self) -> None:
        """The loop until asked to stop; then tell the API processes to stop and give
        them `EXIT_GRACE_S` to finish their responses and exit."""
        self.run()
        self._broadcast(("stop", self.stop_message or "the server is shutting down"))
        deadline = time.monotonic() + EXIT_GRACE_S
        while time.monotonic() < deadline and any(a.popen.poll() is None for a in self.apis):
            self._flush_all()
            self._wait_for_io(min(0.1, max(0.0, deadline - time.monotonic())), commands=False)

    def _stop_for_good(self, reason: str) -> bool:
        self._broadcast(("failed", reason))  # /health says why; new requests get a 503
        return super()._stop_for_good(reason)

    def _stream_alive(self, stream: _RemoteStream) -> bool:
        return self.apis[stream.api].alive

    # ------------------------------------------------------------------ carrier hooks

    def _next_command(self):
        if self.stop_message is not None and not self._stop_delivered:
            self._stop_delivered = True
            return StopCommand(self.stop_message)
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
    def _command(api: ApiProcess, message: tuple) -> AddCommand | QueryCommand | AbortCommand:
        if message[0] == "add":
            _, call_id, request_id, engine_ids, prompts, params, with_text, check = message
            return AddCommand(_RemoteStream(api.index, request_id, engine_ids), prompts,
                              params, (api.index, call_id), with_text, check)
        if message[0] == "query":
            return QueryCommand(message[2], (api.index, message[1]))
        if message[0] == "abort":
            return AbortCommand(message[1])
        raise RuntimeError(f"unknown message from API process {api.index}: {message[0]!r}")

    def _wait_for_work(self, timeout: float) -> bool:
        return self._wait_for_io(timeout, commands=True)

    def _emit(self, batch) -> None:
        by_api = defaultdict(list)
        for stream, item in batch:
            by_api[stream.api].append(encode_item(stream.request_id, item))
        for index, items in by_api.items():
            self._queue(self.apis[index], ("out", items))

    def _answer(self, command: AddCommand | QueryCommand, result, error) -> None:
        index, call_id = command.done
        if error is None:
            message = ("answer", call_id, result, None, None)
        else:
            message = ("answer", call_id, None, call_error_kind(error), str(error))
        self._queue(self.apis[index], message)

    def _stats_changed(self) -> None:
        """The latest stats to each API process that keeps up (a backlogged one gets
        them once it has caught up: stats are a snapshot, never worth queueing)."""
        self._flush_all()
        now = time.monotonic()
        for api in self.apis:
            if not api.alive:
                continue
            if api.stalled(now):
                logger.error("API server process %d (pid %d) read nothing for %.0f s: "
                             "stopping it", api.index, api.popen.pid, API_STALL_S)
                api.popen.kill()
                self._api_gone(api)
                continue
            if not api.backlogged and api.stats_sent != (self.stats, self.num_steps):
                api.stats_sent = (self.stats, self.num_steps)
                self._queue(api, ("stats", self.stats, self.num_steps))

    # ------------------------------------------------------------------ the pipes

    def _wait_for_io(self, timeout: float, commands: bool) -> bool:
        """Wait for a command (if `commands`), a wake-up, or room in a backlogged
        outputs pipe (which is then written); True if anything happened."""
        live = [a for a in self.apis if a.alive]
        readable = [a.commands for a in live] if commands else []
        writable = [a.outputs for a in live if a.backlogged]
        ready_r, ready_w, _ = select.select(readable + [self._wake_r], writable, [], timeout)
        if self._wake_r in ready_r:
            try:
                while self._wake_r.recv(4096):
                    pass
            except BlockingIOError:
                pass
        if ready_w:
            self._flush_all()
        return bool(ready_r or ready_w)

    def _flush_all(self) -> None:
        for api in self.apis:
            if api.alive and api.backlogged:
                try:
                    api.flush()
                except OSError:
                    self._api_gone(api)

    def _broadcast(self, message: tuple) -> None:
        for api in self.apis:
            self._queue(api, message)

    def _queue(self, api: ApiProcess, message: tuple) -> None:
        if not api.alive:
            return
        try:
            api.queue(message)
        except OSError:
            self._api_gone(api)

    def _api_gone(self, api: ApiProcess) -> None:
        """Its requests have nobody to answer to: abort them, freeing their blocks."""
        if not api.alive:
            return
        api.alive = False
        api.popen.poll()  # reaped now if it has exited (no zombie until the server stops)
        if self.stop_message is None:
            logger.error("API server process %d (pid %d) exited", api.index, api.popen.pid)
        gone = [req_id for req_id, route in self._routes.items() if route.stream.api == api.index]
        for req_id in gone:
            del self._routes[req_id]
        self.engine.abort_many(gone)
        if not any(a.alive for a in self.apis) and self.stop_message is None:
            self.lost_every_api = True
            self.request_stop("the API server processes exited")


class _RemoteStream:
    """An HTTP request of API process `api` (one object per add: its choices share it)."""

    __slots__ = ("api", "request_id", "engine_ids")

    def __init__(self, api: int, request_id: str, engine_ids: tuple[str, ...]) -> None:
        self.api = api
        self.request_id = request_id
        self.engine_ids = engine_ids


def serve_with_api_processes(engine: LLMEngine, listen: socket.socket, config: ServeConfig,
                             num_api_servers: int, *, access_log: bool = False) -> None:
    """Serve until SIGTERM / Ctrl-C with `num_api_servers` HTTP processes; then end by
    that signal (exit status 128 + its number, as with `--api-servers 0`)."""
    listen.listen(2048)  # connections queue while the API processes start
    spec = ApiProcessSpec(config, engine_limits(engine), engine.stats(), access_log,
                          logging.getLogger().getEffectiveLevel())
    loop = ProcessEngineLoop(engine, [])

    def on_signal(signum, frame) -> None:
        if loop.stop_signal is None:
            loop.stop_signal = signum
        loop.request_stop("the server is shutting down")

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    metrics_dir = tempfile.TemporaryDirectory(prefix=f"llmfast-metrics-{os.getpid()}-")
    try:
        for i in range(num_api_servers):
            if loop.stop_message is None:
                loop.apis.append(ApiProcess(i, listen, spec, metrics_dir.name))
        listen.close()  # the API processes hold it; none is accepted here
        loop.serve()
    finally:
        stop_children(loop.apis, grace_s=0.0)
        metrics_dir.cleanup()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if loop.lost_every_api:
        codes = ", ".join(str(a.popen.returncode) for a in loop.apis)
        raise ChildProcessError(f"every API server process exited (exit codes {codes}); "
                                "the server stopped")
    if loop.stop_signal is not None:
        signal.raise_signal(loop.stop_signal)
