"""The skinny GEMM (kernels/gemv/) on CUDA: the heuristic's launches at the 1B and 8B
presets' projection shapes, each fusion and fp8 weights, against the float64 oracle and
its bound (tests/helpers/gemv.py); split-K inside a CUDA graph; the op compiled by
Inductor with an unbacked token count; the fused decoder against the plain one; the
start-up measurement (--gemv auto) with its real timer and file.

Marked gpu (deselected by default); run on a CUDA machine with `python -m pytest -m gpu tests/test_gemv_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from llmfast.kernels.gemv import launch_config, ops
from llmfast.kernels.gemv.launch_config import heuristic_config
from tests.helpers.gemv import assert_within, oracle, random_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# (N, K) of random:llama-3.2-1b's qkv, o, gate_up, down and random:llama-3.1-8b's down.
SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (4096, 14336)]


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _cuda(inputs: dict) -> dict:
    return {k: v.cuda() for k, v in inputs.items()}


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_heuristic_launch_matches_float64(n, k, rows):
    inputs = random_inputs(rows, n, k, torch.bfloat16, seed=rows)
    config = heuristic_config(rows, n, k, _sms())
    got = ops.gemv_triton(inputs["x"].cuda(), inputs["weight"].cuda(), config)
    assert_within(got.cpu(), oracle(inputs["x"], inputs["weight"], torch.bfloat16),
                  torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("fusion", ["norm", "silu_mul", "residual", "norm_silu_mul", "fp8"])
def test_fusions_at_1b_shapes(fusion, rows):
    silu_mul = "silu" in fusion
    n, k = (8192, 2048) if silu_mul else (2048, 8192) if fusion == "residual" else (3072, 2048)
    inputs = random_inputs(rows, n, k, torch.bfloat16, seed=7, silu_mul=silu_mul)
    kwargs = {}
    if "norm" in fusion:
        kwargs["norm_weight"] = inputs["norm_weight"]
    if fusion == "residual":
        kwargs["residual"] = inputs["residual"]
    weight, scale = inputs["weight"], None
    if fusion == "fp8":
        from llmfast.kernels.fp8_linear import quantize_weight

        weight, scale = quantize_weight(weight.float())
    config = heuristic_config(rows, n, k, _sms(), fp8=scale is not None)
    got = ops.gemv_triton(inputs["x"].cuda(), weight.cuda(), config,
                          weight_scale=None if scale is None else scale.cuda(), eps=1e-5,
                          silu_mul=silu_mul, **{a: b.cuda() for a, b in kwargs.items()})
    want = oracle(inputs["x"], weight, torch.bfloat16, weight_scale=scale, silu_mul=silu_mul,
                  **kwargs)
    assert_within(got.cpu(), want, torch.bfloat16)


def test_split_k_in_a_cuda_graph():
    """Both kernels captured; replays on new inputs in the same buffers match eager."""
    inputs = _cuda(random_inputs(2, 2048, 8192, torch.bfloat16, seed=3))
    config = launch_config.GemvConfig(16, 256, split_k=8)
    x = inputs["x"]
    out = ops.gemv_triton(x, inputs["weight"], config, residual=inputs["residual"])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.gemv_triton(x, inputs["weight"], config, residual=inputs["residual"])
    x.normal_()
    graph.replay()
    torch.cuda.synchronize()
    want = ops.gemv_triton(x, inputs["weight"], config, residual=inputs["residual"])
    assert torch.equal(captured, want) and not torch.equal(captured, out)


def test_op_under_inductor_with_an_unbacked_token_count():
    """--gemv triton: up to 16 rows the GEMV inside the compiled graph, past them
    cuBLAS; results within the oracle's bound either way."""
    compiled = torch.compile(
        lambda x, w, norm: ops.linear(x, w, norm_weight=norm, eps=1e-5, backend="triton")
        + 1.0, fullgraph=True)
    for rows in (1, 5, 16, 40):
        inputs = random_inputs(rows, 3072, 2048, torch.bfloat16, seed=rows)
        x = inputs["x"].cuda()
        torch._dynamo.decorators.mark_unbacked(x, 0)
        got = compiled(x, inputs["weight"].cuda(), inputs["norm_weight"].cuda()) - 1.0
        want = oracle(inputs["x"], inputs["weight"], torch.bfloat16,
                      norm_weight=inputs["norm_weight"])
        # (+1 and -1 in bf16: one rounding more each way)
        assert_within(got.cpu(), (want[0], want[1] + 2 * 2.0**-7 * (want[0].abs() + 1)),
                      torch.bfloat16)


def _llama_1b_two_layers():
    import dataclasses

    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model

    source = resolve_model("random:llama-3.2-1b")
    source = dataclasses.replace(source, config=dataclasses.replace(source.config,
                                                                    num_hidden_layers=2))
    return build_model(source, torch.bfloat16, "cuda", max_positions=256)


def _decode_batch(model, rows: int):
    from tests.helpers.static_buffers import StaticBatch

    static = StaticBatch(model, rows, 128, max_num_tokens=rows)
    for k_cache, v_cache in static.caches:
        k_cache.normal_()
        v_cache.normal_()
    pos = 99
    static.input_ids[:rows] = torch.arange(1, rows + 1)
    static.positions[:rows] = pos
    static.slot_mapping[:rows] = static.block_table[:rows, pos // 16].long() * 16 + pos % 16
    static.table[:rows].copy_(static.block_table[:rows])
    static.query_start_loc[:rows + 1] = torch.arange(rows + 1, dtype=torch.int32)
    static.seq_lens[:rows] = pos + 1
    return static


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_fused_decoder_close_to_plain_on_llama_1b_shapes(rows):
    """random:llama-3.2-1b with 2 layers: the fused layers' last hidden states against
    the plain layers' on the same decode batch, bf16 (different roundings of the same
    sums: a few % of the scale two layers deep); both routed --gemv triton."""
    from llmfast.config import SkinnyLinearConfig
    from llmfast.worker.startup.gemv_routing import route_gemv

    model = _llama_1b_two_layers()
    static = _decode_batch(model, rows)
    outs = {}
    for fused in (False, True):
        route_gemv(model, SkinnyLinearConfig("triton", fused), range(1, 17))
        assert model.model.gemv_fused == ("triton" if fused else "")
        outs[fused] = static.run(model.model, rows, rows, max_query_len=1).float()
    err = (outs[True] - outs[False]).abs().max().item()
    assert err <= 5e-2 * outs[False].abs().max().item()


def test_startup_measurement_times_keeps_and_reuses(tmp_path, monkeypatch):
    """--gemv auto on this GPU (no shipped entry: the test's own empty tables): every
    projection shape timed at buckets 1 and 4 by the real timer (CUDA graphs, events),
    each candidate compiled in threads before (its timing compiles nothing at a launch),
    the file written; a second routing reads it and times nothing; the routed model's
    decode step stays close to cuBLAS's."""
    import json

    from llmfast.config import SkinnyLinearConfig
    from llmfast.worker.startup import gemv_tuning
    from llmfast.kernels.launch.compile_watch import TritonCompileWatch
    from llmfast.worker.startup.gemv_routing import model_launches, route_gemv

    model = _llama_1b_two_layers()
    static = _decode_batch(model, 4)
    plain = static.run(model.model, 4, 4, max_query_len=1).float()
    keys = {launch.key for _, launch in model_launches(model, fused=False)}
    calls, compiled_at_launch = [], []
    time_on_cuda = gemv_tuning.time_on_cuda

    def timer(launches, rows, config):  # the real timer, watched
        calls.append((launches[0].key, rows))
        with TritonCompileWatch() as watch:
            us = time_on_cuda(launches, rows, config)
        compiled_at_launch.extend(c.name for c in watch.compiles)
        return us

    # The start-up's own path (no `measure` passed): the candidates compile ahead.
    monkeypatch.setattr(gemv_tuning, "time_on_cuda", timer)
    monkeypatch.setattr(launch_config, "TABLE_DIR", tmp_path / "no-shipped-tables")
    monkeypatch.setattr(launch_config, "_MEASURED", {})
    launch_config.shipped_table.cache_clear()
    try:
        routing = route_gemv(model, SkinnyLinearConfig("auto"), (1, 4), cache=tmp_path)
        assert set(routing.measured) == keys and {r for _, r in calls} == {1, 4}
        assert compiled_at_launch == []
        (path,) = tmp_path.glob("*.json")
        table = launch_config.parse_table(json.loads(path.read_text()))
        assert set(table) == keys and all(set(rows) == {1, 4} for rows in table.values())
        print(json.dumps(json.loads(path.read_text())["shapes"], indent=1))
        calls.clear()
        again = route_gemv(model, SkinnyLinearConfig("auto"), (1, 4), cache=tmp_path)
        assert calls == [] and again.routed == routing.routed
        routed = static.run(model.model, 4, 4, max_query_len=1).float()
        assert (routed - plain).abs().max().item() <= 5e-2 * plain.abs().max().item()
    finally:
        launch_config.shipped_table.cache_clear()
        ops.forget_choices()
