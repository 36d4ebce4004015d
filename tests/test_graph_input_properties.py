"""Every tensor a graph is handed, at its capture and at every later step, on the CUDA
default's path run on the CPU (emulated full and piecewise graphs, RoPE in the attention
op, async scheduling, device views apart from the host views, the CUDA start-up order).

A real CUDA graph replays on what it captured: an input it is handed at a replay with
another address, shape, stride or offset than at its capture is silently not what the
graph reads. And Dynamo guards the compiled model's inputs on their dtype, device, rank,
strides, dispatch keys, inference-ness and requires_grad: an input made differently for a
capture than for the steps (84c6757: the full graphs' host max_query_len, an inference
tensor) recompiles the model inside the capture, which fails on a GPU. The emulation on
the CPU tolerates both, so this test records the inputs at three seams (the compiled
model's call, the piecewise graphs' capture and replay check, the full graphs' capture
and replay) and compares them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from collections.abc import Iterator

import pytest
import torch

from llmfast import SamplingParams
from llmfast.attention.metadata import EAGER_ONLY
from llmfast.compile.compiled_model import CompiledModel
from llmfast.config import CudaGraphMode
from llmfast.cuda_graphs.full import FullGraphRunner
from llmfast.cuda_graphs.piecewise import PiecewiseGraphRunner
from llmfast.worker import buffers, model_runner
from tests.test_device_views import _separate_device_views
from tests.helpers.full_graphs import (
    arrival_workload,
    cuda_start_up_order,
    emulated_graph_engine,
    rope_in_the_op,
    run_with_arrivals,
)

# What Dynamo guards on an input whose sizes vary between calls (marked unbacked): the
# compiled model's inputs must agree on these at every call, captures included.
GUARDED = ("dtype", "device", "ndim", "stride", "dispatch_keys", "is_inference",
           "requires_grad")


def tensor_properties(t: torch.Tensor) -> dict:
    return {"dtype": t.dtype, "device": t.device, "ndim": t.dim(), "shape": tuple(t.shape),
            "stride": t.stride(), "storage_offset": t.storage_offset(),
            "dispatch_keys": repr(torch._C._dispatch_keys(t)),
            "is_inference": t.is_inference(), "requires_grad": t.requires_grad,
            "data_ptr": t.data_ptr()}


def _properties(value):
    return tensor_properties(value) if isinstance(value, torch.Tensor) else value


def _differences(then, now, keys=None) -> dict:
    """{property: (then, now)} where the two records differ (`keys`: only those)."""
    if not isinstance(then, dict) or not isinstance(now, dict):
        return {} if then == now else {"value": (then, now)}
    return {k: (then[k], now[k]) for k in (keys or then) if then[k] != now[k]}


class GraphInputRecorder:
    """Records the inputs at each seam and checks them as they come (a mismatch raises at
    once, before Dynamo could recompile, and is also kept in `mismatches`)."""

    def __init__(self, monkeypatch) -> None:
        self.reset()
        self._patch(monkeypatch)

    def reset(self) -> None:
        """Forget what was recorded (before another engine starts)."""
        self.mismatches: list[str] = []
        self.phase = "start-up"
        self.compiled_calls: list[tuple[str, dict]] = []  # (phase, name -> properties)
        self.first_call: dict | None = None
        self._captured: dict[int, tuple[object, list]] = {}  # id(graph) -> (graph, inputs)
        self.piecewise_replays_checked = 0
        self.full_replays_checked = 0

    def _fail(self, message: str) -> None:
        self.mismatches.append(message)
        raise AssertionError(message)

    def _patch(self, monkeypatch) -> None:
        rec = self
        compiled_call = CompiledModel.__call__

        def call(self, input_ids, positions, md):
            rec._compiled_call(self, input_ids, positions, md)
            return compiled_call(self, input_ids, positions, md)

        capture_piece = PiecewiseGraphRunner._capture

        def capture(self, num_tokens, args):
            out = capture_piece(self, num_tokens, args)
            graph = self.graphs[num_tokens]
            rec._captured[id(graph)] = (graph, [_properties(a) for a in args])
            return out

        check_piece = PiecewiseGraphRunner._check_addresses

        def check(self, num_tokens, graph, args):  # called before each piecewise replay
            rec._piecewise_replay(self, num_tokens, graph, args)
            return check_piece(self, num_tokens, graph, args)

        capture_full = FullGraphRunner.capture

        def full_capture(self, size, fn, inputs):
            with rec._in_phase(f"full graph {size} capture"):
                capture_full(self, size, fn, inputs)
            graph = self.graphs[size]
            rec._captured[id(graph)] = (graph, [tensor_properties(t) for t in inputs])

        replay_full = FullGraphRunner.replay

        def full_replay(self, size, inputs=()):
            rec._full_replay(self.graphs[size], size, inputs)
            with rec._in_phase(f"full graph {size} replay"):  # (the emulation re-runs it)
                return replay_full(self, size, inputs)

        execute_async = model_runner.ModelRunner.execute_async
        steps = itertools.count()

        def execute(self, out):
            with rec._in_phase(f"step {next(steps)}"):
                return execute_async(self, out)

        monkeypatch.setattr(CompiledModel, "__call__", call)
        monkeypatch.setattr(PiecewiseGraphRunner, "_capture", capture)
        monkeypatch.setattr(PiecewiseGraphRunner, "_check_addresses", check)
        monkeypatch.setattr(FullGraphRunner, "capture", full_capture)
        monkeypatch.setattr(FullGraphRunner, "replay", full_replay)
        monkeypatch.setattr(model_runner.ModelRunner, "execute_async", execute)

    @contextlib.contextmanager
    def _in_phase(self, phase: str) -> Iterator[None]:
        """Names the calls within (for the messages, and the persistence check)."""
        before = self.phase
        self.phase = phase if before == "start-up" else f"{before}, {phase}"
        try:
            yield
        finally:
            self.phase = before

    def _compiled_call(self, compiled: CompiledModel, input_ids, positions, md) -> None:
        inputs = {"input_ids": input_ids, "positions": positions}
        # (Fields marked EAGER_ONLY, the eager CPU paths' per-step memo, are no graph's
        # input: the compiled model never reads them.)
        inputs.update({f"md.{f.name}": getattr(md, f.name) for f in dataclasses.fields(md)
                       if not f.metadata.get(EAGER_ONLY)})
        for i, layer in enumerate(compiled.model.attention_layers()):
            inputs[f"layer{i}.k_cache"], inputs[f"layer{i}.v_cache"] = (layer.k_cache,
                                                                         layer.v_cache)
        props = {name: _properties(value) for name, value in inputs.items()}
        state = compiled.graphs.piecewise
        phase = self.phase
        if state is not None and state.capturing_size is not None:
            phase += f", piecewise graphs {state.capturing_size} capture"
        if state is not None and state.in_full_graph and "full graph" not in phase:
            phase += ", full graph warm-up"  # (the run before a capture)
        self.compiled_calls.append((phase, props))
        if self.first_call is None:
            self.first_call = props
            return
        assert props.keys() == self.first_call.keys(), phase
        for name, now in props.items():
            diff = _differences(self.first_call[name], now, GUARDED)
            if diff:
                self._fail(f"compiled model input {name} at {phase} differs from the "
                           f"first call's (a Dynamo recompile): {diff}")

    def _piecewise_replay(self, runner: PiecewiseGraphRunner, num_tokens: int, graph,
                          args) -> None:
        captured = self._captured[id(graph)][1]
        assert len(args) == len(captured)
        for i, (then, arg) in enumerate(zip(captured, args)):
            if not isinstance(arg, torch.Tensor):
                # A size (request count, blocks per request, the cache's block count):
                # the pieces check them in host-side asserts only, which a replay does
                # not run, so they may change; the token count is the graph's key.
                diff = {} if type(arg) is type(then) else {"type": (then, arg)}
            else:
                # The data a piece reads: as captured in every respect. Tensors Dynamo
                # hands it only for size checks (KV caches, metadata) may move and
                # resize (the graph never reads them): their kind only.
                keys = None if i in runner.data_args else GUARDED
                diff = _differences(then, tensor_properties(arg), keys)
            if diff:
                self._fail(f"piece {runner.index} argument {i} at {self.phase} (piecewise "
                           f"graph {num_tokens} replay) differs from its capture: {diff}")
        self.piecewise_replays_checked += 1

    def _full_replay(self, graph, size: int, inputs) -> None:
        captured = self._captured[id(graph)][1]
        assert len(inputs) == len(captured) > 0  # the runner lists them (debug checks)
        for i, (then, t) in enumerate(zip(captured, inputs)):
            diff = _differences(then, tensor_properties(t))
            if diff:
                self._fail(f"full graph {size} input {i} at {self.phase} differs from its "
                           f"capture: {diff}")
        self.full_replays_checked += 1


def _separate_zeroed_device_views(monkeypatch) -> None:
    """The persistent buffers' device views apart from their host views
    (test_device_views.py), zeroed as CUDA allocates them (`torch.zeros_like`): the
    start-up's dummy runs (the captures') read block 0 from the block table's device
    view, which nothing has copied to yet."""
    _separate_device_views(monkeypatch)
    separate_init = buffers.CpuGpuBuffer.__init__

    def zeroed_init(self, *shape, dtype, device):
        separate_init(self, *shape, dtype=dtype, device=device)
        self.gpu.zero_()

    monkeypatch.setattr(buffers.CpuGpuBuffer, "__init__", zeroed_init)


@pytest.mark.parametrize("pieces", [
    # The pieces run as traced (Inductor's code is not what is checked: its inputs are).
    "eager",
    # ~35 s: Inductor's pieces, and a second start that loads the first one's saved
    # split graph instead of tracing (compile/precompiled.py).
    pytest.param("inductor", marks=pytest.mark.slow),
])
def test_graph_inputs_at_every_replay_are_those_of_their_capture(ckpt, monkeypatch,
                                                                 tmp_path, pieces):
    _separate_zeroed_device_views(monkeypatch)
    rope_in_the_op(monkeypatch, tmp_path)  # max_query_len a graph input; a cold trace
    cuda_start_up_order(monkeypatch)
    if pieces == "eager":
        monkeypatch.setattr(model_runner, "CompiledModel",
                            functools.partial(CompiledModel, piece_compiler="eager"))
    rec = GraphInputRecorder(monkeypatch)
    for warm in (False, True) if pieces == "inductor" else (False,):
        rec.reset()
        engine = emulated_graph_engine(ckpt, CudaGraphMode.FULL_AND_PIECEWISE)
        assert engine.runner.compiled.stats.precompiled == warm
        _check_a_run(engine, rec)


def _check_a_run(engine, rec: GraphInputRecorder) -> None:
    runner, compiled = engine.runner, engine.runner.compiled
    assert compiled.graphs.full.sizes == (1, 2, 4)  # captured once, on the real cache
    engine.set_async_scheduling(True)
    prompts, lengths, arrivals = arrival_workload()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    run_with_arrivals(engine, prompts, params, arrivals)

    assert not rec.mismatches
    # Every replay of both kinds went through the checks, and the steps used both.
    assert rec.full_replays_checked == compiled.graphs.full.num_replays > 0
    assert rec.piecewise_replays_checked == compiled.graphs.piecewise.num_replays > 0
    assert any(p.startswith("step") and "full" not in p for p, _ in rec.compiled_calls)
    assert compiled.stats.one_graph  # no recompile anywhere (one trace, or a load)
    # The compiled model read the persistent buffers at every call (their device views,
    # from their first element); the steps' host max_query_len is the runner's one tensor.
    table = runner.input_batch.block_table
    persistent = {"input_ids": runner.input_ids, "positions": runner.positions,
                  "md.slot_mapping": table.slot_mapping, "md.block_table": table.table,
                  "md.query_start_loc": runner.query_start_loc,
                  "md.seq_lens": runner.seq_lens}
    for phase, props in rec.compiled_calls:
        for name, buf in persistent.items():
            assert props[name]["data_ptr"] == buf.gpu.data_ptr(), (phase, name)
            assert props[name]["storage_offset"] == 0, (phase, name)
        if "full graph" not in phase:
            assert props["md.max_query_len"]["data_ptr"] == \
                runner.inputs.max_query_len.data_ptr(), phase
