"""How a frontend talks to the engine core, in its own process or in another: one
interface (`EngineCoreClient`: add checked requests, abort them, finish those a stop
string ended, shut down), two carriers.

- `InprocClient`: the core in this process (`LLM`, `llmfast chat`): calls, no copies;
  the caller steps it (`step()`) and gets the outputs back.
- `MPClient`: the core in a process of its own (`llmfast serve`; core_process.py):
  requests out on a ZeroMQ DEALER socket as msgpack, outputs in on another, read and
  decoded by an I/O thread of this client that hands each message to `on_message` (the
  frontend's event loop takes it from there). The same thread watches the core's process
  and reports its end as a FAILED message.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import msgspec
import zmq

from llmfast.engine.messages import (
    ClientMessage,
    CoreMessage,
    EngineCoreOutputs,
    EngineCoreRequest,
    StepStats,
)

logger = logging.getLogger(__name__)

HELLO_INTERVAL_S = 0.2  # until the core answers (its socket may not be connected yet)


class EngineCoreClient:
    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> None:
        raise NotImplementedError

    def abort_requests(self, req_ids: Sequence[str]) -> None:
        raise NotImplementedError

    def finish_stopped(self, req_ids: Sequence[str]) -> None:
        """End requests a stop string ended (the core cannot see text)."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class InprocClient(EngineCoreClient):
    def __init__(self, core) -> None:
        self.core = core  # an EngineCore

    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> None:
        for request in requests:
            self.core.add_request(request)

    def abort_requests(self, req_ids: Sequence[str]) -> None:
        self.core.abort_requests(req_ids)

    def finish_stopped(self, req_ids: Sequence[str]) -> None:
        self.core.finish_requests(req_ids, "stop")

    def step(self) -> EngineCoreOutputs | None:
        return self.core.step()

    def shutdown(self) -> None:
        self.core.shutdown()


class MPClient(EngineCoreClient):
    """`on_message(kind, payload)` is called on this client's I/O thread: for OUTPUTS an
    `EngineCoreOutputs`, READY a `StepStats` (once), FAILED a one-line reason (the core
    stopped for good, or its process ended)."""

    def __init__(self, input_address: str, output_address: str, index: int, core_pid: int,
                 on_message: Callable[[CoreMessage, object], None]) -> None:
        from llmfast.engine.core_process import client_identity

        self.index = index
        self.core_pid = core_pid
        self._on_message = on_message
        self._ctx = zmq.Context(io_threads=1)
        self._encoder = msgspec.msgpack.Encoder()
        self._send_lock = threading.Lock()
        self._input = self._ctx.socket(zmq.DEALER)
        self._input.setsockopt(zmq.IDENTITY, client_identity(index))
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.connect(input_address)
        self._output = self._ctx.socket(zmq.DEALER)
        self._output.setsockopt(zmq.IDENTITY, client_identity(index))
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.connect(output_address)
        self._closed = False
        self._thread = threading.Thread(target=self._output_loop, daemon=True,
                                        name="llmfast-core-client")

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------------ requests

    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> None:
        self._send(ClientMessage.ADD, list(requests))

    def abort_requests(self, req_ids: Sequence[str]) -> None:
        self._send(ClientMessage.ABORT, list(req_ids))

    def finish_stopped(self, req_ids: Sequence[str]) -> None:
        self._send(ClientMessage.STOP_STRINGS, list(req_ids))

    def _send(self, kind: ClientMessage, payload) -> None:
        data = self._encoder.encode(payload)
        with self._send_lock:
            if not self._closed:
                self._input.send_multipart([b"%d" % kind, data], copy=False)

    def shutdown(self) -> None:
        """Stop the I/O thread (it closes the sockets within its poll interval)."""
        with self._send_lock:
            self._closed = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    # ------------------------------------------------------------------ I/O thread

    def _output_loop(self) -> None:
        decoders = {CoreMessage.OUTPUTS: msgspec.msgpack.Decoder(EngineCoreOutputs),
                    CoreMessage.READY: msgspec.msgpack.Decoder(StepStats),
                    CoreMessage.FAILED: msgspec.msgpack.Decoder(str)}
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        try:
            pidfd = os.pidfd_open(self.core_pid)
        except (OSError, AttributeError):
            pidfd = None
        if pidfd is not None:
            poller.register(pidfd, zmq.POLLIN)
        ready = False
        next_hello = 0.0
        try:
            while not self._closed:
                if not ready and time.monotonic() >= next_hello:
                    self._send(ClientMessage.HELLO, (self.index, os.getpid()))
                    next_hello = time.monotonic() + HELLO_INTERVAL_S
                events = dict(poller.poll(100 if not ready else 500))
                if pidfd is not None and pidfd in events:
                    # Whatever it sent before it ended comes first.
                    self._drain(decoders)
                    self._on_message(CoreMessage.FAILED,
                                     f"the engine core process (pid {self.core_pid}) exited")
                    return
                if self._output in events:
                    ready |= self._drain(decoders)
        except zmq.ContextTerminated:
            return
        finally:
            if pidfd is not None:
                os.close(pidfd)
            self._input.close(linger=0)
            self._output.close(linger=0)

    def _drain(self, decoders) -> bool:
        """Hand over every message waiting; True if READY was among them."""
        got_ready = False
        while True:
            try:
                kind, payload = self._output.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return got_ready
            kind = CoreMessage(int(kind.bytes))
            got_ready |= kind == CoreMessage.READY
            self._on_message(kind, decoders[kind].decode(payload.buffer))
