"""A free TCP port on this machine, for a rendezvous or a server started next."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on `host` (the OS picks it; the caller binds it a moment later,
    so another process could take it in between: unlikely, and then the start fails
    loudly rather than hangs)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
