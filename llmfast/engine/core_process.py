"""The engine core in a process of its own (`llmfast serve`):
`python -m llmfast.engine.core_process SPEC_FD READY_FD`.

`EngineCoreProc`'s busy loop only takes new requests and aborts, steps, and hands each
step's `EngineCoreOutputs` (token ids, finish reasons, logprobs as arrays) to the output
thread. No HTTP, no tokenizer, no text, no Python object per token. Two I/O threads do the
sockets: the input thread receives and decodes clients' messages (msgspec) and watches
each client's process; the output thread splits a step's outputs by client, encodes and
sends them while the busy loop runs the next step (the forward lets go of the GIL).

Sockets (ZeroMQ, on ipc:// paths the launcher chose): the core binds a ROUTER for input
and one for output; each client (a frontend) connects a DEALER to each with the identity
`client_identity(index)`, then sends HELLO (its index and pid) until READY comes back.
A client whose process ends has its requests aborted (their KV blocks freed at once).

The launcher (llmfast/serve/launcher.py) reads one pickled `CoreReady` (or an error
line) from READY_FD once the model is loaded. SIGTERM stops the loop; SIGINT is ignored
(the launcher decides); the process exits if the launcher dies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from llmfast.engine.core import EngineCore
from llmfast.engine.processing.input_processor import CoreLimits
from llmfast.engine.messages import (
    ClientMessage,
    CoreMessage,
    EngineCoreOutputs,
    EngineCoreRequest,
    StepStats,
)

logger = logging.getLogger(__name__)

IDLE_HEALTH_CHECK_S = 1.0  # how often an idle core checks that its workers are alive
STATS_INTERVAL_S = 0.25  # a client without requests in a step gets stats this often
_STOP = object()


def client_identity(index: int) -> bytes:
    return b"client-%d" % index


@dataclass(frozen=True)
class CoreProcessSpec:
    config: object  # EngineConfig (resolved by the launcher: no download here)
    source: object  # ModelSource
    input_address: str
    output_address: str
    log_level: int


@dataclass(frozen=True)
class CoreReady:
    limits: CoreLimits
    stats: StepStats
    startup_times: dict


class _Failed(Exception):
    pass


class EngineCoreProc:
    def __init__(self, core: EngineCore, input_address: str, output_address: str,
                 owns_core: bool = True) -> None:
        self.core = core
        self.owns_core = owns_core  # shut the core down when the loop ends
        self.failure: str | None = None  # why the core stopped for good
        self._ctx = zmq.Context(io_threads=1)
        self._inputs: queue.SimpleQueue = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        # Request id -> the client that sent it; written by the busy loop, entries of
        # finished requests dropped by the output thread after their last output.
        self._owner: dict[str, int] = {}
        self._clients: dict[int, int] = {}  # index -> pid, once it said HELLO
        self._stopping = threading.Event()
        self._last_stats: StepStats | None = None
        self._input_socket = self._ctx.socket(zmq.ROUTER)
        self._input_socket.bind(input_address)
        self._output_socket = self._ctx.socket(zmq.ROUTER)
        self._output_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._output_socket.setsockopt(zmq.SNDHWM, 0)  # a slow client queues, never drops
        self._output_socket.bind(output_address)
        # A signal handler writes here to wake the input thread's poll.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._threads = [
            threading.Thread(target=self._input_loop, name="llmfast-core-input", daemon=True),
            threading.Thread(target=self._output_loop, name="llmfast-core-output", daemon=True),
        ]

    def request_stop(self) -> None:
        """From a signal handler too: the loop stops before its next step."""
        self._stopping.set()
        self._inputs.put(_STOP)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    # ------------------------------------------------------------------ busy loop

    def run(self) -> None:
        for t in self._threads:
            t.start()
        core = self.core
        failure = None
        try:
            while not self._stopping.is_set():
                if not self._take_inputs(block=not core.has_unfinished()):
                    break
                if not core.has_unfinished():
                    # Idle (all finished or aborted): the clients' /metrics say so.
                    stats = core.stats()
                    if stats != self._last_stats:
                        self._last_stats = stats
                        self._outputs.put(EngineCoreOutputs(stats=stats))
                    continue
                try:
                    outputs = core.step()
                except Exception as e:  # noqa: BLE001
                    if _is_executor_error(e):
                        raise _Failed(str(e)) from None
                    logger.exception("engine step failed; aborting the requests in flight")
                    outputs = self._abort_all("internal error in the engine step", 500)
                if outputs is not None:
                    outputs.stats = self._last_stats = core.stats()
                    self._outputs.put(outputs)
        except _Failed as e:
            failure = self.failure = str(e)  # before the clients hear of it
            logger.error("the engine stopped: %s", failure)
            self._outputs.put(("failed", failure))
        finally:
            self._outputs.put(_STOP)
            self._threads[1].join(timeout=5)
            self._stopping.set()
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
            self._threads[0].join(timeout=5)
            self._ctx.destroy(linger=0)
            if self.owns_core:
                core.shutdown()
        if failure is not None and self.owns_core:
            raise SystemExit(f"error: the engine stopped: {failure}")

    def _take_inputs(self, block: bool) -> bool:
        """Apply every queued input (waiting for one if `block`); False once stopped."""
        try:
            item = self._inputs.get(timeout=IDLE_HEALTH_CHECK_S) if block \
                else self._inputs.get_nowait()
        except queue.Empty:
            if block:
                try:  # idle: notice a dead worker now, not at the next request
                    self.core.check_health()
                except Exception as e:  # noqa: BLE001
                    if _is_executor_error(e):
                        raise _Failed(str(e)) from None
                    raise
            return True
        while True:
            if item is _STOP:
                return False
            self._apply(*item)
            try:
                item = self._inputs.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, kind: int, client: int, payload) -> None:
        core = self.core
        if kind == ClientMessage.ADD:
            errors = {}
            for request in payload:
                try:
                    core.add_request(request)
                except ValueError as e:  # the frontend checked it; a reused id, say
                    errors[request.request_id] = (str(e), 400)
                    continue
                self._owner[request.request_id] = client
            if errors:
                out = EngineCoreOutputs(errors=errors)
                self._outputs.put(("to", client, out))
        elif kind == ClientMessage.ABORT:
            core.abort_requests(payload)
            for req_id in payload:
                self._owner.pop(req_id, None)
        elif kind == ClientMessage.STOP_STRINGS:
            core.finish_requests(payload, "stop")
            for req_id in payload:
                self._owner.pop(req_id, None)
        elif kind == ClientMessage.HELLO:
            self._outputs.put(("to", client, (CoreMessage.READY, core.stats())))
        elif kind == -1:  # the client's process ended
            gone = [r for r, c in list(self._owner.items()) if c == client]
            core.abort_requests(gone)
            for req_id in gone:
                self._owner.pop(req_id, None)

    def _abort_all(self, message: str, status: int) -> EngineCoreOutputs:
        ids = list(self._owner)
        with contextlib.suppress(Exception):  # after a failed step: free what we can
            self.core.abort_requests(ids)
        return EngineCoreOutputs(errors={r: (message, status) for r in ids})

    # ------------------------------------------------------------------ I/O threads

    def _input_loop(self) -> None:
        decoders = {ClientMessage.ADD: msgspec.msgpack.Decoder(list[EngineCoreRequest]),
                    ClientMessage.ABORT: msgspec.msgpack.Decoder(list[str]),
                    ClientMessage.STOP_STRINGS: msgspec.msgpack.Decoder(list[str]),
                    ClientMessage.HELLO: msgspec.msgpack.Decoder(tuple[int, int])}
        poller = zmq.Poller()
        poller.register(self._input_socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        pidfds: dict[int, int] = {}  # pidfd -> client index
        try:
            while not self._stopping.is_set():
                for sock, _ in poller.poll():
                    if sock is self._input_socket:
                        while True:
                            try:
                                identity, kind, payload = self._input_socket.recv_multipart(
                                    zmq.NOBLOCK, copy=False)
                            except zmq.Again:
                                break
                            kind = ClientMessage(int(kind.bytes))
                            client = int(identity.bytes.rsplit(b"-", 1)[1])
                            value = decoders[kind].decode(payload.buffer)
                            if kind == ClientMessage.HELLO and client not in self._clients:
                                self._clients[client] = value[1]
                                fd = _pidfd(value[1])
                                if fd is not None:
                                    pidfds[fd] = client
                                    poller.register(fd, zmq.POLLIN)
                            self._inputs.put((kind, client, value))
                    elif sock in pidfds:
                        client = pidfds.pop(sock)
                        poller.unregister(sock)
                        os.close(sock)
                        logger.info("client %d (pid %d) exited; aborting its requests",
                                    client, self._clients.get(client, -1))
                        self._inputs.put((-1, client, None))
        except zmq.ContextTerminated:
            pass
        finally:
            for fd in pidfds:
                os.close(fd)

    def _output_loop(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        sock = self._output_socket
        owner = self._owner
        outputs_kind = b"%d" % CoreMessage.OUTPUTS
        last_sent: dict[int, float] = {}

        def send(client: int, frames: list) -> None:
            try:
                sock.send_multipart([client_identity(client), *frames], copy=False)
            except zmq.ZMQError as e:  # EHOSTUNREACH: not connected (yet, or any more)
                logger.debug("output to client %d dropped: %s", client, e)

        while True:
            item = self._outputs.get()
            if item is _STOP:
                return
            if isinstance(item, tuple) and item[0] == "failed":
                for client in list(self._clients):
                    send(client, [b"%d" % CoreMessage.FAILED, encoder.encode(item[1])])
                continue
            if isinstance(item, tuple):  # ("to", client, message): for one client
                _, client, message = item
                if isinstance(message, EngineCoreOutputs):
                    send(client, [outputs_kind, encoder.encode(message)])
                else:
                    send(client, [b"%d" % message[0], encoder.encode(message[1])])
                continue
            now = time.monotonic()
            for client, part in _split_by_client(item, owner, self._clients).items():
                # A client with nothing in this step gets the stats a few times a second.
                if (not part.req_ids and not part.errors and not part.scheduled
                        and len(self._clients) > 1 and item.req_ids
                        and now - last_sent.get(client, 0.0) < STATS_INTERVAL_S):
                    continue
                last_sent[client] = now
                send(client, [outputs_kind, encoder.encode(part)])
            if item.finish_reasons:
                for i in item.finish_reasons:
                    owner.pop(item.req_ids[i], None)
            for req_id in item.errors:
                owner.pop(req_id, None)


def _split_by_client(outputs: EngineCoreOutputs, owner: dict[str, int],
                     clients: dict[int, int]) -> dict[int, EngineCoreOutputs]:
    """Each client's part of a step's outputs (every client gets the stats)."""
    if len(clients) <= 1:
        return {next(iter(clients), 0): outputs}
    parts = {c: EngineCoreOutputs(stats=outputs.stats) for c in clients}
    finish, logprobs = outputs.finish_reasons, outputs.logprobs
    for i, (req_id, ids) in enumerate(zip(outputs.req_ids, outputs.new_token_ids)):
        part = parts.get(owner.get(req_id, -1))
        if part is None:
            continue
        j = len(part.req_ids)
        part.req_ids.append(req_id)
        part.new_token_ids.append(ids)
        if finish and i in finish:
            part.finish_reasons[j] = finish[i]
        if logprobs and i in logprobs:
            part.logprobs[j] = logprobs[i]
    for name in ("prompt_logprobs", "errors"):
        for req_id, value in getattr(outputs, name).items():
            part = parts.get(owner.get(req_id, -1))
            if part is not None:
                getattr(part, name)[req_id] = value
    for req_id, num_cached in outputs.scheduled:
        part = parts.get(owner.get(req_id, -1))
        if part is not None:
            part.scheduled.append((req_id, num_cached))
    return parts


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def _is_executor_error(e: BaseException) -> bool:
    from llmfast.executor import ExecutorError

    return isinstance(e, ExecutorError)


def main(argv: list[str]) -> int:
    from llmfast.engine.startup import start_engine
    from llmfast.utils.child_processes import exit_when_orphaned

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_when_orphaned()
    with os.fdopen(int(argv[1]), "rb") as f:
        spec: CoreProcessSpec = pickle.load(f)
    ready = os.fdopen(int(argv[2]), "wb")
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(levelname)s core[{os.getpid()}] %(name)s: %(message)s")
    stop_early = []
    signal.signal(signal.SIGTERM, lambda *_: stop_early.append(True))
    try:
        started = start_engine(spec.config, spec.source)
        core = EngineCore(spec.config, started)
    except Exception as e:  # noqa: BLE001 - reported by the launcher as one line
        from llmfast.utils.errors import one_line

        logger.debug("engine start failed", exc_info=True)
        pickle.dump(one_line(e, max_chars=None), ready)
        ready.close()
        return 1
    proc = EngineCoreProc(core, spec.input_address, spec.output_address)
    signal.signal(signal.SIGTERM, lambda *_: proc.request_stop())
    if stop_early:
        proc.request_stop()
    limits = CoreLimits(spec.config.scheduler.max_model_len, spec.config.model.vocab_size,
                        core.scheduler.block_size,
                        core.scheduler.kv_cache_manager.num_usable_blocks)
    pickle.dump(CoreReady(limits, core.stats(), {**started.executor.startup_times,
                                                  **started.startup_times}), ready)
    ready.close()
    del started
    # The busy loop on a thread of its own, the main thread only waiting (and taking
    # signals): torch ops issued from the main thread ran many times slower than from a
    # worker thread on an oversubscribed CPU (profiles/serving.md), and the in-process
    # engine of `LLM` benchmarks and the old server stepped on a worker thread too.
    failure: list[BaseException] = []

    def run() -> None:
        try:
            proc.run()
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            failure.append(e)

    loop = threading.Thread(target=run, name="llmfast-core-busy-loop")
    loop.start()
    while loop.is_alive():
        loop.join(timeout=0.5)
    if failure:
        raise failure[0]
    return 0


if __name__ == "__main__":
    # The module's own copy, not __main__'s: what it pickles must name its real module.
    from llmfast.engine import core_process

    sys.exit(core_process.main(sys.argv))
