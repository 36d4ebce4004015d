"""A cheaper launch path for Triton kernels: compiled kernel per specialization, bound once.

`kernel[grid](*args, **constexprs)` goes through Triton's JIT dispatch on every call: it
re-binds the keyword arguments, parses the compile options, builds a cache key string,
checks the kernel's globals and builds launch metadata for the (usually empty) launch
hooks. The attention launch does that with ~40 arguments per layer per step.

`LaunchCache` does it once per *specialization* and then calls the compiled kernel's
launcher directly. A specialization is everything Triton compiles differently for:
the constexpr values and compile options (given by the caller as a hashable tuple), and
per runtime argument what Triton's JIT specializes on. That last part is reproduced here
as a key that is at least as fine as Triton's (a finer key only costs an extra entry):
- tensors: dtype and whether the address is 16-byte aligned;
- ints: == 1, divisible by 16, and the integer type Triton picks (i32/i64/u64);
- floats: nothing (always fp32 scalars).

Building that key still reads every tensor's dtype and address and classifies every
scalar (~2 us for the attention launch). A caller that keeps a plan per shape, with every
tensor dtype and scalar that Triton specializes on in the plan's own key (the attention
and KV-write launches), uses `launch_planned` instead: per call it reads only the tensors'
addresses (for their alignment) and looks up (plan, device, alignment); the plan's first
launch of each goes through `launch` and the key above.

`launch_planned` hands the launcher those addresses as integers, not the tensors. Given
a tensor, Triton's C launcher calls its `data_ptr()` and then asks the CUDA driver
whether the address is device memory (`cuPointerGetAttribute`), per tensor and launch
(11 tensors for the attention kernel, 16 for the fused decode + RoPE one); given an
integer it takes it as the address. The check it skips is a plan's to make: a plan is
per device, and its first launch (through the JIT, with the tensors) is checked.

The launcher itself (`CompiledKernel.run(grid_x, grid_y, grid_z, stream, function,
packed_metadata, launch_metadata, enter_hook, exit_hook, *args)`, every parameter of the
kernel in order, constexprs included) has the same signature in Triton 3.6 and 3.7. When
anything differs from that contract (an interpreted kernel, a compiled kernel without
those attributes, launch hooks registered by a profiler, pre-run hooks), every call takes
the ordinary JIT path instead: slower, never wrong. `LLMFAST_TRITON_FAST_LAUNCH=0` (read
at the first launch) or `cache.enabled = False` forces the JIT path (for A/B timing).

Below that launcher, one more layer is skipped where it is known: Triton's
`CudaLauncher.__call__` is Python (it builds two closures to allocate scratch memory,
then forwards every argument to the C `launch` of the driver's module), ~0.8 us per call
on the 2-core CPU VM. For a kernel that needs no scratch, its C `launch` is called
directly with what `__call__` would pass (`_direct_form`): one argument layout for
Triton 3.6 (a per-kernel launcher module, the arguments spread) and one for 3.7 (a
generic launcher: argument annotations, the signature, the arguments as one tuple).
Any other Triton, or a launcher that is not `CudaLauncher`, keeps the `__call__` path.
`cache.direct_launch = False` (or LLMFAST_TRITON_FAST_LAUNCH=0) turns it off.

While a start-up's dry launches run (launch/precompile.py), both methods submit the
variant's compile instead of launching.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import types
from collections.abc import Hashable, Sequence
from typing import Any

import torch
import triton
from triton.runtime.driver import driver as _driver  # the active driver, as the JIT uses

from llmfast.kernels.launch import precompile

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# Bound once: each is read per launch (an import statement in the launch cost ~1 us).
_RUNTIME_KNOBS = getattr(getattr(triton, "knobs", None), "runtime", None)
_data_ptr = torch.Tensor.data_ptr
_gcd = math.gcd


def fast_launch_enabled() -> bool:
    return os.environ.get("LLMFAST_TRITON_FAST_LAUNCH", "1") != "0"


def specialization_key(tensors: Sequence[torch.Tensor], scalars: Sequence[Any]) -> tuple | None:
    """What Triton's JIT would specialize on for these runtime arguments (or finer);
    None when a scalar is of a kind this key does not model (then: the JIT path).

    E.g. tensors (bf16 at 0x...40, bf16 at 0x...42), scalars (4096, 1, 17, 0.5) ->
    ((bf16, bf16), (True, False), ((False, True, 0), (True, False, 0), (False, False, 0),
    float))."""
    key = []
    for s in scalars:
        kind = type(s)
        if kind is int or kind is bool:
            width = 0 if _INT32_MIN <= s <= _INT32_MAX else 1 if s < 2**63 else 2
            key.append((s == 1, s % 16 == 0, width))  # width: i32 / i64 / u64
        elif kind is float:
            key.append(float)
        else:
            return None
    return (tuple([t.dtype for t in tensors]),
            tuple([t.data_ptr() % 16 == 0 for t in tensors]), tuple(key))


def _hooks_registered() -> bool:
    runtime = _RUNTIME_KNOBS
    if runtime is None:
        return True  # an unknown Triton: do not bypass whatever it does
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):  # HookChain: empty is off
            return True
    return False


# Argument layouts of the C launch under CudaLauncher.__call__ (module docstring).
_SPREAD = 1  # Triton 3.6: launch(gx, gy, gz, stream, function, coop, pdl, global_scratch,
# profile_scratch, kernel_metadata, launch_metadata, enter_hook, exit_hook, *kernel_args)
_PACKED = 2  # Triton 3.7: launch(gx, gy, gz, stream, function, coop, pdl, kernel_metadata,
# launch_metadata, enter_hook, exit_hook, global_scratch, profile_scratch,
# arg_annotations, kernel_signature, kernel_args)
_CALL_36 = ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")
_CALL_37 = ("self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata",
            "launch_metadata", "launch_enter_hook", "launch_exit_hook", "args")


def _direct_form(launcher: Any) -> tuple | None:
    """(C launch, layout, cooperative grid, PDL, arg annotations, kernel signature) when
    `launcher` is a Triton CudaLauncher whose `__call__` this module knows and whose
    kernel needs no scratch memory; else None (the launcher is called as it is)."""
    cls = type(launcher)
    if cls.__name__ != "CudaLauncher" or not cls.__module__.startswith("triton.backends"):
        return None
    launch = getattr(launcher, "launch", None)
    # A Python function is Triton's wrapper for tensor-descriptor arguments, not the C
    # launch.
    if launch is None or isinstance(launch, types.FunctionType):
        return None
    if (getattr(launcher, "global_scratch_size", 1) != 0
            or getattr(launcher, "profile_scratch_size", 1) != 0):
        return None
    code = getattr(cls.__call__, "__code__", None)
    if code is None or not code.co_flags & inspect.CO_VARARGS:
        return None
    params = code.co_varnames[:code.co_argcount + 1]  # (+1: the *args)
    coop = getattr(launcher, "launch_cooperative_grid", None)
    pdl = getattr(launcher, "launch_pdl", None)
    if coop is None or pdl is None:
        return None
    module = sys.modules.get(cls.__module__)
    if params == _CALL_36 and getattr(module, "_BASE_ARGS_FORMAT", None) == "iiiKKppOOOOOO":
        return (launch, _SPREAD, coop, pdl, None, None)
    annotations = getattr(launcher, "arg_annotations", None)
    signature = getattr(launcher, "kernel_signature", None)
    if params == _CALL_37 and annotations is not None and signature is not None:
        return (launch, _PACKED, coop, pdl, annotations, signature)
    return None


def _launcher_of(compiled: Any):
    """compiled.run when it looks like the launcher contract above, else None."""
    if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
        return None
    try:
        return compiled.run  # loads the module on first use (may raise without a GPU)
    except Exception:  # noqa: BLE001 - any failure here means: use the JIT path
        return None


class LaunchCache:
    """kernel launches keyed by specialization; see the module docstring.

    `launch(grid, tensors, scalars, const_key, constexprs, fixed)`: the kernel's runtime
    parameters in order, tensors first, then scalars, then `fixed` scalars (all
    constexprs after them); `const_key` must determine the specialization of `fixed`
    (e.g. strides that are part of the caller's own cache key),
    `constexprs` the constexpr parameters and compile options as keywords (num_warps,
    num_stages), `const_key` a hashable stand-in for `constexprs` the caller already has
    (e.g. its frozen config plus the shape constants), so no dict is hashed per call.

    `launch_planned(plan, ...)`: the same launch for a caller that keeps a plan per shape
    (attention, KV write): per call only the tensors' addresses are looked at.
    """

    def __init__(self, kernel, max_planned: int = 1024):
        self.kernel = kernel
        self.compiled_launches = 0  # misses: JIT path taken and its kernel remembered
        self.fast_launches = 0
        names = [p.name for p in getattr(kernel, "params", [])]
        self._param_names = names
        # (device, const_key, spec) -> (launcher, function, packed metadata, constexpr
        # values in order, direct form: `_direct_form`)
        self._entries: dict[Hashable, tuple] = {}
        # (plan, device, alignment) -> (launcher, function, packed metadata, fixed + tail,
        # direct form)
        self._planned: dict[Hashable, tuple] = {}
        self.max_planned = max_planned
        self._interpreted = not isinstance(kernel, triton.runtime.JITFunction)
        self.enabled: bool | None = None  # from the environment at the first launch
        # launch_planned passes the tensors' addresses (False: the tensors, for timing
        # what the launcher's own pointer checks cost: bench_kernels.py).
        self.raw_pointers = True
        # Calls the C launch under Triton's CudaLauncher directly where it is known
        # (module docstring; False: through CudaLauncher.__call__, for timing).
        self.direct_launch = True

    def _jit_only(self) -> bool:
        """Whether this launch must take Triton's JIT path (see the module docstring)."""
        if self.enabled is None:
            self.enabled = fast_launch_enabled()
        return (self._interpreted or not self.enabled
                or bool(getattr(self.kernel, "pre_run_hooks", True)))

    def launch(self, grid: tuple[int, int, int], tensors: tuple[torch.Tensor, ...],
               scalars: tuple[Any, ...], const_key: Hashable, constexprs: dict[str, Any],
               fixed: tuple[Any, ...] = ()) -> None:
        args = tensors + scalars + fixed
        if precompile.ACTIVE is not None:  # a dry launch: compile, do not run
            precompile.ACTIVE.submit(self.kernel, grid, args, constexprs)
            return
        if self._jit_only():
            self.kernel[grid](*args, **constexprs)
            return
        spec = specialization_key(tensors, scalars)
        if spec is None or _hooks_registered():
            self.kernel[grid](*args, **constexprs)
            return
        device = _driver.active.get_current_device()
        key = (device, const_key, spec)
        entry = self._entries.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **constexprs)
            self.compiled_launches += 1
            launcher = _launcher_of(compiled)
            if launcher is not None:
                tail = tuple(constexprs[n] for n in self._param_names[len(args):])
                self._entries[key] = (launcher, compiled.function, compiled.packed_metadata,
                                      tail, _direct_form(launcher))
            return
        launcher, function, packed_metadata, tail, direct = entry
        self._call(launcher, direct, grid, _driver.active.get_current_stream(device), function,
                   packed_metadata, (*args, *tail))

    def _call(self, launcher, direct, grid, stream, function, packed_metadata, args) -> None:
        """One launch: the C launch under the launcher where `direct` knows it, else
        the launcher (CudaLauncher.__call__), with the kernel's arguments `args`."""
        if direct is None or not self.direct_launch:
            launcher(grid[0], grid[1], grid[2], stream, function, packed_metadata, None, None,
                     None, *args)
        elif direct[1] == _SPREAD:
            direct[0](grid[0], grid[1], grid[2], stream, function, direct[2], direct[3], None,
                      None, packed_metadata, None, None, None, *args)
        else:
            direct[0](grid[0], grid[1], grid[2], stream, function, direct[2], direct[3],
                      packed_metadata, None, None, None, None, None, direct[4], direct[5], args)
        self.fast_launches += 1

    def launch_planned(self, plan: Hashable, grid: tuple[int, int, int],
                       tensors: tuple[torch.Tensor, ...], scalars: tuple[Any, ...],
                       const_key: Hashable, constexprs: dict[str, Any],
                       fixed: tuple[Any, ...] = ()) -> None:
        """`launch(grid, tensors, scalars, const_key, constexprs, fixed)` for a caller
        whose `plan` (hashable by identity, kept by the caller per shape and device)
        determines everything of the specialization but the tensors' addresses: their
        dtypes, the scalars' specialization, `const_key`, `constexprs` and `fixed`. The
        first launch of a (plan, device, alignment) takes `launch`; later ones only read
        the tensors' addresses, the device and the stream before calling the launcher,
        and pass it the addresses (see the module docstring)."""
        if precompile.ACTIVE is not None:  # a dry launch: compile, do not run
            precompile.ACTIVE.submit(self.kernel, grid, (*tensors, *scalars, *fixed),
                                     constexprs)
            return
        if self._jit_only() or _hooks_registered():
            self.kernel[grid](*tensors, *scalars, *fixed, **constexprs)
            return
        addresses = tuple(map(_data_ptr, tensors))
        # Triton specializes a tensor on 16-byte alignment: all aligned (the usual case:
        # 16 divides their gcd) is one key, any other mix its own.
        aligned = (True if not _gcd(*addresses) & 15
                   else tuple([address % 16 == 0 for address in addresses]))
        active = _driver.active
        device = active.get_current_device()
        entry = self._planned.get((plan, device, aligned))
        if entry is None:
            self._plan_launch(plan, device, aligned, grid, tensors, scalars, const_key,
                              constexprs, fixed)
            return
        launcher, function, packed_metadata, fixed_tail, direct = entry
        self._call(launcher, direct, grid, active.get_current_stream(device), function,
                   packed_metadata,
                   (*(addresses if self.raw_pointers else tensors), *scalars, *fixed_tail))

    def _plan_launch(self, plan, device, aligned, grid, tensors, scalars, const_key,
                     constexprs, fixed) -> None:
        """A (plan, device, alignment)'s first launch: through `launch`, then its entry."""
        self.launch(grid, tensors, scalars, const_key, constexprs, fixed)
        spec = specialization_key(tensors, scalars)
        found = self._entries.get((device, const_key, spec))
        if found is not None:
            if len(self._planned) >= self.max_planned:
                del self._planned[next(iter(self._planned))]
            launcher, function, packed_metadata, tail, direct = found
            self._planned[(plan, device, aligned)] = (launcher, function, packed_metadata,
                                                      fixed + tail, direct)


class PlanCache(dict):
    """Launch plans by shape key (attention, KV write, RoPE + KV write). A process sees a
    handful of shapes per model (padded batch sizes x prefill/decode), tests and
    benchmarks many: bounded, oldest dropped. Lookups are the dict's own `get`."""

    def __init__(self, limit: int = 256) -> None:
        super().__init__()
        self.limit = limit

    def add(self, key: Hashable, plan: Any) -> Any:
        if len(self) >= self.limit:
            del self[next(iter(self))]
        self[key] = plan
        return plan
