"""Which kernel a skinny projection takes (kernels/gemv/launch_config.py): M buckets, the
heuristic's split-K, the shipped table's lookup and its file format, cuBLAS kept above
16 rows and where the table says so, the --gemv backends; the op's registration, fake
impl and compile; a layer's routing in its trace; and the CPU path, which never takes the
GEMV."""

from __future__ import annotations

import json

import pytest
import torch

from llmfast.kernels.gemv import launch_config, ops
from llmfast.kernels.gemv.launch_config import (
    MAX_GEMV_ROWS,
    GemvConfig,
    choose,
    heuristic_config,
    m_bucket,
    parse_table,
    shape_key,
    table_entry,
    table_json,
)

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    """A tables/ directory of the test's own; the cache of parsed tables emptied."""
    monkeypatch.setattr(launch_config, "TABLE_DIR", tmp_path)
    launch_config.shipped_table.cache_clear()
    yield tmp_path
    launch_config.shipped_table.cache_clear()


def _write(table_dir, device: str, shapes: dict) -> None:
    data = table_json(device, shapes)
    (table_dir / f"{launch_config.device_slug(device)}.json").write_text(json.dumps(data))


def test_m_buckets():
    assert [m_bucket(m) for m in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8


def test_shape_key_names_weight_and_fusion():
    assert shape_key(3072, 2048, "bfloat16") == "n3072-k2048-bfloat16"
    assert shape_key(8192, 2048, "float8_e4m3fn", ops.fusion_name(True, True, False)) == \
        "n8192-k2048-float8_e4m3fn-norm-silu_mul"
    assert ops.fusion_name(False, False, True) == "residual"


@pytest.mark.parametrize(("rows", "n", "k", "sms"), [
    (1, 2048, 8192, 132),  # Llama-3.2-1B down_proj
    (1, 3072, 2048, 132),  # its qkv
    (1, 128256, 2048, 132),  # its lm_head: columns alone fill the SMs
    (4, 4096, 14336, 78),  # Llama-3.1-8B down_proj on a smaller GPU
    (16, 1024, 4096, 132),
])
def test_heuristic_fills_the_sms_within_the_k_limit(rows, n, k, sms):
    """Split K until ~4 programs per SM, never below 4 BLOCK_K steps per range; tl.dot
    only at 16 rows; powers of two throughout."""
    config = heuristic_config(rows, n, k, sms)
    programs = -(-n // config.block_n) * config.split_k
    assert config.dot == (m_bucket(rows) == 16)
    assert k // config.split_k >= 4 * config.block_k or config.split_k == 1
    # Either enough programs, or one more split would make ranges too short.
    assert programs >= 4 * sms or k // (2 * config.split_k) < 4 * config.block_k
    if n >= 4 * sms * config.block_n:
        assert config.split_k == 1
    assert heuristic_config(1, 2048, 8192, 132).split_k == 8  # the docstring's example


def test_heuristic_fp8_reads_wider_k_steps():
    assert heuristic_config(1, 2048, 8192, 132, fp8=True).block_k == \
        2 * heuristic_config(1, 2048, 8192, 132).block_k


def test_config_check_rejects_bad_tiles():
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(block_n=24, block_k=32).check()
    with pytest.raises(ValueError, match="tl.dot"):
        GemvConfig(block_n=8, block_k=32, dot=True).check()


def test_table_entry_takes_the_smallest_bucket_at_or_above():
    a, b = GemvConfig(16, 256), GemvConfig(32, 128, dot=True)
    rows = {1: a, 4: None, 16: b}
    assert table_entry(rows, 1) == (True, a)
    assert table_entry(rows, 2) == (True, None)  # the 4 bucket: cuBLAS
    assert table_entry(rows, 8) == (True, b)
    assert table_entry({1: a}, 16) == (False, None)
    assert table_entry({}, 1) == (False, None)


def test_table_round_trips_and_rejects_bad_files(table_dir):
    shapes = {"n3072-k2048-bfloat16": {1: (GemvConfig(16, 256, split_k=2), {"triton": 9.5,
                                                                             "cublas": 12.0}),
                                       16: (None, {"triton": 20.0, "cublas": 14.0})}}
    data = table_json(H100, shapes)
    assert data["shapes"]["n3072-k2048-bfloat16"]["16"]["backend"] == "cublas"
    assert parse_table(json.loads(json.dumps(data))) == {
        "n3072-k2048-bfloat16": {1: GemvConfig(16, 256, split_k=2), 16: None}}
    for bad in ({**data, "format": 99},
                {**data, "shapes": {"x": {"3": {"backend": "cublas"}}}},
                {**data, "shapes": {"x": {"1": {"backend": "magic"}}}},
                {**data, "shapes": {"x": {"1": {"backend": "triton", "block_n": 12,
                                                "block_k": 32}}}}):
        with pytest.raises(ValueError):
            parse_table(bad)
    # A bad shipped file is ignored (logged), not fatal.
    (table_dir / f"{launch_config.device_slug(H100)}.json").write_text("{not json")
    assert launch_config.shipped_table(H100) == {}


def test_choose(table_dir):
    key = "n2048-k8192-bfloat16"
    tuned = GemvConfig(16, 256, split_k=4)
    _write(table_dir, H100, {key: {1: (tuned, {}), 8: (None, {})}})

    def pick(rows, backend, device=H100, k=key):
        return choose(rows, 2048, 8192, k, device, 132, backend)

    assert pick(1, "auto").config == tuned and pick(1, "auto").source == "table"
    assert pick(5, "auto").config is None  # the 8 bucket: cuBLAS measured faster
    assert pick(1, "triton").config == tuned  # the table's Triton config
    # triton: Triton always, the heuristic's where the table says cuBLAS or nothing.
    assert pick(5, "triton").config == heuristic_config(5, 2048, 8192, 132)
    assert pick(16, "auto").config is None and pick(16, "auto").source == "no table entry"
    assert pick(16, "triton").config == heuristic_config(16, 2048, 8192, 132)
    other = "n4096-k4096-bfloat16"
    assert pick(1, "auto", k=other).config is None  # no entry: cuBLAS by default
    assert pick(1, "auto", device="NVIDIA H200").config is None  # no table for this GPU
    # Batch 64-512 (and anything past 16 rows) keep cuBLAS whatever the table or backend.
    for rows in (MAX_GEMV_ROWS + 1, 64, 512):
        for backend in ("auto", "triton"):
            assert pick(rows, backend).config is None and pick(rows, backend).source == "rows"
    assert pick(1, "cublas").source == "off" and pick(1, "cublas").config is None
    assert pick(3, "auto", device=None).config == launch_config.INTERPRETER_CONFIG


# ------------------------------------------------------------------ the op


def _args(rows: int, silu_mul: bool = False, fused: bool = True):
    g = torch.Generator().manual_seed(rows)
    n, k = 24, 40
    x = torch.randn(rows, k, generator=g)
    weight = torch.randn(2 * n if silu_mul else n, k, generator=g)
    norm = torch.rand(k, generator=g) + 0.5 if fused else None
    residual = torch.randn(rows, n, generator=g) if fused else None
    return (x, weight, None, None, norm, residual, 1e-5, silu_mul, None, "auto")


def test_op_registered_and_passes_opcheck():
    assert hasattr(torch.ops.llmfast, "skinny_linear")
    for silu_mul in (False, True):
        torch.library.opcheck(torch.ops.llmfast.skinny_linear.default, _args(3, silu_mul))
        torch.library.opcheck(torch.ops.llmfast.skinny_linear.default,
                              _args(1, silu_mul, fused=False))


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        for silu_mul, n in ((False, 24), (True, 24)):
            args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                    for a in _args(5, silu_mul)]
            out = torch.ops.llmfast.skinny_linear(*args)
            assert tuple(out.shape) == (5, n) and out.dtype == torch.float32


def test_op_compiles_with_an_unbacked_token_count():
    """One graph for every token count (the engine's compile), no graph break; its
    results those of the torch form."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    def f(x, weight, norm, residual):
        return ops.linear(x, weight, norm_weight=norm, residual=residual, eps=1e-5) * 2

    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for rows in (1, 7, 33):
        x, weight, _, _, norm, residual, *_ = _args(rows)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        torch._dynamo.decorators.mark_unbacked(residual, 0)
        want = ops.skinny_linear_torch(x, weight, norm_weight=norm, residual=residual,
                                       eps=1e-5) * 2
        torch.testing.assert_close(compiled(x, weight, norm, residual), want)
    assert counter.frame_count == 1


def test_a_layers_routing_decides_its_trace():
    """`gemv_backend` is a plain attribute Dynamo reads as a constant: a routed Linear
    records the op in the graph (with its backend), an unrouted one does not; both give
    the torch form's result on the CPU."""
    from llmfast.kernels.cpu.linear import Linear

    layer = Linear(40, 24)
    x = torch.randn(3, 40)
    for backend in ("", "triton"):
        layer.gemv_backend = backend
        graphs = []

        def keep(gm, inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        out = torch.compile(layer, backend=keep, fullgraph=True)(x)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight,
                                                                   layer.bias))
        ops_called = [n for n in graphs[0].graph.nodes if "skinny_linear" in str(n.target)]
        assert len(ops_called) == (1 if backend else 0)
        if backend:
            assert ops_called[0].args[-1] == "triton"


def test_cpu_never_takes_the_gemv(monkeypatch):
    """CPU tensors (no interpreter): the choice is torch's whatever the backend, and a
    Linear runs as before."""
    from llmfast.kernels.cpu.linear import Linear

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def boom(*args, **kwargs):
        raise AssertionError("the GEMV ran on the CPU")

    monkeypatch.setattr(ops, "gemv_triton", boom)
    x = torch.randn(2, 40)
    layer = Linear(40, 24)
    assert layer.gemv_backend == ""
    for backend in ("auto", "triton"):
        assert ops.choice_for(x, layer.weight, False, False, False, backend).source == "cpu"
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight))
    args = _args(2)
    torch.testing.assert_close(ops.skinny_linear(*args[:8]),
                               ops.skinny_linear_torch(*args[:8]))


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 2048, 8192), (4, 3072, 2048),
                                              (16, 128256, 2048), (2, 40, 96)])
def test_tuning_candidates_are_valid_and_hold_the_heuristic(rows, n, k):
    candidates = launch_config.tuning_candidates(rows, n, k, 132)
    assert candidates[0] == heuristic_config(rows, n, k, 132)
    assert 1 < len(candidates) <= 25 and len(set(candidates)) == len(candidates)
    for c in candidates:
        c.check()
        assert c.dot == (m_bucket(rows) == 16)
        assert c.split_k == 1 or k // c.split_k >= c.block_k  # no empty K ranges


def test_tune_script_writes_a_table_the_engine_reads(tmp_path):
    """scripts/bench_gemv.py --tune under the interpreter (the plumbing: timing on a
    CPU means nothing): every shape and bucket gets a winner, in a table that parses;
    --install merges into the shipped directory's file for the device."""
    import os
    import subprocess
    import sys

    table = tmp_path / "table.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run(
        [sys.executable, "scripts/bench_gemv.py", "--models", "", "--shape", "40,48",
         "--rows", "1,3", "--tune", "--iters", "1", "--dtype", "float32",
         "--copy-to", str(table), "--json", str(tmp_path / "out.json")],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    parsed = parse_table(json.loads(table.read_text()))
    assert set(parsed) == {"n40-k48-float32"} and set(parsed["n40-k48-float32"]) == {1, 4}
    out = json.loads((tmp_path / "out.json").read_text())
    assert [r["rows"] for r in out["rows"]] == [1, 3]
    assert all(r["cublas"]["us"] > 0 and len(r["timings_us"]) > 2 for r in out["rows"])


def test_gemv_refuses_more_rows_than_a_program_holds():
    with pytest.raises(ValueError, match="at most 16 rows"):
        ops.gemv_triton(torch.zeros(17, 8), torch.zeros(4, 8), GemvConfig(16, 32))
