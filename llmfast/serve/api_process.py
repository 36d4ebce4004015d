"""The entry point of an API server process (`llmfast serve --api-servers N`):
`python -m llmfast.serve.api_process SPEC_FD LISTEN_FD [READY_FD]`.

A frontend (frontend.py) with the FastAPI app under uvicorn on the shared listening
socket: it tokenizes, detokenizes, streams, and talks to the engine core's process over
ZeroMQ. It does not import torch. It reads its `ApiProcessSpec` (launcher.py) from
SPEC_FD and writes one byte to READY_FD once uvicorn accepts on the socket (the main
process says "serving ... at URL" when every API process has). It runs in a session of its own, so the terminal's Ctrl-C reaches only the main
process, which decides (it SIGTERMs this one: every live request ends with an error
event, then uvicorn stops); a SIGINT sent here directly is ignored. It exits when the
core fails (after its error events are out) or when the main process dies.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import sys

import uvicorn

from llmfast.serve.api.app import build_app
from llmfast.serve.frontend import Frontend
from llmfast.utils.child_processes import exit_when_orphaned
from llmfast.utils.errors import one_line

FAILURE_EXIT_DELAY_S = 0.5  # for the error events to go out before uvicorn stops


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_when_orphaned()
    listen = socket.socket(fileno=int(argv[2]))
    ready_fd = int(argv[3]) if len(argv) > 3 else None
    try:
        with os.fdopen(int(argv[1]), "rb") as f:
            spec = pickle.load(f)
    except EOFError:
        return 0  # the main process went away before this one started
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(levelname)s api[{os.getpid()}] %(name)s: %(message)s")
    front = Frontend(spec.frontend, spec.index)
    app = build_app(front, spec.config)

    class _ApiServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if ready_fd is not None and self.started:
                os.write(ready_fd, b"r")
                os.close(ready_fd)

        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGINT:
                return  # the main process decides when to stop
            if not self.should_exit:
                front.stop_threadsafe("the server is shutting down")
            super().handle_exit(sig, frame)

    server = _ApiServer(uvicorn.Config(app, log_level="warning", access_log=spec.access_log,
                                       timeout_graceful_shutdown=10, lifespan="on"))
    if spec.access_log:  # uvicorn's access lines are INFO records
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)

    def on_failure() -> None:
        front._loop.call_later(FAILURE_EXIT_DELAY_S, setattr, server, "should_exit", True)

    front.on_failure = on_failure
    server.run(sockets=[listen])
    return 0


def run(argv: list[str]) -> int:
    """`main`, with a failure as one line on stderr (the main process reports the exit)."""
    try:
        return main(argv)
    except Exception as e:  # noqa: BLE001 - this process's last line of defence
        logging.getLogger(__name__).debug("API server process failed", exc_info=True)
        print(f"error: API server process {os.getpid()}: {one_line(e, max_chars=None)}",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(run(sys.argv))
