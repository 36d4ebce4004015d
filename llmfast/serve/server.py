"""`llmfast serve` from a resolved model to a running server: bind, start the engine core's
process, build what a frontend needs, run the frontends (launcher.py)."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from llmfast.serve.api.app import ServeConfig
from llmfast.serve.switch_interval import serving_switch_interval, switch_interval

logger = logging.getLogger(__name__)


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


def start_core(config, source):
    """The engine core's process, started and ready (ServerStopped if its start failed)."""
    from llmfast.serve.launcher import CoreHandle

    return CoreHandle(config, source, logging.getLogger().getEffectiveLevel())


def frontend_spec(core, config, source, model_name: str, tool_call_parser: str | None = None):
    """What every frontend of this server starts from (its own tokenizer loaded here)."""
    from llmfast.engine.processing.tokenizer import load_frontend_tokenizer
    from llmfast.serve.frontend import FrontendSpec, api_limits

    tokens = load_frontend_tokenizer(config, source)
    return FrontendSpec(model_name, api_limits(config, tokens, tool_call_parser),
                        core.ready.limits, tokens,
                        core.ready.stats, core.input_address, core.output_address, core.pid)


def serve(core, config, source, sock: socket.socket, serve_config: ServeConfig, *,
          access_log: bool = True, api_servers: int = 0,
          on_ready: Callable[[], None] | None = None) -> None:
    """Serve until SIGTERM / Ctrl-C (then end by that signal) or a fault (ServerStopped);
    `on_ready` runs once the server accepts requests.
    With `api_servers` = 0 the frontend runs in this process; with N > 0 in N processes
    of their own. The GIL switch interval is Python's unless LLMFAST_SWITCH_INTERVAL_MS
    sets another for the server's life (switch_interval.py)."""
    from llmfast.serve.launcher import serve_in_process, serve_with_api_processes

    try:
        spec = frontend_spec(core, config, source, serve_config.model_name,
                             serve_config.tool_call_parser)
    except BaseException:
        core.stop()
        raise
    with switch_interval(serving_switch_interval()):
        if api_servers > 0:
            serve_with_api_processes(core, spec, sock, serve_config, api_servers,
                                     access_log=access_log, on_ready=on_ready)
        else:
            serve_in_process(core, spec, sock, serve_config, access_log=access_log,
                             on_ready=on_ready)
