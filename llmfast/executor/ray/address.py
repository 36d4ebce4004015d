"""`--ray-address` checked before Ray is asked to connect: with nothing listening there,
`ray.init` retries for minutes (more than five measured with Ray 2.60 on an unused port)
before it gives up, so a wrong address would look like a hang."""

from __future__ import annotations

import socket

# Ray's defaults where an address names no port: the GCS, or the Ray Client server.
GCS_PORT, CLIENT_PORT = 6379, 10001
PROBE_TIMEOUT_S = 5.0


def unreachable_reason(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why nothing can be reached at `address` (`host:port`, `ray://host:port`), or None
    when something accepts a connection there, or when Ray resolves the address itself
    (`auto`, `local`: a cluster found on this machine)."""
    if address in ("auto", "local"):
        return None
    hostport, default_port = address, GCS_PORT
    if "://" in address:
        scheme, hostport = address.split("://", 1)
        default_port = CLIENT_PORT if scheme == "ray" else GCS_PORT
    host, sep, port = hostport.rpartition(":")
    if not sep or "]" in port:  # no port, or an IPv6 literal without one
        host, port = hostport, str(default_port)
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"cannot read {address!r} as host:port"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as e:
        return f"nothing answers at {host}:{port} ({e.strerror or e})"
