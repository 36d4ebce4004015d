"""Processes as /proc shows them (Linux): a process's children, whether a pid is alive,
the worker processes that carry a marker in their environment (inherited from the
process that started them, so orphans reparented elsewhere are found too), and how many
read system calls a process has made."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # after "pid (comm) "


def is_alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, counts as gone)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def children(pid: int | None = None) -> set[int]:
    """Live child processes of `pid` (this process by default)."""
    pid = os.getpid() if pid is None else pid
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None and fields[0] != "Z" and int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


def with_marker(name: str, value: str) -> set[int]:
    """Live processes whose environment has `name=value`."""
    needle = f"{name}={value}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in env and is_alive(int(entry.name)):
            found.add(int(entry.name))
    return found


def wait_until_gone(pids, timeout_s: float) -> set[int]:
    """Wait up to `timeout_s` for every pid to end; those still alive."""
    deadline = time.monotonic() + timeout_s
    alive = {p for p in pids if is_alive(p)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = {p for p in alive if is_alive(p)}
    return alive


def read_syscalls(pid: int) -> int:
    """How many read-family system calls (read, readv, pread) the process has made so far
    (the kernel's count, /proc/PID/io `syscr`; socket recv/recvmsg calls are not in it)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "syscr":
            return int(value)
    raise RuntimeError(f"/proc/{pid}/io has no syscr line")
