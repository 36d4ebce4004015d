"""Triton's offline sm_90 target for the CPU tests of what compiles where."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

import pytest
import triton

from llmfast.kernels.launch.offline_target import offline_hopper


@contextlib.contextmanager
def fresh_offline_variants(kernels: Iterable) -> Iterator[list[tuple]]:
    """Within: Triton compiles for sm_90, launches recorded (the list yielded), and the
    JIT `kernels`' compiled variants are forgotten (restored after), so the compiles
    seen are the caller's own."""
    saved = {k: dict(k.device_caches) for k in kernels}
    for kernel in saved:
        kernel.device_caches.clear()
    try:
        with offline_hopper(record_launches=True) as launches:
            yield launches
    finally:
        for kernel, caches in saved.items():
            kernel.device_caches.clear()
            kernel.device_caches.update(caches)


def record_compiling_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads in which Triton compiles a variant from now on (the list
    grows as compiles happen)."""
    compiling_threads: list[str] = []
    compile = triton.compiler.compile  # what a kernel's binder imports when made

    def recording_compile(*args, **kwargs):
        compiling_threads.append(threading.current_thread().name)
        return compile(*args, **kwargs)

    monkeypatch.setattr(triton.compiler, "compile", recording_compile)
    return compiling_threads
