"""Compile the Triton variants a start-up will launch, in threads, before it launches them.

A cold start compiles ~6 variants of llmfast's kernels (the norms, RoPE + KV write, the
attention kernels: `TritonCompileWatch` lists them), each the first time a launch needs
it: the memory profile's forward, then the graph captures, one after another on the
start's critical path (on an H100 machine an attention variant took ~1.9 s).

`KernelPrecompiler.dry_launches()` runs a stretch of work (the runner's dry forwards:
worker/startup/kernel_precompile.py) in which every launch of llmfast's kernels submits its
variant's compilation to a thread pool instead of running: no kernel runs, outputs are
left as allocated. It uses Triton's asynchronous compile mode
(`triton.runtime._async_compile`): under it `kernel.warmup(...)` binds the arguments as a
launch would, submits the variant's compile (once per variant) and returns. `wait()`
joins the compiles and finalizes each: the compiled kernel goes into the kernel's cache,
where the real launch later finds it.

Threads, not processes: Triton's compiler releases the GIL for much of its work (its
passes, ptxas), and a variant compiled in this process lands in the cache the launch
reads. A variant a dry launch compiled that no real launch takes costs a worker's time,
nothing else; a real launch of a variant no dry launch compiled compiles it as before.
Where Triton has no asynchronous mode, `available` is False and nothing is precompiled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

logger = logging.getLogger(__name__)

# The precompiler whose dry launches are running (set by `dry_launches`), else None. Read
# by every launch of llmfast's kernels: a module global is the cheapest check.
ACTIVE: KernelPrecompiler | None = None


def _async_compile_module():
    try:
        from triton.runtime import _async_compile
    except ImportError:
        return None
    if not hasattr(_async_compile, "AsyncCompileMode") or not hasattr(
            _async_compile, "active_mode"):
        return None
    return _async_compile


def kernel_precompile_enabled() -> bool:
    """`LLMFAST_KERNEL_PRECOMPILE=0` turns the start-up's precompile off (A/B timing)."""
    return os.environ.get("LLMFAST_KERNEL_PRECOMPILE", "1") != "0"


def default_workers() -> int:
    """Threads for the compiles: a start-up has ~6 variants to compile, and the start
    waits for them (its own thread idle)."""
    return max(1, min(8, os.cpu_count() or 2))


class KernelPrecompiler:
    """See the module docstring. One per start-up: dry launches, then `wait()`."""

    def __init__(self, max_workers: int | None = None) -> None:
        self._module = _async_compile_module()
        self.available = self._module is not None
        self._executor: ThreadPoolExecutor | None = None
        self._mode: Any = None
        if self.available:
            _serialize_triton_parsing()
            self._executor = ThreadPoolExecutor(max_workers or default_workers(),
                                                thread_name_prefix="llmfast-triton-compile")
            # ignore_errors: a variant that fails to compile raises where it is launched
            # (as it would have compiled there), not in the dry launch.
            self._mode = self._module.AsyncCompileMode(self._executor, ignore_errors=True)
        self.dry_launch_count = 0
        self.launchers_built = 0  # by `wait` (Triton 3.6 on CUDA: see _build_launcher)
        self._seen: set = set()  # _variant_key of each launch submitted
        self._kernels: dict[int, Any] = {}  # the JITFunctions submitted to, by id

    @property
    def num_submitted(self) -> int:
        """Distinct variants whose compile was submitted (the mode dedups them)."""
        return len(self._mode.future_kernels) if self._mode is not None else 0

    @contextlib.contextmanager
    def dry_launches(self) -> Iterator[KernelPrecompiler]:
        """Within: launches of llmfast's kernels submit compiles instead of running."""
        global ACTIVE
        if not self.available:
            yield self
            return
        if ACTIVE is not None or self._module.active_mode.get() is not None:
            raise RuntimeError("dry launches are already running")
        token = self._module.active_mode.set(self._mode)
        ACTIVE = self
        try:
            yield self
        finally:
            ACTIVE = None
            self._module.active_mode.reset(token)

    def submit(self, kernel: Any, grid: Sequence[int], args: Sequence[Any],
               kwargs: Mapping[str, Any]) -> None:
        """What a launch `kernel[grid](*args, **kwargs)` does while dry: Triton binds the
        arguments and submits the variant's compile (a known variant: nothing). An
        interpreted kernel has nothing to compile: skipped."""
        import triton

        self.dry_launch_count += 1
        if not isinstance(kernel, triton.runtime.JITFunction):
            return
        seen = _variant_key(kernel, args, kwargs)
        if seen is not None:
            if seen in self._seen:  # every layer repeats its launches: bind them once
                return
            self._seen.add(seen)
        self._kernels[id(kernel)] = kernel
        kernel.warmup(*args, grid=tuple(grid), **kwargs)

    def wait(self) -> float:
        """Join the compiles, each finalized into its kernel's cache (a failure is left to
        its launch, which compiles it again and raises), and build their launchers;
        returns the seconds waited. The pool is shut down: the precompiler is spent."""
        if self._executor is None:
            return 0.0
        start = time.perf_counter()
        try:
            launcher_cls = _launcher_class()
            builds = []
            # Each variant's launcher, built in the pool as soon as its compile is done;
            # a failed compile said.
            for compiled in as_completed(list(self._mode.raw_futures)):
                if compiled.exception() is not None:
                    logger.warning("a Triton variant failed to compile in its thread (%s); "
                                   "its first launch compiles it",
                                   _root_cause(compiled.exception()))
                elif launcher_cls is not None:
                    builds.append(self._executor.submit(_build_launcher, launcher_cls,
                                                        compiled.result()))
            for future in list(self._mode.future_kernels.values()):
                future.result(ignore_errors=True)
            self.launchers_built = sum(build.result() for build in builds)
        finally:
            self._executor.shutdown(wait=True)
            self._executor = None
            self._forget_failed()
        return time.perf_counter() - start

    def _forget_failed(self) -> None:
        """Triton 3.7 puts each submitted compile's FutureKernel in the kernel's cache
        at once; one whose compile failed would stay there, and its launch re-raise the
        thread's error instead of compiling: dropped, so that the launch compiles."""
        future_cls = getattr(self._module, "FutureKernel", None)
        if future_cls is None:
            return
        for kernel in self._kernels.values():
            for caches in kernel.device_caches.values():
                cache = caches[0]
                for key, value in list(cache.items()):
                    if (isinstance(value, future_cls) and value.kernel is None
                            and value.future.exception() is not None):
                        del cache[key]


_PARSE_LOCK = threading.Lock()


def _serialize_triton_parsing() -> None:
    """Make Triton parse its kernels' source one thread at a time, from now on in this
    process (idempotent). CPython 3.11's `ast.parse` is not thread-safe: two threads
    converting ASTs at once can fail with "SystemError: AST constructor recursion depth
    mismatch" (CPython gh-106905), and the compile threads each parse every @triton.jit
    function they reach (`JITCallable.parse`: CI dry run 45 lost a variant's threaded
    compile to it). Parsing is milliseconds; the compiles' back ends still run side by
    side."""
    from triton.runtime import jit

    owner = next((cls for cls in type.mro(jit.JITFunction) if "parse" in vars(cls)), None)
    if owner is None or getattr(owner.parse, "_llmfast_serialized", False):
        return
    parse = owner.parse

    def serialized_parse(self):
        with _PARSE_LOCK:
            return parse(self)

    serialized_parse._llmfast_serialized = True
    owner.parse = serialized_parse


def _root_cause(exc: BaseException) -> str:
    """`Type: message` of the innermost exception `exc` was raised from: Triton wraps a
    nested function's error in a CompilationError at each call site, which shows where,
    not what."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"


def _launcher_class() -> Any:
    """The active Triton driver's launcher class (`CompiledKernel._init_handles` makes
    one per variant at its first launch), or None (a driver without one: the sm_90
    stand-in)."""
    from triton.runtime.driver import driver

    try:
        return getattr(driver.active, "launcher_cls", None)
    except Exception:  # noqa: BLE001 - no driver: nothing to build
        return None


def _build_launcher(launcher_cls: Any, compiled: Any) -> bool:
    """Make `compiled`'s launcher once, here, so that its first launch finds it built.
    On Triton 3.6 a CUDA launcher is C generated per kernel signature and built by the
    C compiler (~0.25 s each, cached on disk by its source), at the first launch, in the
    launching thread: one after another on the start's critical path. Building it here
    fills that cache; the launch then only loads it. (Triton 3.7's launcher is generic:
    nothing to build.) No CUDA call is made. Returns whether it was built."""
    try:
        launcher_cls(compiled.src, compiled.metadata)
    except Exception as exc:  # noqa: BLE001 - the launch builds it again, and reports
        logger.debug("could not build a launcher ahead of its launch: %s", exc)
        return False
    return True


def _variant_key(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple | None:
    """At least as fine as what Triton keys a variant by: per tensor its dtype and
    16-byte alignment, per int whether it is 1, divisible by 16 and its width, other
    arguments by value (floats by type), the keywords (constexprs, options) by value;
    None when something is unhashable (then: no dedup)."""
    import torch

    key: list[Any] = [id(kernel)]
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif type(a) is int:
            key.append((a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a < 2**63))
        elif type(a) is float:
            key.append(float)
        else:
            key.append(a)
    key.append(tuple(sorted(kwargs.items())))
    try:
        hash(tuple(key))
    except TypeError:
        return None
    return tuple(key)

