"""The CPU stand-in for tests/test_async_gpu.py's sync-debug check: a steady-state engine
step calls no op that would make the host wait for a CUDA device.

On the GPU, `torch.cuda.set_sync_debug_mode("error")` catches every synchronisation; CI
has no GPU, so this records the ops a step dispatches (a TorchDispatchMode) and refuses
those that synchronise whatever the device: reading a value on the host (`.item()`,
`bool(t)`, `int(t)`), ops whose output shape depends on the data (`nonzero`, boolean-
mask indexing, `masked_select`, `unique`), and tensors made from Python data per step
(`torch.tensor(list)`: on CUDA a copy from pageable memory). It cannot see device-to-host
copies (`.cpu()`, `.tolist()` are no-ops on CPU); the GPU test does. Also checked: no
tensor is allocated per step outside the sampler (the inputs go to persistent buffers).

What runs under the recorder is what the runner shares with CUDA: state updates, input
preparation (with full decode graphs, emulated on CPU, their padded static inputs too),
sampling metadata, the placeholder fill of async scheduling, the lm_head and the sampler
with every stage on. Left out: the decoder's forward and a full graph's replay (on CPU
they run the CPU attention and KV write, not the CUDA ones), and the one designated wait
for the sampled ids (`PendingStep.wait`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import llmfast
from llmfast import SamplingParams
from llmfast.config import CudaGraphMode
from llmfast.engine import LLMEngine
from llmfast.engine.args import EngineArgs
from llmfast.worker.step_output import PendingStep
from tests.test_async_gpu import _mixed_params
from tests.helpers.engine_config import engine_config

# Ops that make the host wait for the device's result, on any device.
HOST_SYNCING = {
    "aten::_local_scalar_dense",  # .item(), bool(t), int(t), float(t)
    "aten::is_nonzero",  # bool(t), `if t:`
    "aten::equal",
    "aten::allclose",
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
}
# torch.tensor(python list): on CUDA a copy from pageable memory. A Python scalar put
# into a tensor (`t[:, -1] = False`) is lifted too, as a 0-d tensor, but a 0-d CPU
# tensor is passed to CUDA by value: not refused.
FROM_PYTHON_DATA = "aten::lift_fresh"


# Ops that make a new tensor from nothing (a copy or concatenation is an op's result,
# not counted): per step, only the sampler's [rows, vocab] temporaries may; the input
# preparation fills persistent buffers.
FACTORIES = {"aten::empty", "aten::empty_strided", "aten::zeros", "aten::ones", "aten::full",
             "aten::arange", "aten::empty_like", "aten::zeros_like", "aten::ones_like",
             "aten::full_like", "aten::new_empty", "aten::new_zeros", "aten::new_full"}


# The package's own folder, wherever the checkout lives (a clone is often itself named
# `llmfast`, so a path cannot be cut at the first `/llmfast/`).
PACKAGE_DIR = Path(llmfast.__file__).resolve().parent


@functools.lru_cache(maxsize=None)
def _package_path(filename: str) -> str | None:
    """`worker/sampling/sampler.py` for a file of the llmfast package, else None."""
    path = Path(filename).resolve()
    return str(path.relative_to(PACKAGE_DIR)) if path.is_relative_to(PACKAGE_DIR) else None


class _HostSyncRecorder(TorchDispatchMode):
    """Counts every op; for a host-syncing one (or indexing by a boolean mask), keeps
    where it was called from; for a factory, which llmfast module called it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.syncing: dict[str, str] = {}
        self.factory_callers: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        self.counts[name] += 1
        bool_mask = name in ("aten::index", "aten::index_put_", "aten::index_put") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()))
        from_list = name == FROM_PYTHON_DATA and args[0].dim() > 0
        if (name in HOST_SYNCING or bool_mask or from_list) and name not in self.syncing:
            self.syncing[name] = "".join(traceback.format_stack(limit=12)[:-1])
        if name in FACTORIES:
            ours = [_package_path(f.filename) for f in traceback.extract_stack()[:-1]]
            ours = [path for path in ours if path is not None]
            self.factory_callers.add(ours[-1] if ours else "?")
        return func(*args, **(kwargs or {}))


def _engine(async_scheduling: bool, full_graphs: bool) -> LLMEngine:
    args = EngineArgs(model="random:tiny", device="cpu", dtype="float32", max_model_len=256,
                      max_num_seqs=16, max_num_batched_tokens=512, seed=0,
                      compile=full_graphs, async_scheduling=async_scheduling,
                      cuda_graph_sizes=(1, 2, 4, 8))
    config, source = engine_config(args)
    if full_graphs:  # decode steps replay (emulated) full graphs: their input padding
        config = dataclasses.replace(config, compile=dataclasses.replace(
            config.compile, cuda_graph_mode=CudaGraphMode.FULL_AND_PIECEWISE,
            emulate_cuda_graphs=True))
    return LLMEngine(config, source)


def _unrecorded(fn, calls: list | None = None):
    def run(*args):
        if calls is not None:
            calls.append(args[0])
        with _disable_current_modes():
            return fn(*args)

    return run


def _unrecord_forward_and_wait(runner, monkeypatch) -> list[int]:
    """The model forward, a full graph's replay and the designated wait for the copy run
    outside the recorder; returns the list the full-graph sizes replayed go to."""
    replays: list[int] = []
    monkeypatch.setattr(runner, "forward_fn", _unrecorded(runner.forward_fn))
    monkeypatch.setattr(runner.cuda_graphs, "replay_full",
                        _unrecorded(runner.cuda_graphs.replay_full, replays))
    monkeypatch.setattr(PendingStep, "wait", _unrecorded(PendingStep.wait))
    return replays


@pytest.mark.parametrize("full_graphs", [False, True], ids=["eager", "full-graphs"])
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_steady_state_steps_call_no_host_syncing_op(async_scheduling, full_graphs,
                                                    monkeypatch):
    engine = _engine(async_scheduling, full_graphs)
    for i, params in enumerate(_mixed_params()):  # every sampler stage, logprobs included
        engine.add_request({"prompt_token_ids": [3 + i] * (10 + 7 * i)}, params)
    for _ in range(6):  # prefills, first decodes, lazy allocations
        engine.step()

    replays = _unrecord_forward_and_wait(engine.runner, monkeypatch)
    recorder = _HostSyncRecorder()
    with recorder:
        counts = [len(engine.step()) for _ in range(8)]
    assert counts == [len(_mixed_params())] * 8
    assert replays == ([8] * 8 if full_graphs else [])  # 6 rows padded to 8
    assert not recorder.syncing, "host-syncing ops in a step:\n" + "\n".join(
        f"{name} from:\n{where}" for name, where in recorder.syncing.items())
    assert recorder.factory_callers <= {f"worker{os.sep}sampling{os.sep}sampler.py"}
    # The recorder saw the step's own work (the sampler's argmax, the lm_head), not an
    # empty scope.
    assert recorder.counts["aten::argmax"] >= 8
    assert sum(recorder.counts.values()) > 8 * 20


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_prompt_logprobs_steps_call_no_host_syncing_op(async_scheduling, monkeypatch):
    """Steps that score a prompt (sampling/prompt_logprobs.py) beside decoding requests:
    the rows to score go to the device through staging buffers, and only the result
    tensor is allocated per step, besides the sampler's temporaries."""
    engine = _engine(async_scheduling, full_graphs=False)
    for i, params in enumerate(_mixed_params()):
        engine.add_request({"prompt_token_ids": [3 + i] * (10 + 7 * i)}, params)
    scoring = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=5)
    # A first scoring request grows the staging buffers (once, not per step).
    engine.add_request({"prompt_token_ids": list(range(3, 203))}, scoring)
    for _ in range(8):
        engine.step()
    _unrecord_forward_and_wait(engine.runner, monkeypatch)
    engine.add_request({"prompt_token_ids": list(range(4, 204))}, scoring)
    recorder = _HostSyncRecorder()
    with recorder:
        for _ in range(3):
            engine.step()
    assert not recorder.syncing, "host-syncing ops in a step:\n" + "\n".join(
        f"{name} from:\n{where}" for name, where in recorder.syncing.items())
    assert recorder.factory_callers <= {f"worker{os.sep}sampling{os.sep}sampler.py",
                                        f"worker{os.sep}sampling{os.sep}prompt_logprobs.py"}
    assert recorder.counts["aten::log_softmax"] + recorder.counts["aten::_log_softmax"] >= 1
    while engine.has_unfinished():
        engine.step()
