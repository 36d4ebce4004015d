"""What `--gemv auto`'s start-up measurement costs a start, on the CPU:

- it compiles its Triton candidates in threads, all at once, before timing them
  (gemv_tuning.compile_candidates), instead of one after another at each candidate's
  first launch: Triton's compiler for sm_90 offline, each launch recorded instead of run
  (kernels/launch/offline_target.py); the oracle: Triton's own compile hooks
  (TritonCompileWatch) around every timed launch, and the threads its compiler ran in;
- its seconds are a stage of the start-up report (`gemv`), not lost in "other".
"""

from __future__ import annotations


import pytest
import torch

from llmfast.config import SkinnyLinearConfig
from llmfast.kernels.gemv import launch_config, ops
from llmfast.worker.startup import gemv_tuning
from llmfast.kernels.gemv import triton_kernels as gemv_kernels
from llmfast.kernels.launch import precompile
from llmfast.kernels.launch.compile_watch import TritonCompileWatch
from llmfast.worker.startup.gemv_routing import GpuFacts, route_gemv
from tests.helpers.offline_variants import fresh_offline_variants, record_compiling_threads

pytestmark = pytest.mark.skipif(
    precompile.KernelPrecompiler().available is False,
    reason="this Triton has no asynchronous compile mode")

GPU = GpuFacts("NVIDIA H100 80GB HBM3", 132, converts_fp8=True)
KERNELS = (gemv_kernels.gemv_kernel, gemv_kernels.gemv_reduce_kernel)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No table but what the test measures; the GEMV's compiled variants forgotten for
    the test (restored after it); Triton compiling for sm_90, launches recorded."""
    monkeypatch.setattr(launch_config, "TABLE_DIR", tmp_path / "shipped")
    monkeypatch.setattr(launch_config, "_MEASURED", {})
    launch_config.shipped_table.cache_clear()
    ops.forget_choices()
    # Several compiles at once, as on a GPU machine, more than a 2-core CI machine gets.
    monkeypatch.setattr(precompile, "default_workers", lambda: 4)
    try:
        with fresh_offline_variants(KERNELS) as launches:
            yield launches
    finally:
        launch_config.shipped_table.cache_clear()
        ops.forget_choices()


def test_the_timed_candidates_were_compiled_in_threads(offline, tmp_path, monkeypatch):
    """random:tiny's five projection shapes at the 1 bucket, under the real timer's
    place: every Triton candidate it launches finds its variant compiled (in the
    precompile's threads, several at once); the GEMV then wins everywhere."""
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model

    model = build_model(resolve_model("random:tiny"), torch.float32, "cpu", max_positions=64)
    compiling_threads = record_compiling_threads(monkeypatch)
    compiled_at_launch = []

    def timer(launches, rows, config):
        """What time_on_cuda launches (each layer of the shape with the candidate),
        recorded instead of run; cuBLAS slower than any candidate."""
        if config is None:
            return 10.0
        first = launches[0]
        x = torch.zeros(rows, first.k, dtype=first.dtype)  # [M, K]
        with TritonCompileWatch() as watch:
            for launch in launches:
                ops.gemv_triton(x, launch.weight, config, launch.weight_scale, launch.bias)
        compiled_at_launch.extend(watch.compiles)
        return 5.0

    monkeypatch.setattr(gemv_tuning, "time_on_cuda", timer)
    routing = route_gemv(model, SkinnyLinearConfig("auto"), (1,), cache=tmp_path, gpu=GPU)
    assert routing.routed == 9 and len(routing.measured) == 5
    assert compiled_at_launch == [], [c.name for c in compiled_at_launch]
    assert compiling_threads
    assert all(t.startswith("llmfast-triton-compile") for t in compiling_threads)
    assert offline  # the timed launches were recorded (the dry ones: none)


def test_a_dry_launch_submits_and_runs_nothing(offline):
    """Under the start-up's dry launches (the runner's precompile too), the GEMV and its
    split-K reduce submit their compiles and launch nothing; after `wait` a real
    launch of the same variant compiles nothing."""
    weight = torch.zeros(64, 2048)
    x = torch.zeros(1, 2048)
    config = launch_config.GemvConfig(block_n=16, block_k=128, split_k=4)
    precompiler = precompile.KernelPrecompiler()
    with precompiler.dry_launches():
        ops.gemv_triton(x, weight, config)
    precompiler.wait()
    assert precompiler.num_submitted == 2 and offline == []  # kernel + reduce, none run
    with TritonCompileWatch() as watch:
        ops.gemv_triton(x, weight, config)
    assert watch.compiles == [] and len(offline) == 2


def test_precompile_off_compiles_nothing_ahead(offline, monkeypatch):
    """LLMFAST_KERNEL_PRECOMPILE=0 (the runner's A/B switch) leaves the candidates to
    their launches too."""
    monkeypatch.setenv("LLMFAST_KERNEL_PRECOMPILE", "0")
    launch = gemv_tuning.Launch(weight=torch.zeros(64, 2048), dtype=torch.float32)
    with TritonCompileWatch() as watch:
        assert gemv_tuning.compile_candidates({launch.key: [launch]},
                                                 [(launch.key, 1)], 132) is None
    assert watch.compiles == [] and offline == []


def test_the_measurement_is_a_start_up_stage(tmp_path, monkeypatch):
    """A CPU engine routed as on a GPU (fake facts and timer): the routing's seconds are
    the runner's `gemv` stage, and `bench --startup`'s table names it."""
    from rich.console import Console

    from llmfast.cli.bench.tables import startup_table
    from llmfast.engine.args import EngineArgs
    from llmfast.engine.llm_engine import LLMEngine
    from llmfast.worker.startup import gemv_routing
    from llmfast.worker.startup import runner_startup
    from tests.helpers.engine_config import engine_config

    monkeypatch.setattr(launch_config, "TABLE_DIR", tmp_path / "shipped")
    monkeypatch.setattr(launch_config, "_MEASURED", {})
    launch_config.shipped_table.cache_clear()
    ops.forget_choices()
    timed = []

    def timer(launches, rows, config):
        timed.append(launches[0].key)
        return 10.0 if config is None else 5.0

    def route_as_on_a_gpu(model, settings, rows, progress=None):
        return gemv_routing.route_gemv(model, settings, rows, progress, measure=timer,
                                       cache=tmp_path / "cache", gpu=GPU)

    monkeypatch.setattr(runner_startup, "route_gemv", route_as_on_a_gpu)
    config, source = engine_config(EngineArgs(model="random:tiny", device="cpu",
                                              enforce_eager=True, max_model_len=64))
    try:
        engine = LLMEngine(config, source)
    finally:
        launch_config.shipped_table.cache_clear()
        ops.forget_choices()
    assert timed and engine.runner.startup_times["gemv"] > 0
    run = dict(stages=dict(engine.runner.startup_times), import_s=1.0, engine_s=9.0,
               first_step_s=0.1, time_to_first_token_s=10.0, compile_cache_hits=0,
               compile_cache_misses=0, device="cpu")
    console = Console(width=400, record=True)
    console.print(startup_table(dict(model="random:tiny", cold=run, warm=run)))
    assert "time the GEMV against cuBLAS (once per GPU)" in console.export_text()


def test_every_split_count_of_a_tile_shares_one_variant(offline):
    """The split count is a launch argument, not a constexpr: timing splits 2, 4 and 8
    of one tile compiles one GEMV variant and one reduce (split 1, no reduce: one more)."""
    weight = torch.zeros(64, 2048)
    x = torch.zeros(1, 2048)
    precompiler = precompile.KernelPrecompiler()
    with precompiler.dry_launches():
        for split_k in (2, 4, 8):
            ops.gemv_triton(x, weight, launch_config.GemvConfig(16, 128, split_k=split_k))
    assert precompiler.num_submitted == 2
    with precompiler.dry_launches():
        ops.gemv_triton(x, weight, launch_config.GemvConfig(16, 128, split_k=1))
    precompiler.wait()
    assert precompiler.num_submitted == 3


@pytest.mark.parametrize(("preset", "fused", "variants"), [
    ("random:llama-3.2-1b", False, 37), ("random:llama-3.2-1b", True, 84),
    ("random:llama-3.1-8b", False, 32)])
def test_a_cold_start_binds_few_variants(preset, fused, variants):
    """What --gemv auto's start-up compiles for a preset in bf16 at the five buckets on
    132 SMs (scripts/bench_gemv.py --compile-cost --count-only: the variants its launches bind,
    nothing compiled): 67, 135 and 59 while the split count was a constexpr."""
    from llmfast.bench.kernels import gemv_compile_cost

    groups = gemv_compile_cost.preset_launches(preset, fp8=False, fused=fused)
    todo = [(key, b) for key in groups for b in launch_config.M_BUCKETS]
    assert gemv_compile_cost.count_variants(groups, todo) == variants


def test_the_dry_launches_compile_every_routed_bucket(offline, tmp_path, monkeypatch):
    """The start-up's dry launches (precompile_kernels' `gemv`) reach every routed
    projection, the lm_head too, at each M bucket of the decode sizes: a launch table
    that chose the GEMV (here --gemv triton's heuristic, as on the faked GPU) then
    compiles nothing at the real launches of those sizes (the captures' warm-up)."""
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model
    from llmfast.worker.startup.gemv_routing import dry_gemv_launches

    model = build_model(resolve_model("random:tiny"), torch.float32, "cpu", max_positions=64)
    route_gemv(model, SkinnyLinearConfig("triton"), (1,), cache=tmp_path, gpu=GPU)
    choose = launch_config.choose

    def choice_as_on_the_gpu(x, weight, silu_mul, norm, residual, backend):
        n = ops.out_features(weight, silu_mul)
        return choose(x.shape[0], n, x.shape[1], "", GPU.name, GPU.num_sms, backend)

    monkeypatch.setattr(ops, "choice_for", choice_as_on_the_gpu)
    rows = (1, 3, 16)  # buckets 1, 4, 16
    precompiler = precompile.KernelPrecompiler()
    with precompiler.dry_launches():
        assert dry_gemv_launches(model, rows) == 5 * 3  # five shapes, three buckets
    precompiler.wait()
    assert precompiler.num_submitted > 0 and offline == []
    routed = [m for m in model.modules() if getattr(m, "gemv_backend", "")]
    assert len(routed) == 9 and model.lm_head in routed
    with TritonCompileWatch() as watch:
        for module in routed:
            for m in (1, 4, 16):
                module(torch.zeros(m, module.in_features))
    assert watch.compiles == [], [c.name for c in watch.compiles]
    assert len(offline) >= 9 * 3
