"""How much host memory is free now (what the loader and the KV-cache sizing check
their allocations against)."""

from __future__ import annotations

import os


def available_host_memory() -> int:
    """Bytes the kernel reports as available (MemAvailable), else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
