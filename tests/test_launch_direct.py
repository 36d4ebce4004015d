"""The cached launch's direct call of the C launch under Triton's CudaLauncher
(kernels/launch/launch_cache.py `_direct_form`).

The oracle is Triton's own `CudaLauncher.__call__`: the installed Triton's class (3.7 on
the CPU machines), built without its C module, whose C launch is replaced by a recorder.
Triton compiles for sm_90 on this CPU (kernels/launch/offline_target.py); a launch through
`__call__` (the JIT's, and the cached path with `direct_launch` off) and a direct one must
hand the C launch the same arguments. Triton 3.6's layout (the GPU machine's) is checked
against a transcription of its `__call__` here and, for real, by scripts/gpu_check.py's
kernels step (max abs difference against SDPA) on the device.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import triton
import triton.language as tl

from llmfast.kernels.launch import launch_cache
from llmfast.kernels.launch.launch_cache import LaunchCache, _direct_form
from llmfast.kernels.launch.offline_target import offline_hopper

cuda_driver = pytest.importorskip("triton.backends.nvidia.driver")


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * factor, mask=mask)


pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not isinstance(_scale_kernel, triton.runtime.JITFunction),
    reason="offline sm_90 compile: CPU machine, triton imported without TRITON_INTERPRET",
)


class _CLaunchRecorder:
    """Stands in for the C `launch` under a CudaLauncher: records what it is given."""

    def __init__(self, launches: list[tuple]) -> None:
        self.launches = launches

    def __call__(self, *args) -> None:
        self.launches.append(args)


def _installed_cuda_launcher(launches: list[tuple]):
    """The installed Triton's CudaLauncher as its __init__ leaves it for a kernel with no
    scratch memory, but with a recording C launch (the real one needs a GPU)."""
    launcher = object.__new__(cuda_driver.CudaLauncher)
    launcher.launch = _CLaunchRecorder(launches)
    launcher.num_ctas = 1
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    launcher.launch_cooperative_grid, launcher.launch_pdl = False, True  # (told apart)
    launcher.arg_annotations = ("annotations",)  # (passed through, never read here)
    launcher.kernel_signature = b"signature"
    return launcher


def _same(a, b) -> bool:
    """Equal launch arguments: tensors by identity, tuples element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _hook_positions(launch: tuple) -> set[int]:
    """Launch metadata and the two hooks: the JIT passes its own, the cached path None."""
    return {8, 9, 10} if _direct_form_of_installed() == launch_cache._PACKED else {10, 11, 12}


def _direct_form_of_installed() -> int | None:
    form = _direct_form(_installed_cuda_launcher([]))
    return None if form is None else form[1]


def _launch_three_ways(block: int) -> list[tuple]:
    """The C launch's arguments for the JIT's launch (through CudaLauncher.__call__), a
    cached direct one, and a cached one through __call__ (direct_launch off)."""
    x, y = torch.empty(256), torch.empty(256)
    cache = LaunchCache(_scale_kernel)
    with offline_hopper(record_launches=True, launcher=_installed_cuda_launcher) as launches:
        for direct in (True, True, False):
            cache.direct_launch = direct
            cache.launch((4, 1, 1), (x, y), (200, 0.5), ("scale", block), {"BLOCK": block})
    assert cache.compiled_launches == 1 and cache.fast_launches == 2
    return launches


def test_the_installed_triton_has_a_direct_form():
    # The CPU machines' Triton (the constraints pin 3.7) is one the cached path knows: the
    # tests below would otherwise compare __call__ with itself.
    assert _direct_form_of_installed() in (launch_cache._SPREAD, launch_cache._PACKED)


def test_direct_launch_passes_what_cuda_launcher_passes():
    jit, direct, through_call = _launch_three_ways(block=64)
    assert _same(direct, through_call)
    hooks = _hook_positions(jit)
    assert len(direct) == len(jit)
    assert all(_same(a, b) for i, (a, b) in enumerate(zip(direct, jit)) if i not in hooks)
    # What the JIT passes: grid, the compiled function, and the kernel's arguments (the
    # two tensors, the scalars, the constexpr) in order.
    kernel_args = jit[-1] if isinstance(jit[-1], tuple) else jit[-5:]
    assert jit[:3] == (4, 1, 1) and _same(kernel_args[2:], (200, 0.5, 64))


def test_planned_direct_launch_passes_addresses():
    x, y = torch.empty(256), torch.empty(256)
    cache = LaunchCache(_scale_kernel)
    with offline_hopper(record_launches=True, launcher=_installed_cuda_launcher) as launches:
        for direct in (True, True, False):
            cache.direct_launch = direct
            cache.launch_planned("plan", (4, 1, 1), (x, y), (200, 0.5), ("scale", 32),
                                 {"BLOCK": 32})
    _, direct_launch, through_call = launches
    assert _same(direct_launch, through_call)
    kernel_args = (direct_launch[-1] if isinstance(direct_launch[-1], tuple)
                   else direct_launch[-5:])
    assert kernel_args[:2] == (x.data_ptr(), y.data_ptr())


def test_no_direct_form_where_the_launcher_is_not_known():
    known = _installed_cuda_launcher([])
    assert _direct_form(known) is not None
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        needs_scratch = _installed_cuda_launcher([])
        setattr(needs_scratch, scratch, 128)
        assert _direct_form(needs_scratch) is None, scratch
    wrapped = _installed_cuda_launcher([])
    wrapped.launch = lambda *args: None  # tensor descriptors: Triton's Python wrapper
    assert _direct_form(wrapped) is None
    assert _direct_form(lambda *args: None) is None  # not a CudaLauncher (the recorder)

    class CudaLauncher:  # the name, but not Triton's
        launch = known.launch
    assert _direct_form(CudaLauncher()) is None


class _Triton36Launcher:
    """A transcription of Triton 3.6's CudaLauncher.__call__ (its per-kernel C module
    takes every argument spread, the scratch pointers before the kernel metadata)."""

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = profile_scratch = None  # (no scratch: sizes 0)
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
                    self.launch_pdl, global_scratch, profile_scratch, *args)


@pytest.fixture
def triton36_module(monkeypatch):
    """A module of triton.backends holding a CudaLauncher of 3.6's form."""
    module = types.ModuleType("triton.backends.llmfast_test_v36")
    module._BASE_ARGS_FORMAT = "iiiKKppOOOOOO"
    cls = type("CudaLauncher", (_Triton36Launcher,), {"__module__": module.__name__})
    cls.__call__ = _Triton36Launcher.__call__
    module.CudaLauncher = cls
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_triton36_form_passes_what_its_call_passes(triton36_module):
    def launcher_36(launches):
        launcher = object.__new__(triton36_module.CudaLauncher)
        launcher.launch = _CLaunchRecorder(launches)
        launcher.global_scratch_size = launcher.profile_scratch_size = 0
        launcher.launch_cooperative_grid, launcher.launch_pdl = False, True
        return launcher

    assert _direct_form(launcher_36([]))[1] == launch_cache._SPREAD
    # A launcher of 3.6's form over a C module of another argument format: not known.
    triton36_module._BASE_ARGS_FORMAT = "iiiKKppOOOO"
    assert _direct_form(launcher_36([])) is None
    triton36_module._BASE_ARGS_FORMAT = "iiiKKppOOOOOO"
    x, y = torch.empty(256), torch.empty(256)
    cache = LaunchCache(_scale_kernel)
    with offline_hopper(record_launches=True, launcher=launcher_36) as launches:
        for direct in (True, True, False):
            cache.direct_launch = direct
            cache.launch((2, 1, 1), (x, y), (100, 2.0), ("scale", 128), {"BLOCK": 128})
    _, direct_launch, through_call = launches
    assert _same(direct_launch, through_call)
    assert direct_launch[5:7] == (False, True)  # cooperative grid, PDL from the launcher
    assert _same(direct_launch[-5:], (x, y, 100, 2.0, 128))  # the kernel's, spread
