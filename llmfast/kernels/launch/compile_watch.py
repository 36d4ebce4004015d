"""Which Triton kernels a stretch of work had to specialize, and how long each took.

A kernel variant that start-up did not compile costs the first step that needs it
~1-2 s (its compilation, or a load from Triton's disk cache when an earlier process
compiled it), and a benchmark that times such a step measures the compiler. On an H100
(2026-11-26) mixed steps of 2-16 requests each took 1.9 s that way while a split count
was a constexpr (attention/triton/kernels.py). `TritonCompileWatch` makes that visible:
the benchmarks run their timed part inside one and report what it saw.

It uses Triton's process-wide JIT hooks (`triton.knobs.runtime.jit_cache_hook`, called
before a variant not in the process's kernel cache is compiled or loaded, and
`jit_post_compile_hook`, after), chaining any hooks already set and restoring them on
exit. It counts the compiles of the thread that entered it, the one doing the watched
work (a launch compiles in its own thread): the hooks are process-wide, and a compile
another thread happens to run meanwhile is not that work's. Watches nest within a
thread; watches of two threads must not overlap (each saves the hooks it finds and puts
them back on exit, so the first to exit would unhook the other). llmfast's (the
start-up's, the benchmarks' timed runs) are in the engine's thread, one at a time.
Inductor's own kernels do not go through these hooks: they are compiled before the CUDA
graphs are captured. Where Triton has no such hooks the watch sees nothing and
says so (`available`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import triton


@dataclass(frozen=True)
class KernelCompile:
    name: str  # the @triton.jit function's name
    seconds: float  # compile, or load from Triton's disk cache


@dataclass
class TritonCompileWatch:
    compiles: list[KernelCompile] = field(default_factory=list)
    available: bool = False
    _previous: tuple[Any, Any] | None = None
    _started: dict[str, float] = field(default_factory=dict)
    _thread: int | None = None  # the ident of the thread watched

    def __enter__(self) -> TritonCompileWatch:
        runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return self
        self.available = True
        self._thread = threading.get_ident()
        self._previous = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        previous_before, previous_after = self._previous

        def before(**kwargs: Any) -> Any:
            if threading.get_ident() == self._thread:
                self._started[kwargs["repr"]] = time.perf_counter()
            return previous_before(**kwargs) if previous_before else None

        def after(**kwargs: Any) -> Any:
            started = (self._started.pop(kwargs["repr"], None)
                       if threading.get_ident() == self._thread else None)
            if started is not None:
                self.compiles.append(
                    KernelCompile(kwargs["fn"].name, time.perf_counter() - started))
            return previous_after(**kwargs) if previous_after else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            runtime = triton.knobs.runtime
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = self._previous
            self._previous = None

    @property
    def seconds(self) -> float:
        return sum(c.seconds for c in self.compiles)

    def summary(self) -> dict[str, Any]:
        """For a benchmark's JSON: how many variants, their seconds, by kernel."""
        by_kernel: dict[str, int] = {}
        for c in self.compiles:
            by_kernel[c.name] = by_kernel.get(c.name, 0) + 1
        return {"watched": self.available, "count": len(self.compiles),
                "seconds": round(self.seconds, 3), "by_kernel": by_kernel}
