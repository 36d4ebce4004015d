"""`--gemv auto`'s start-up measurement (worker/startup/gemv_tuning.py) and the routing it
feeds (worker/startup/gemv_routing.py), on the CPU: a fake timer (µs from a table) drives the
choice per shape and M bucket; the timings' file round-trips and is ignored when the GPU,
torch, Triton or the kernels' sources change; a failing measurement leaves cuBLAS and
logs why; the engine on the CPU never measures; --gemv and --gemv-fuse reach the config.
The timer itself (CUDA graphs and events) runs in tests/test_gemv_gpu.py."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from llmfast.config import (
    CompileConfig,
    ConfigError,
    CudaGraphMode,
    SkinnyLinearConfig,
)
from llmfast.engine.args import EngineArgs
from llmfast.kernels.gemv import launch_config, ops
from llmfast.worker.startup import gemv_tuning
from llmfast.kernels.gemv.launch_config import GemvConfig, startup_candidates, table_json
from llmfast.worker.startup.gemv_tuning import Launch, candidate_name, measure_missing
from llmfast.worker.startup import gemv_routing
from llmfast.worker.startup.gemv_routing import GpuFacts, decode_rows, route_gemv

H100 = "NVIDIA H100 80GB HBM3"
GPU = GpuFacts(H100, 132, converts_fp8=True)


@pytest.fixture(autouse=True)
def clean_tables(tmp_path, monkeypatch):
    """No shipped table but the test's own, nothing measured in this process before."""
    monkeypatch.setattr(launch_config, "TABLE_DIR", tmp_path / "shipped")
    monkeypatch.setattr(launch_config, "_MEASURED", {})
    launch_config.shipped_table.cache_clear()
    ops.forget_choices()
    yield
    launch_config.shipped_table.cache_clear()
    ops.forget_choices()


class FakeTimer:
    """µs per launch: cuBLAS `cublas` (per (key, rows), or one for all); a Triton candidate `triton` x (1 + its index
    among the start-up candidates / 10), so the first (the heuristic's) is the fastest
    Triton one, except `fastest`'s name, which gets `triton` / 2; a name in `failing`
    raises. Records every call as (key, rows, candidate name)."""

    def __init__(self, cublas: dict[tuple[str, int], float] | float, triton: float = 10.0,
                 fastest: str | None = None, failing: tuple[str, ...] = ()):
        self.cublas, self.triton, self.fastest, self.failing = cublas, triton, fastest, failing
        self.calls: list[tuple[str, int, str]] = []

    def __call__(self, launches: list[Launch], rows: int, config: GemvConfig | None) -> float:
        first = launches[0]
        name = candidate_name(config)
        self.calls.append((first.key, rows, name))
        if name in self.failing:
            raise RuntimeError(f"{name}: out of resources")
        if config is None:
            return self.cublas if isinstance(self.cublas, float) else \
                self.cublas[first.key, rows]
        if name == self.fastest:
            return self.triton / 2
        order = startup_candidates(rows, first.n, first.k, GPU.num_sms, first.fp8)
        return self.triton * (1 + order.index(config) / 10)


def _launches(n: int = 2048, k: int = 8192, layers: int = 3) -> list[Launch]:
    return [Launch(weight=torch.zeros(n, k), dtype=torch.float32) for _ in range(layers)]


KEY = "n2048-k8192-float32"


def test_the_faster_of_cublas_and_the_candidates_wins_per_bucket(tmp_path):
    """Bucket 1: a Triton candidate beats cuBLAS (the fastest one wins); bucket 16:
    cuBLAS is faster than every candidate. A failing candidate is left out; every
    launch of the group is timed together."""
    failing = candidate_name(startup_candidates(1, 2048, 8192, 132)[1])
    fastest = candidate_name(startup_candidates(1, 2048, 8192, 132)[2])
    timer = FakeTimer({(KEY, 1): 12.0, (KEY, 16): 9.0}, fastest=fastest, failing=(failing,))
    table = measure_missing({KEY: _launches()}, [1, 16], H100, 132, timer, tmp_path)
    assert table[KEY][1] == startup_candidates(1, 2048, 8192, 132)[2]
    assert table[KEY][16] is None
    assert {(rows, name) for _, rows, name in timer.calls} >= {(1, "cublas"), (1, failing),
                                                                (16, "cublas")}
    assert sum(rows == 1 for _, rows, _ in timer.calls) == 1 + launch_config.STARTUP_CANDIDATES
    stored = json.loads(gemv_tuning.cache_path(gemv_tuning.cache_fields(H100),
                                                  tmp_path).read_text())
    row = stored["shapes"][KEY]["1"]
    assert row["backend"] == "triton" and failing not in row["timings_us"]
    assert row["timings_us"]["cublas"] == 12.0 and row["timings_us"][fastest] == 5.0


def test_startup_candidates_are_few_and_start_with_the_heuristic():
    for rows, n, k in ((1, 2048, 8192), (4, 3072, 2048), (16, 128256, 2048)):
        candidates = startup_candidates(rows, n, k, 132)
        assert candidates[0] == launch_config.heuristic_config(rows, n, k, 132)
        assert len(candidates) == launch_config.STARTUP_CANDIDATES == len(set(candidates))
        assert set(candidates) <= set(launch_config.tuning_candidates(rows, n, k, 132))


def test_the_file_round_trips_and_only_missing_buckets_are_timed(tmp_path):
    timer = FakeTimer({(KEY, 1): 12.0, (KEY, 4): 30.0, (KEY, 16): 9.0})
    first = measure_missing({KEY: _launches()}, [1, 16], H100, 132, timer, tmp_path)
    timer.calls.clear()
    again = measure_missing({KEY: _launches()}, [1, 16], H100, 132, timer, tmp_path)
    assert again == first and timer.calls == []  # read, nothing timed
    more = measure_missing({KEY: _launches()}, [1, 4, 16], H100, 132, timer, tmp_path)
    assert {rows for _, rows, _ in timer.calls} == {4}  # only the new bucket
    assert more[KEY][1] == first[KEY][1] and set(more[KEY]) == {1, 4, 16}
    # The file is a launch table: shipped as it is, launches read it alike.
    path = gemv_tuning.cache_path(gemv_tuning.cache_fields(H100), tmp_path)
    assert launch_config.parse_table(json.loads(path.read_text())) == more


@pytest.mark.parametrize("change", ["device", "torch", "triton", "kernels"])
def test_the_file_is_keyed_by_gpu_versions_and_sources(tmp_path, monkeypatch, change):
    import triton

    timer = FakeTimer({(KEY, 1): 12.0})
    measure_missing({KEY: _launches()}, [1], H100, 132, timer, tmp_path)
    fields = gemv_tuning.cache_fields(H100)
    device = H100
    if change == "device":
        device = "NVIDIA H200"
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "9.9.9")
    elif change == "triton":
        monkeypatch.setattr(triton, "__version__", "9.9.9")
    else:  # another kernel source
        kernels = tmp_path / "src"
        kernels.mkdir()
        for name in gemv_tuning._SOURCES:
            (kernels / name).write_text(f"# {name}, edited\n")
        monkeypatch.setattr(gemv_tuning, "_SOURCE_DIR", kernels)
    assert gemv_tuning.cache_fields(device) != fields
    timer.calls.clear()
    measure_missing({KEY: _launches()}, [1], device, 132, timer, tmp_path)
    assert timer.calls, "timings made under other versions were reused"
    # Both files stay: going back to the first versions times nothing.
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_file_of_other_fields_or_corrupt_is_timed_again_and_rewritten(tmp_path, caplog):
    timer = FakeTimer({(KEY, 1): 12.0})
    fields = gemv_tuning.cache_fields(H100)
    path = gemv_tuning.cache_path(fields, tmp_path)
    gemv_tuning.write_cache(path, {**fields, "torch": "0.1"},
                               table_json(H100, {KEY: {1: (GemvConfig(16, 256), {})}})["shapes"])
    measure_missing({KEY: _launches()}, [1], H100, 132, timer, tmp_path)
    assert timer.calls  # the file's own key did not match: ignored
    path.write_text("{not json")
    timer.calls.clear()
    with caplog.at_level(logging.WARNING):
        table = measure_missing({KEY: _launches()}, [1], H100, 132, timer, tmp_path)
    assert timer.calls and "ignoring the GEMV timings" in caplog.text
    # The heuristic's config (10 us) beat cuBLAS (12 us); the file holds it again.
    assert table == {KEY: {1: startup_candidates(1, 2048, 8192, 132)[0]}}
    assert launch_config.parse_table(json.loads(path.read_text())) == table


def test_decode_rows_follow_the_full_graphs():
    full = CompileConfig(cuda_graph_mode=CudaGraphMode.FULL_AND_PIECEWISE,
                         cuda_graph_sizes=(1, 2, 4, 8, 16, 24, 32))
    assert decode_rows(full) == (1, 2, 4, 8, 16)
    assert decode_rows(CompileConfig(cuda_graph_mode=CudaGraphMode.FULL_DECODE,
                                     cuda_graph_sizes=(3, 64))) == (3,)
    for no_full in (CompileConfig(enforce_eager=True),
                    CompileConfig(cuda_graph_mode=CudaGraphMode.PIECEWISE)):
        assert decode_rows(no_full) == tuple(range(1, 17))


# ------------------------------------------------------------------ routing a model


@pytest.fixture
def tiny():
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model

    return build_model(resolve_model("random:tiny"), torch.float32, "cpu", max_positions=64)


def _backends(model) -> dict[str, str]:
    return {name: m.gemv_backend for name, m in model.named_modules()
            if hasattr(m, "gemv_backend")}


def test_auto_routes_the_layers_whose_shape_the_gemv_won(tiny, tmp_path):
    """random:tiny's plain layers: the GEMV measured faster only for the lm_head's shape
    (n512): only the lm_head takes the op, the rest keep their plain F.linear; a second
    start reads the file and times nothing."""
    lm_head = "n512-k64-float32"
    keys = {launch.key for _, launch in gemv_routing.model_launches(tiny, fused=False)}
    cublas = {(key, b): (50.0 if key == lm_head else 5.0) for key in keys for b in (1, 2, 4)}
    timer = FakeTimer(cublas)
    routing = route_gemv(tiny, SkinnyLinearConfig("auto"), (1, 2, 3), measure=timer,
                         cache=tmp_path, gpu=GPU)
    assert {rows for _, rows, _ in timer.calls} == {1, 2, 4}  # 3 pads to the 4 bucket
    assert set(routing.measured) == keys and routing.routed == 1 and not routing.fused
    backends = _backends(tiny)
    assert backends.pop("lm_head") == "auto" and set(backends.values()) == {""}
    assert launch_config.choose(1, 512, 64, lm_head, H100, 132, "auto").source == "table"
    # The next start: the file read, nothing timed.
    launch_config._MEASURED.clear()
    timer.calls.clear()
    assert route_gemv(tiny, SkinnyLinearConfig("auto"), (1, 2, 3), measure=timer,
                      cache=tmp_path, gpu=GPU).routed == 1
    assert timer.calls == []


def test_a_shipped_entry_is_not_measured_and_wins(tiny, tmp_path):
    launch_config.TABLE_DIR.mkdir()
    keys = {launch.key for _, launch in gemv_routing.model_launches(tiny, fused=False)}
    shipped = "n64-k64-float32"  # o_proj: the GEMV won there on this GPU model
    (launch_config.TABLE_DIR / f"{launch_config.device_slug(H100)}.json").write_text(
        json.dumps(table_json(H100, {shipped: {1: (GemvConfig(16, 32), {})}})))
    timer = FakeTimer({(key, 1): 5.0 for key in keys})
    route_gemv(tiny, SkinnyLinearConfig("auto"), (1,), measure=timer, cache=tmp_path,
               gpu=GPU)
    assert shipped not in {key for key, _, _ in timer.calls}
    backends = _backends(tiny)
    assert {n for n, b in backends.items() if b} == {f"model.layers.{i}.self_attn.o_proj"
                                                     for i in range(2)}


def test_fused_layers_measure_their_fused_shapes(tiny, tmp_path):
    timer = FakeTimer(5.0)
    routing = route_gemv(tiny, SkinnyLinearConfig("auto", fused_layers=True), (1,),
                         measure=timer, cache=tmp_path, gpu=GPU)
    assert routing.fused and tiny.model.gemv_fused == "auto"
    assert {key for key, _, _ in timer.calls} == {
        "n128-k64-float32-norm", "n64-k64-float32-residual",
        "n128-k64-float32-norm-silu_mul", "n64-k128-float32-residual", "n512-k64-float32"}


def test_triton_and_cublas_measure_nothing(tiny, tmp_path):
    def boom(*args):
        raise AssertionError("timed")

    routing = route_gemv(tiny, SkinnyLinearConfig("triton"), (1,), measure=boom,
                         cache=tmp_path, gpu=GPU)
    assert routing.routed == 9 and set(_backends(tiny).values()) == {"triton"}
    # Routed again (cublas): every layer back to its own path.
    assert route_gemv(tiny, SkinnyLinearConfig("cublas"), (1,), measure=boom,
                      cache=tmp_path, gpu=GPU).routed == 0
    assert set(_backends(tiny).values()) == {""} and tiny.model.gemv_fused == ""


def test_fp8_weights_stay_on_cublas_where_triton_cannot_read_them(tiny, tmp_path):
    from llmfast.models.quantization.fp8 import quantize_fp8

    quantize_fp8(tiny)
    old_gpu = GpuFacts("NVIDIA A100-SXM4-80GB", 108, converts_fp8=False)
    timer = FakeTimer(50.0)
    routing = route_gemv(tiny, SkinnyLinearConfig("auto"), (1,), measure=timer,
                         cache=tmp_path, gpu=old_gpu)
    assert {key for key, _, _ in timer.calls} == {"n512-k64-float32"}  # the lm_head only
    assert routing.routed == 1 and _backends(tiny)["lm_head"] == "auto"


def test_a_failing_measurement_logs_and_keeps_cublas(tiny, tmp_path, caplog):
    timer = FakeTimer({}, failing=("cublas",))
    with caplog.at_level(logging.WARNING):
        routing = route_gemv(tiny, SkinnyLinearConfig("auto"), (1, 2), measure=timer,
                             cache=tmp_path, gpu=GPU)
    assert timer.calls  # it tried
    assert routing.routed == 0 and routing.measured == ()
    assert set(_backends(tiny).values()) == {""}
    assert "timing the GEMV against cuBLAS failed (RuntimeError" in caplog.text
    assert launch_config._MEASURED == {} and not list(tmp_path.glob("*.json"))


def test_the_engine_on_the_cpu_never_measures(monkeypatch):
    """A CPU engine under --gemv auto (and triton): routing returns before any timing;
    every projection keeps its CPU path; greedy tokens as with cublas."""
    from llmfast import SamplingParams
    from llmfast.engine.llm_engine import LLMEngine
    from tests.helpers.engine_config import engine_config
    from tests.helpers.full_graphs import run_with_arrivals

    def boom(*args, **kwargs):
        raise AssertionError("the start-up timed the GEMV on the CPU")

    monkeypatch.setattr(gemv_tuning, "measure_missing", boom)
    monkeypatch.setattr(gemv_tuning, "time_on_cuda", boom)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    outputs = {}
    for backend in ("auto", "triton", "cublas"):
        config, source = engine_config(EngineArgs(
            model="random:tiny", device="cpu", enforce_eager=True, max_model_len=64,
            gemv=backend))
        assert config.gemv == SkinnyLinearConfig(backend)
        engine = LLMEngine(config, source)
        model = engine.runner.model
        assert set(_backends(model).values()) == {""} and model.model.gemv_fused == ""
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        outputs[backend] = run_with_arrivals(engine, [[5, 6, 7]], [params], [0])
    assert outputs["auto"] == outputs["triton"] == outputs["cublas"]


def test_flags_reach_the_config():
    from tests.helpers.engine_config import engine_config

    config, _ = engine_config(EngineArgs(model="random:tiny", device="cpu",
                                         gemv="triton", gemv_fuse=True))
    assert config.gemv == SkinnyLinearConfig("triton", fused_layers=True)
    assert EngineArgs.from_kwargs(gemv="cublas").gemv_config() == SkinnyLinearConfig("cublas")
    with pytest.raises(ConfigError, match="unknown gemv backend"):
        EngineArgs(gemv="fast")
    with pytest.raises(ConfigError, match="--gemv-fuse"):
        EngineArgs(gemv="cublas", gemv_fuse=True)
    with pytest.raises(ConfigError, match="gemv-fuse must be True or False"):
        EngineArgs(gemv_fuse="yes")


def test_a_measured_table_ships_with_one_command(tmp_path, monkeypatch):
    """The timings' file (what `bench_gemv.py --startup --copy-to` writes) merged by
    `bench_gemv.py --ship` into the shipped table of the GPU it names, which the engine
    then reads: its shapes need no measurement at the next start."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import bench_gemv

    timer = FakeTimer({(KEY, 1): 12.0, (KEY, 16): 9.0})
    measure_missing({KEY: _launches()}, [1, 16], H100, 132, timer, tmp_path / "cache")
    (measured,) = (tmp_path / "cache").glob("*.json")
    launch_config.TABLE_DIR.mkdir()
    shipped = bench_gemv.ship(measured)
    assert shipped == launch_config.TABLE_DIR / "nvidia-h100-80gb-hbm3.json"
    launch_config.shipped_table.cache_clear()
    assert launch_config.shipped_table(H100) == {
        KEY: {1: startup_candidates(1, 2048, 8192, 132)[0], 16: None}}
    stored = json.loads(shipped.read_text())["shapes"][KEY]["1"]["timings_us"]
    assert stored["cublas"] == 12.0


def test_the_gpu_checks_startup_step_writes_a_table_to_ship(tmp_path, monkeypatch):
    """`bench_gemv.py --startup` (gpu_check's gemv_startup) with the GPU faked: both
    quantizations of a preset routed as a start routes them, every shape measured whatever
    is shipped, the table with its timings written for --ship, and the report."""
    import argparse
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import bench_gemv

    real_route = gemv_routing.route_gemv
    timer = FakeTimer(50.0)

    def route_on_a_fake_gpu(model, settings, rows, progress=None):
        return real_route(model, settings, rows, progress, measure=timer,
                          cache=tmp_path / "cache", gpu=GPU)

    monkeypatch.setattr(gemv_routing, "route_gemv", route_on_a_fake_gpu)
    monkeypatch.setattr(gemv_tuning, "cache_path",
                        lambda fields, directory=None: tmp_path / "cache" / "timings.json")
    args = argparse.Namespace(models="random:tiny", quantizations="none,fp8", rows="1,4",
                              dtype="float32", install=False,
                              copy_to=tmp_path / "table.json", json=tmp_path / "report.json")
    bench_gemv.startup(args, torch.device("cpu"), H100)
    table = launch_config.parse_table(json.loads(args.copy_to.read_text()))
    assert "n512-k64-float32" in table and "n128-k64-float8_e4m3fn" in table
    assert all(set(rows) == {1, 4} for rows in table.values())
    report = json.loads(args.json.read_text())
    assert [(r["model"], r["quantization"]) for r in report["runs"]] == [
        ("random:tiny", "none"), ("random:tiny", "fp8")]
    assert report["runs"][1]["shapes"]["n128-k64-float8_e4m3fn"]["1"]["timings_us"]["cublas"] \
        == 50.0
    # A preset that never finishes (gpu_check kills the step at its limit; here it
    # raises) loses only itself: what the earlier ones measured is written already.
    args.copy_to.unlink()
    args.json.unlink()
    args.models = "random:tiny,random:no-such-preset"
    args.quantizations = "none"
    with pytest.raises(Exception):
        bench_gemv.startup(args, torch.device("cpu"), H100)
    assert "n512-k64-float32" in launch_config.parse_table(json.loads(args.copy_to.read_text()))
    assert [r["model"] for r in json.loads(args.json.read_text())["runs"]] == ["random:tiny"]
    assert launch_config.TABLE_DIR == tmp_path / "shipped"  # (the fixture's, restored)


def test_a_draft_model_is_routed_like_the_target(tmp_path, monkeypatch):
    """--speculative-method draft on a CPU engine routed as on a GPU (fake facts and
    timer, the GEMV faster everywhere): the draft model's own projection shapes are
    timed at every bucket its eager forwards take, and its projections take the op as
    the target's do; greedy tokens as with --gemv cublas."""
    from llmfast import SamplingParams
    from llmfast.engine.llm_engine import LLMEngine
    from llmfast.worker.startup import runner_startup
    from tests.helpers.checkpoints import make_hf_checkpoint
    from tests.helpers.engine_config import engine_config
    from tests.helpers.full_graphs import run_with_arrivals

    draft = make_hf_checkpoint(tmp_path / "draft", vocab_size=512, hidden_size=32,
                               num_attention_heads=2, num_key_value_heads=1,
                               intermediate_size=96, num_hidden_layers=1)
    timer = FakeTimer(10.0, triton=5.0)

    def route_as_on_a_gpu(model, settings, rows, progress=None):
        return gemv_routing.route_gemv(model, settings, rows, progress, measure=timer,
                                       cache=tmp_path / "cache", gpu=GPU)

    monkeypatch.setattr(runner_startup, "route_gemv", route_as_on_a_gpu)
    outputs = {}
    for backend in ("auto", "cublas"):
        config, source = engine_config(EngineArgs(
            model="random:tiny", device="cpu", enforce_eager=True, max_model_len=64,
            gemv=backend, speculative_method="draft", speculative_model=str(draft),
            num_speculative_tokens=2))
        engine = LLMEngine(config, source)
        proposer = engine.runner.spec.proposer
        want = "auto" if backend == "auto" else ""
        assert set(_backends(engine.runner.model).values()) == {want}
        assert set(_backends(proposer.model).values()) == {want}
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        outputs[backend] = run_with_arrivals(engine, [[5, 6, 7]], [params], [0])
    # The draft's shapes (hidden 32: qkv n64-k32, gate_up n192-k32, ...) at every bucket.
    draft_keys = {key for key, _, _ in timer.calls if "-k32-" in key or "n32-" in key}
    assert draft_keys == {"n64-k32-float32", "n32-k32-float32", "n192-k32-float32",
                          "n32-k96-float32", "n512-k32-float32"}
    assert {rows for key, rows, _ in timer.calls if key in draft_keys} == {1, 2, 4, 8, 16}
    assert outputs["auto"] == outputs["cublas"]
