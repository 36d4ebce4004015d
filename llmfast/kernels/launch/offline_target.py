"""Triton's real compile and launch path for an H100 on a machine without a GPU.

Two uses, both on CPU: checking that the kernels compile for sm_90 (PTX, cubin, shared
memory within the H100's limit) and timing the *host* side of a launch, i.e. everything
Triton and llmfast do in Python before the driver call. `offline_hopper()` makes Triton
target sm_90 through a stand-in driver; with `record_launches` the compiled kernels'
launchers are replaced by a recorder (nothing is loaded onto a device): each launch
appends its arguments to the returned list, which stands in for the C launcher.

No kernel runs; the interpreter (TRITON_INTERPRET=1) checks the numerics instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import triton
from triton.compiler import CompiledKernel


class HopperStandInDriver(triton.backends.driver.DriverBase):
    """Makes Triton compile for sm_90 on a machine without a GPU."""

    @classmethod
    def is_active(cls):
        return True

    def get_current_target(self):
        return triton.backends.compiler.GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return None

    def get_benchmarker(self):
        return None

    def map_python_to_cpp_type(self, ty):
        return ty


# The lists of the offline_hopper(record_launches=True) contexts now open, innermost last.
# A compiled kernel outlives a context (Triton's JIT keeps it): its stand-in launcher
# records into whichever context is open when it runs, not the one it was loaded in.
_RECORDINGS: list[list[tuple]] = []


def _record(*args) -> None:
    if not _RECORDINGS:
        raise RuntimeError("a kernel compiled offline was launched outside "
                           "offline_hopper(record_launches=True)")
    _RECORDINGS[-1].append(args)


@contextlib.contextmanager
def offline_hopper(record_launches: bool = False,
                   launcher: Callable[[list[tuple]], Any] | None = None
                   ) -> Iterator[list[tuple]]:
    """Within: Triton compiles for sm_90; with `record_launches`, launches are recorded
    (the list yielded) instead of failing for want of a device. `launcher(launches)`:
    what a compiled kernel's launcher is instead of the recorder (e.g. Triton's own
    CudaLauncher with the C launch below it recording into `launches`)."""
    from triton.runtime.driver import driver

    launches: list[tuple] = []
    init_handles = CompiledKernel._init_handles

    def stand_in_handles(self):
        if self.module is not None:
            return
        self.module, self.function = "offline", id(self)  # any non-null handle
        self._run = _record if launcher is None else launcher(launches)

    previous = driver._active  # `driver.active` would try to create a real driver
    driver.set_active(HopperStandInDriver())
    if record_launches:
        CompiledKernel._init_handles = stand_in_handles
        _RECORDINGS.append(launches)
    try:
        yield launches
    finally:
        if record_launches:
            _RECORDINGS.remove(launches)
        CompiledKernel._init_handles = init_handles
        driver._active = previous
