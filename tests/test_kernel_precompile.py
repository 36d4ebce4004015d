"""The start-up's Triton variants compiled in threads ahead of their launches
(worker/startup/kernel_precompile.py, kernels/launch/precompile.py), on the CPU: llmfast's
Triton path forced, compiled for sm_90 offline, each launch recorded instead of run
(kernels/launch/offline_target.py). Nothing computes, so the engines' tokens mean
nothing here; what is checked is which variants get compiled where.

The oracle: Triton's own compile hook. After the dry forwards, neither the rest of the
start-up nor a workload of mixed steps may compile a variant at its launch (each finds
the one a thread compiled), and every dry launch ran nothing.
"""

from __future__ import annotations

import functools
import logging
import threading

import pytest
import torch
import triton

from llmfast.compile import CompiledModel
from llmfast.config import CudaGraphMode
from llmfast.attention.triton import launch as attention
from llmfast.attention.triton import launch_config as attention_config
from llmfast.attention.triton import kernels as attention_kernels
from llmfast.attention.triton import kv_write
from llmfast.attention import ops
from llmfast.attention.triton import rope_cache
from llmfast.kernels.launch import launch_cache, precompile
from llmfast.kernels.launch.compile_watch import TritonCompileWatch
from llmfast.kernels.launch.offline_target import offline_hopper
from llmfast.kernels.layers import kernel_choice, triton_kernels
from llmfast.attention.tuning.split_table import SplitTable
from llmfast.worker import model_runner
from llmfast.worker.startup import runner_startup
from llmfast.worker.startup.memory_profile import bind_one_block_caches, profile_batch
from tests.helpers.full_graphs import (
    arrival_workload,
    cuda_start_up_order,
    emulated_graph_engine,
    rope_in_the_op,
    run_with_arrivals,
)
from tests.helpers.offline_variants import fresh_offline_variants, record_compiling_threads

pytestmark = pytest.mark.skipif(
    precompile.KernelPrecompiler().available is False,
    reason="this Triton has no asynchronous compile mode")

KERNEL_MODULES = (attention_kernels, rope_cache, kv_write, triton_kernels)


def _jit_kernels() -> list[triton.runtime.JITFunction]:
    return [k for m in KERNEL_MODULES for k in vars(m).values()
            if isinstance(k, triton.runtime.JITFunction)]


@pytest.fixture
def offline_triton(monkeypatch):
    """llmfast's kernels on the CPU through Triton's compiler for sm_90, launches
    recorded (yielded); every kernel's compiled variants forgotten for the test (and
    restored after it), so the compiles seen are the test's own."""
    monkeypatch.setattr(ops, "use_triton", lambda x: True)
    monkeypatch.setattr(kernel_choice, "use_triton", lambda x: True)
    for module in (attention, kv_write, rope_cache):
        monkeypatch.setattr(module, "check_launchable", lambda *args: None)
    for module, name in ((attention, "_ATTENTION_LAUNCHES"), (attention, "_DECODE_ROPE_LAUNCHES"),
                         (kv_write, "_KV_WRITE_LAUNCHES"), (rope_cache, "_LAUNCHES")):
        monkeypatch.setattr(module, name, launch_cache.LaunchCache(getattr(module, name).kernel))
    with fresh_offline_variants(_jit_kernels()) as launches:
        yield launches


def _profile_on_the_cpu(model, sampler, max_num_tokens, max_num_reqs, block_size, dtype,
                        device, max_model_len=None):
    """The memory profile's forward (its batch, a scratch cache) without CUDA's memory
    statistics."""
    ids, positions, md, num_blocks = profile_batch(max_num_tokens, max_num_reqs, block_size,
                                                   device, max_model_len)
    bind_one_block_caches(model, block_size, dtype, device)
    with torch.inference_mode():
        model(ids, positions, md)
    return 0


def _cuda_start_up(monkeypatch) -> list[str]:
    """The runner starts in CUDA's order with the precompile on; returns the threads in
    which Triton compiled a variant."""
    cuda_start_up_order(monkeypatch, profile=_profile_on_the_cpu)
    monkeypatch.setattr(model_runner.ModelRunner, "_precompiles_kernels", lambda self: True)
    # Several compiles at once, as on the GPU machine (16 cores: 8 threads), more than
    # default_workers() gives a 2-core CI machine.
    monkeypatch.setattr(precompile, "default_workers", lambda: 4)
    compiling_threads = record_compiling_threads(monkeypatch)
    return compiling_threads


def _workload_compiles_nothing(engine) -> None:
    prompts, lengths, arrivals = arrival_workload()
    from llmfast import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    engine.set_async_scheduling(True)
    with TritonCompileWatch() as watch:
        run_with_arrivals(engine, prompts, params, arrivals)
    assert watch.available and watch.compiles == []


def test_eager_start_up_compiles_every_variant_in_threads(ckpt, offline_triton,
                                                          monkeypatch):
    threads = _cuda_start_up(monkeypatch)
    _first_two_compiles_meet(monkeypatch)
    engine = emulated_graph_engine(ckpt, None)  # eager: the layers' norm kernels, RoPE in the op
    variants = engine.runner.triton_variants
    assert variants is not None and variants["compiled_at_launch"] == 0
    assert variants["precompiled"] >= 4  # 2 norms, RoPE + KV write, attention kinds
    assert threads and all(t.startswith("llmfast-triton-compile") for t in threads)
    assert len(set(threads)) > 1  # compiled side by side
    assert "precompile" in engine.runner.startup_times
    _workload_compiles_nothing(engine)
    assert offline_triton  # the workload's launches were recorded (the dry ones: none)


def _first_two_compiles_meet(monkeypatch) -> None:
    """The first compile waits (up to a minute) until a second one has started: compiles
    that run side by side meet at once, while one thread taking every compile (the pool
    reusing a thread that went idle, as a loaded machine allowed) waits out the timeout
    and then fails the test's check of several threads, not by chance."""
    meeting = threading.Barrier(2, timeout=60)
    started = iter(range(2))
    compile = triton.compiler.compile

    def meeting_compile(*args, **kwargs):
        if next(started, None) is not None:
            try:
                meeting.wait()
            except threading.BrokenBarrierError:
                pass
        return compile(*args, **kwargs)

    monkeypatch.setattr(triton.compiler, "compile", meeting_compile)


def _graphs_engine(checkpoint, monkeypatch, tmp_path):
    """(engine, compiling threads) started on the CUDA default's path: compiled,
    piecewise and full graphs (emulated), RoPE in the attention op, async scheduling.
    The layers' norms stay torch ops here, and the pieces run as traced, not through
    Inductor: under the sm_90 stand-in driver Inductor would key its cache for that
    target for the rest of the process (a later test's saved pieces would then not load
    in a fresh process). On CUDA the compiled pieces launch Inductor's copies of the
    norms, which the dry forwards leave alone."""
    threads = _cuda_start_up(monkeypatch)
    monkeypatch.setattr(kernel_choice, "_ENABLED", False)
    monkeypatch.setattr(model_runner, "CompiledModel",
                        functools.partial(CompiledModel, piece_compiler="eager"))
    rope_in_the_op(monkeypatch, tmp_path)
    return emulated_graph_engine(checkpoint, CudaGraphMode.FULL_AND_PIECEWISE), threads


def test_compiled_start_up_with_graphs_compiles_every_variant_in_threads(
        ckpt, offline_triton, monkeypatch, tmp_path):
    engine, threads = _graphs_engine(ckpt, monkeypatch, tmp_path)
    variants = engine.runner.triton_variants
    assert variants is not None and variants["compiled_at_launch"] == 0
    assert variants["precompiled"] >= 3  # RoPE + KV write, decode + RoPE, attention kinds
    assert threads and all(t.startswith("llmfast-triton-compile") for t in threads)
    compiled = engine.runner.compiled
    assert compiled.stats.full_graph_sizes and compiled.stats.captured_sizes
    _workload_compiles_nothing(engine)
    assert compiled.graphs.full.num_replays > 0 and compiled.graphs.piecewise.num_replays > 0


def test_a_failed_precompile_leaves_the_compiles_to_the_launches(
        ckpt, offline_triton, monkeypatch, caplog):
    # The precompile is an optimisation: should its dry forwards raise on some GPU (a
    # bind failure, say), the start goes on and each variant compiles at its launch, as
    # without it; the start-up report counts them and says the precompile failed.
    threads = _cuda_start_up(monkeypatch)
    submit = precompile.KernelPrecompiler.submit

    def failing_submit(self, kernel, grid, args, kwargs):
        if self.dry_launch_count >= 3:  # some variants submitted, then a failure
            raise RuntimeError("stand-in bind failure")
        return submit(self, kernel, grid, args, kwargs)

    monkeypatch.setattr(precompile.KernelPrecompiler, "submit", failing_submit)
    with caplog.at_level(logging.WARNING, logger=runner_startup.__name__):
        engine = emulated_graph_engine(ckpt, None)
    variants = engine.runner.triton_variants
    assert variants["precompile_failed"] == 1 and variants["precompiled"] == 0
    assert variants["compiled_at_launch"] > 0  # the start's launches compiled the rest
    assert any(t.startswith("llmfast-triton-compile") for t in threads)  # those submitted
    assert precompile.ACTIVE is None  # the launches after it ran
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("stand-in bind failure" in m and "first launch" in m for m in warnings)
    # It serves: the workload's steps launch (and compile what the start did not).
    from llmfast import SamplingParams

    prompts, lengths, arrivals = arrival_workload()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    tokens = run_with_arrivals(engine, prompts, params, arrivals)
    assert [len(t) for t in tokens] == lengths
    assert offline_triton


def test_graphs_start_up_with_split_counts_between_the_powers_of_two(
        ckpt, offline_triton, monkeypatch, tmp_path, caplog):
    # A split table giving 3 and 6 splits (no power of two): the dry forwards compile
    # the variants (split code bound 8) that every later launch takes, whatever its
    # count; the CUDA default's path.
    best = {(b, c): (3 if b <= 2 else 6) for b in (1, 2, 4, 8) for c in (16, 96)}
    monkeypatch.setattr(attention_config, "find_table", lambda tables, *shape: SplitTable(
        *shape, best))
    # Plans are kept per shape for the process (its table is fixed): none of earlier tests'.
    monkeypatch.setattr(attention, "_PLANS", launch_cache.PlanCache())
    with caplog.at_level(logging.INFO, logger=runner_startup.__name__):
        engine, _ = _graphs_engine(ckpt, monkeypatch, tmp_path)
    assert engine.runner.triton_variants["compiled_at_launch"] == 0, caplog.text[-2000:]
    _workload_compiles_nothing(engine)
    plans = list(attention._PLANS.values())
    assert {3, 6} <= {c for plan in plans for c in plan.split_counts}
    assert {plan.constexprs["SPLIT_BOUND"] for plan in plans} <= {1, 8}


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: triton.language.constexpr):
    offs = triton.language.program_id(0) * BLOCK + triton.language.arange(0, BLOCK)
    mask = offs < n
    x = triton.language.load(x_ptr + offs, mask=mask)
    triton.language.store(out_ptr + offs, x * factor, mask=mask)


def test_dry_launches_run_nothing_and_compile_each_variant_once(monkeypatch):
    monkeypatch.setattr(_scale_kernel, "device_caches", type(_scale_kernel.device_caches)(
        _scale_kernel.create_binder))  # this test's compiles only
    cache = launch_cache.LaunchCache(_scale_kernel)
    x = torch.empty(256, dtype=torch.float16)
    unaligned = torch.empty(257, dtype=torch.float16)[1:]
    with offline_hopper(record_launches=True) as launches:
        precompiler = precompile.KernelPrecompiler(max_workers=2)
        with precompiler.dry_launches():
            for n in (200, 100, 300):  # one variant: n is never 1 or a multiple of 16
                cache.launch((1, 1, 1), (x, x), (n, 0.5), "c", {"BLOCK": 256})
            cache.launch((1, 1, 1), (unaligned, x), (200, 0.5), "c", {"BLOCK": 256})
            cache.launch((1, 1, 1), (x, x), (200, 0.5), "c", {"BLOCK": 128})
        assert launches == [] and precompile.ACTIVE is None  # nothing ran; mode left
        assert precompiler.dry_launch_count == 5 and precompiler.num_submitted == 3
        # Each variant's launcher is built in the pool too (Triton 3.6 on CUDA: C,
        # compiled per signature at the first launch otherwise). The stand-in driver
        # has no launcher class: a recording one.
        built: list[tuple[str, str]] = []

        class RecordingLauncher:
            def __init__(self, src, metadata):
                built.append((src.fn.__name__, threading.current_thread().name))

        from triton.runtime.driver import driver

        monkeypatch.setattr(type(driver.active), "launcher_cls", RecordingLauncher,
                            raising=False)
        precompiler.wait()
        assert precompiler.launchers_built == 3 and len(built) == 3
        assert all(name == "_scale_kernel" and thread.startswith("llmfast-triton-compile")
                   for name, thread in built)
        monkeypatch.delattr(type(driver.active), "launcher_cls")
        with TritonCompileWatch() as watch:  # the real launches find their variants
            cache.launch((1, 1, 1), (x, x), (200, 0.5), "c", {"BLOCK": 256})
            cache.launch((1, 1, 1), (unaligned, x), (100, 0.5), "c", {"BLOCK": 256})
            cache.launch((1, 1, 1), (x, x), (300, 0.5), "c", {"BLOCK": 128})
        assert watch.compiles == [] and len(launches) == 3
        with TritonCompileWatch() as watch:  # a variant no dry launch had: compiled now
            cache.launch((1, 1, 1), (x, x), (16, 0.5), "c", {"BLOCK": 256})
        assert [c.name for c in watch.compiles] == ["_scale_kernel"]


@pytest.mark.parametrize("options", [{}, {"num_warps": 2}, {"num_warps": 8, "num_stages": 2}])
def test_a_layer_dry_launch_compiles_the_variant_wrap_triton_launches(monkeypatch, options):
    """`launchable`'s stand-in (_DryLaunch) keys its compile as the eager wrap_triton
    launch does: with options, wrap_triton's one-config autotuner passes every option
    its Config has; without any, it launches the kernel as is (no Config defaults)."""
    monkeypatch.setattr(_scale_kernel, "device_caches", type(_scale_kernel.device_caches)(
        _scale_kernel.create_binder))  # this test's compiles only
    x, out = torch.empty(256, dtype=torch.float16), torch.empty(256, dtype=torch.float16)
    with offline_hopper(record_launches=True) as launches:
        precompiler = precompile.KernelPrecompiler(max_workers=1)
        with precompiler.dry_launches():
            kernel_choice._DryLaunch(_scale_kernel, precompiler)[(1,)](x, out, 200, 0.5, BLOCK=256,
                                                                **options)
        precompiler.wait()
        assert launches == [] and precompiler.num_submitted == 1
        with TritonCompileWatch() as watch:
            torch.library.wrap_triton(_scale_kernel)[(1,)](x, out, 200, 0.5, BLOCK=256,
                                                           **options)
        assert len(launches) == 1 and watch.compiles == []


def test_a_variant_whose_threaded_compile_failed_compiles_again_at_its_launch(monkeypatch,
                                                                               caplog):
    # Triton 3.7 puts a submitted compile's FutureKernel in the kernel's cache at once;
    # one that failed in a thread must not stay there (its launch would re-raise the
    # thread's error for the life of the process): the launch compiles it, as without
    # the precompile. (Triton 3.6 keeps it out of the cache until it is finalized.)
    real = triton.compiler.compile

    def fails_in_the_pool(*args, **kwargs):
        if threading.current_thread().name.startswith("llmfast-triton-compile"):
            raise RuntimeError("a compile failing in a thread")
        return real(*args, **kwargs)

    monkeypatch.setattr(triton.compiler, "compile", fails_in_the_pool)
    # Binders made from now on import the patched compile.
    monkeypatch.setattr(_scale_kernel, "device_caches", type(_scale_kernel.device_caches)(
        _scale_kernel.create_binder))
    cache = launch_cache.LaunchCache(_scale_kernel)
    x = torch.empty(256, dtype=torch.float16)
    with offline_hopper(record_launches=True) as launches:
        precompiler = precompile.KernelPrecompiler(max_workers=1)
        with precompiler.dry_launches():
            cache.launch((1, 1, 1), (x, x), (200, 0.5), "c", {"BLOCK": 256})
        with caplog.at_level(logging.WARNING, logger=precompile.__name__):
            precompiler.wait()
        cache.launch((1, 1, 1), (x, x), (200, 0.5), "c", {"BLOCK": 256})  # compiles here
    assert len(launches) == 1
    # Said, with the thread's error.
    assert any("failed to compile in its thread (RuntimeError: a compile failing in a "
               "thread)" in r.getMessage() for r in caplog.records), caplog.text


def test_compile_threads_parse_kernels_one_at_a_time():
    """CPython 3.11's ast.parse is not thread-safe ("AST constructor recursion depth
    mismatch", CI dry run 45): once a precompiler exists, Triton's parse of a kernel's
    source takes a process-wide lock, so a thread's parse waits for another's."""
    precompile.KernelPrecompiler(max_workers=1).wait()
    parsed = threading.Event()

    def parse_in_a_thread():
        _scale_kernel.parse()
        parsed.set()

    with precompile._PARSE_LOCK:  # another thread parsing
        thread = threading.Thread(target=parse_in_a_thread)
        thread.start()
        assert not parsed.wait(0.5)  # waits for it
    thread.join(10)
    assert parsed.is_set()
