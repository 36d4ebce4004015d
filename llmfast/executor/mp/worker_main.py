"""The entry point of an `mp` worker process: `python -m llmfast.executor.mp.worker_main FD`.

FD is this end of a socket pair whose other end the engine holds. The worker reads its
`WorkerSpec`, starts its rank, answers READY, then serves steps (EXECUTE,
EXECUTE_THEN_COLLECT, COLLECT) until SHUTDOWN. It never outlives the engine: the pipe's
end of file (the engine's process closed it or died) ends the loop, and a watchdog
thread exits when the parent process is gone while the loop is busy (a step blocked on
a rank that died, say). Ctrl-C in the terminal reaches the whole process group: the
worker ignores it and lets the engine decide. An exception is reported as one ERROR
message (one line, plus the traceback for --debug logs) before the worker exits with
status 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

from llmfast.executor.mp import messages
from llmfast.utils.child_processes import exit_when_orphaned
from llmfast.utils.errors import one_line

def _report(conn: Connection, rank: int, error: BaseException, during: str) -> None:
    report = messages.WorkerError(rank, one_line(error, max_chars=None), during,
                                  traceback.format_exc())
    try:
        conn.send_bytes(messages.encode(messages.ERROR, report))
    except OSError:
        pass  # the engine is gone already


def serve(conn: Connection) -> int:
    from llmfast.worker.worker import Worker, WorkerSpec

    spec: WorkerSpec = messages.decode(conn.recv_bytes())[1]
    logging.basicConfig(level=_log_level(), stream=sys.stderr,
                        format=f"%(levelname)s rank {spec.rank} %(name)s: %(message)s")
    worker = Worker(spec)
    try:
        ready = worker.start()
    except Exception as e:  # noqa: BLE001 - reported to the engine, which names the rank
        _report(conn, spec.rank, e, "during start-up")
        return 1
    conn.send_bytes(messages.encode(messages.READY, ready))
    from llmfast.utils.gc_freeze import hold_gc_freeze

    hold_gc_freeze()  # the runner's objects live as long as this process (see gc_freeze)
    try:
        while True:
            kind, payload = messages.decode(conn.recv_bytes())
            if kind == messages.EXECUTE:
                worker.execute(payload)
            elif kind == messages.EXECUTE_THEN_COLLECT:
                worker.execute(payload)
                _send_oldest(conn, worker)
            elif kind == messages.COLLECT:
                _send_oldest(conn, worker)
            elif kind == messages.SHUTDOWN:
                return 0
            else:
                raise RuntimeError(f"unknown message {kind!r}")
    except EOFError:
        return 0  # the engine closed its end: nothing left to do
    except Exception as e:  # noqa: BLE001
        _report(conn, spec.rank, e, "in a step")
        return 1


def _send_oldest(conn: Connection, worker) -> None:
    """Collect the oldest launched step; rank 0 sends its tokens, the others nothing."""
    out = worker.collect()
    if out is not None:
        conn.send_bytes(messages.encode(messages.OUTPUT, out))


def _log_level() -> int:
    return int(os.environ.get("LLMFAST_WORKER_LOG_LEVEL", logging.WARNING))


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_when_orphaned()
    fd = int(argv[1])
    os.set_inheritable(fd, False)  # not into processes this one starts (compile workers)
    conn = Connection(fd)
    try:
        return serve(conn)
    except EOFError:
        return 0  # the engine went away before the worker started
    finally:
        conn.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
