"""The entry point of an API server process (`--api-servers N`):
`python -m llmfast.serve.api_process COMMANDS_FD OUTPUTS_FD LISTEN_FD`.

The main process holds the engine (engine_host.py) and the other ends of the two pipes;
this process runs the FastAPI app under uvicorn on the shared listening socket, over an
`EngineClient`. It reads its `ApiProcessSpec` from the outputs pipe first. It does not
import torch or the engine. It runs in a session of its own, so the terminal's Ctrl-C
reaches only the main process, which decides (it stops the engine, which ends the
streams, then tells this process to stop); a SIGINT sent here directly is ignored too. A
watchdog exits if the main process dies.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

import uvicorn

from llmfast.serve.api.app import ServeConfig, build_app
from llmfast.serve.engine_client import EngineClient
from llmfast.serve.stream import Limits
from llmfast.utils.child_processes import exit_when_orphaned
from llmfast.utils.errors import one_line


@dataclass(frozen=True)
class ApiProcessSpec:
    config: ServeConfig
    limits: Limits
    stats: object  # the engine's SchedulerStats at start
    access_log: bool
    log_level: int


class _ApiServer(uvicorn.Server):
    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGINT:
            return  # the main process decides when to stop
        super().handle_exit(sig, frame)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_when_orphaned()
    commands, outputs = Connection(int(argv[1])), Connection(int(argv[2]))
    listen = socket.socket(fileno=int(argv[3]))
    try:
        spec: ApiProcessSpec = outputs.recv()
    except EOFError:
        return 0  # the main process went away before this one started
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(levelname)s api[{os.getpid()}] %(name)s: %(message)s")
    client = EngineClient(commands, outputs, spec.limits, spec.stats)
    app = build_app(client, spec.config)
    server = _ApiServer(uvicorn.Config(app, log_level="warning", access_log=spec.access_log,
                                       timeout_graceful_shutdown=10, lifespan="on"))

    def exit_now() -> None:
        server.should_exit = True

    client.on_stop = exit_now
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
