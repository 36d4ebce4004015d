"""Run the app under uvicorn on a socket bound by the caller, with a clean stop.

On SIGTERM or Ctrl-C uvicorn stops accepting and then waits for open responses to end;
streams would run to completion first. The signal therefore also stops the engine front,
which ends every live request with an error event at once, so nothing hangs.
"""

from __future__ import annotations

import logging
import socket

import uvicorn

from llmfast.engine import LLMEngine
from llmfast.serve.api.app import ServeConfig, build_app
from llmfast.serve.engine_loop import AsyncEngine
from llmfast.serve.switch_interval import serving_switch_interval, switch_interval

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, front: AsyncEngine) -> None:
        super().__init__(config)
        self.front = front

    def handle_exit(self, sig, frame) -> None:  # a signal handler, on the loop's thread
        if not self.should_exit:
            self.front.stop_threadsafe("the server is shutting down")
        super().handle_exit(sig, frame)


def bind(host: str, port: int) -> socket.socket:
    """Bind before the (slow) engine start, so a taken port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(engine: LLMEngine, sock: socket.socket, config: ServeConfig, *,
          access_log: bool = False, api_servers: int = 0) -> None:
    """Serve until SIGTERM / Ctrl-C. With `api_servers` = 0 the HTTP server runs in this
    process, the engine on a thread of it (uvicorn re-raises the signal after a clean
    stop); with N > 0 the engine loop runs here and N processes serve HTTP
    (engine_host.py). The GIL switch interval is Python's unless
    LLMFAST_SWITCH_INTERVAL_MS sets another for the server's life (switch_interval.py)."""
    with switch_interval(serving_switch_interval()):
        if api_servers > 0:
            from llmfast.serve.engine_host import serve_with_api_processes

            serve_with_api_processes(engine, sock, config, api_servers,
                                     access_log=access_log)
            return
        front = AsyncEngine(engine)
        app = build_app(front, config)
        uv_config = uvicorn.Config(app, log_level="info", access_log=access_log,
                                   timeout_graceful_shutdown=10, lifespan="on")
        _Server(uv_config, front).run(sockets=[sock])
