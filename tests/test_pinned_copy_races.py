"""The runner's pinned host buffers against its asynchronous copies, emulated on the CPU.

On CUDA the runner fills pinned host buffers (`.np` / `.cpu` views) and queues
non-blocking copies to the device; the device reads the pinned memory when the copy runs,
later. Rewriting a buffer before then hands the device the new values: a race a CPU
never shows, its copies being done when issued. Here the engine runs with its device
views apart from the host views (test_device_views.py; zeroed, as on CUDA), and the
copy helpers (`CpuGpuBuffer.copy_to_gpu`, `StagingBuffer.stage`) note each copy as
pending, with a snapshot of its source. A pending copy is known done only where the host has waited for
an event recorded after it, as on CUDA: the runner's `_inputs_copied` (a stand-in event
on the CPU) or the event of a step's output copy (`OutputCopier`, whose side stream
starts after everything queued before it; a stand-in too). A pending source that
differs from its snapshot at any checkpoint (every copy, event and runner stage) is a
race: the test fails naming the buffer, where its copy was issued and where the change
was first seen.

The other direction too: a step's sampled ids reach their pinned host buffer only when
the host waits on the output copy's event (junk before), and a buffer is not copied
into again before the host has waited for its previous copy.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections import deque
from dataclasses import dataclass

import pytest
import torch

from llmfast import SamplingParams
from llmfast.compile import CompiledModel
from llmfast.config import CudaGraphMode
from llmfast.worker import model_runner
from llmfast.worker.buffers import CpuGpuBuffer, StagingBuffer
from llmfast.worker.startup import runner_startup
from llmfast.worker.step_output import OutputCopier
from tests.helpers.full_graphs import arrival_workload, emulated_graph_engine, run_with_arrivals
from tests.test_graph_input_properties import _separate_zeroed_device_views

NOT_LANDED = -12345  # what a pinned destination holds before its copy is waited for


@dataclass
class PendingCopy:
    name: str  # the buffer, by its path from the runner
    source: torch.Tensor  # the pinned host range the device reads
    snapshot: torch.Tensor  # its values when the copy was issued
    issued_at: str
    step: int


def _caller(depth: int) -> str:
    frame = sys._getframe(depth + 1)
    return f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} " \
        f"({frame.f_code.co_name})"


class StandInEvent:
    """A CUDA event on the CPU: `record` marks the copies queued so far (one stream, in
    order), `synchronize` is the host learning they are done."""

    def __init__(self, detector: PinnedCopyRaceDetector, name: str, on_done=None) -> None:
        self.detector, self.name, self.on_done = detector, name, on_done
        self.covers: list[PendingCopy] = []
        self.done, self.step = True, -1  # (the step of its last record)

    def record(self, stream=None) -> None:
        self.detector.checkpoint(f"{self.name} event record")
        self.covers = list(self.detector.pending)
        self.done, self.step = False, self.detector.step

    def synchronize(self) -> None:
        self.detector.complete(self.covers, f"{self.name} event synchronize")
        self.covers = []
        if not self.done and self.on_done is not None:
            self.on_done()
        self.done = True


class PinnedCopyRaceDetector:
    def __init__(self, monkeypatch) -> None:
        self.pending: list[PendingCopy] = []
        self.names: dict[int, str] = {}  # id(buffer) -> its path from the runner
        self.races: list[str] = []
        self.issued: dict[str, int] = {}  # buffer name -> copies issued
        self.completed = 0
        self.step = -1
        self._patch(monkeypatch)

    def name_buffers(self, runner) -> None:
        """Name every CpuGpuBuffer / StagingBuffer reachable from the runner's attributes
        (a few levels of llmfast objects and dicts), by its shortest path."""
        todo, seen = deque([("runner", runner, 0)]), set()
        while todo:
            path, obj, depth = todo.popleft()
            if id(obj) in seen or depth > 4:
                continue
            seen.add(id(obj))
            if isinstance(obj, (CpuGpuBuffer, StagingBuffer)):
                self.names[id(obj)] = path
                continue
            if isinstance(obj, dict):
                items = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
            elif type(obj).__module__.startswith("llmfast") and hasattr(obj, "__dict__"):
                items = [(f"{path}.{k}", v) for k, v in vars(obj).items()]
            else:
                continue
            todo.extend((p, v, depth + 1) for p, v in items)

    # ------------------------------------------------------------------ the checks

    def checkpoint(self, where: str) -> None:
        for copy in self.pending:
            if not torch.equal(copy.source, copy.snapshot):
                self._race(copy, where)

    def _race(self, copy: PendingCopy, where: str) -> None:
        changed = (copy.source != copy.snapshot).reshape(-1).nonzero()[:3, 0].tolist()
        values = [(i, copy.snapshot.reshape(-1)[i].item(), copy.source.reshape(-1)[i].item())
                  for i in changed]
        message = (f"pinned source {copy.name} was rewritten while its copy to the device "
                   f"(issued at {copy.issued_at}, step {copy.step}) was pending; first seen "
                   f"at {where}, step {self.step}; (index, copied, now): {values}")
        self.races.append(message)
        raise AssertionError(message)

    def issue(self, buffer, source: torch.Tensor) -> None:
        name = self.names.get(id(buffer), f"unnamed {type(buffer).__name__}")
        self.issued[name] = self.issued.get(name, 0) + 1
        self.pending.append(PendingCopy(name, source, source.clone(), _caller(2), self.step))

    def complete(self, copies: list[PendingCopy], where: str) -> None:
        self.checkpoint(where)  # (the last moment the device could still read them)
        done = {id(c) for c in copies}
        self.completed += sum(id(c) in done for c in self.pending)
        self.pending = [c for c in self.pending if id(c) not in done]

    # ------------------------------------------------------------------ the seams

    def _patch(self, monkeypatch) -> None:
        det = self
        copy_to_gpu, stage, output_copy = (CpuGpuBuffer.copy_to_gpu, StagingBuffer.stage,
                                           OutputCopier.copy)

        def checked_copy_to_gpu(self, n=None):
            det.checkpoint(_caller(1))
            out = copy_to_gpu(self, n)
            if self.gpu is not self.cpu:
                det.issue(self, self.cpu if n is None else self.cpu[:n])
            return out

        def checked_stage(self, array):
            det.checkpoint(_caller(1))
            out = stage(self, array)  # (writes the pinned buffer, then copies)
            det.checkpoint(f"{det.names.get(id(self))}.stage called at {_caller(1)}")
            if self.gpu is not self.cpu:
                det.issue(self, self.cpu[: array.size])
            return out

        slots: dict[int, StandInEvent] = {}  # pinned destination -> its copy's event

        def deferred_output_copy(self, sampled, logprobs, prompt_logprobs=None):
            fields = output_copy(self, sampled, logprobs, prompt_logprobs)
            if fields["event"] is None:  # the CPU's branch: land it when waited for
                host = fields["sampled_host"]
                key = host.untyped_storage().data_ptr()
                previous = slots.get(key)
                assert previous is None or previous.done, \
                    f"step {det.step} copies its sampled ids into the pinned buffer of step " \
                    f"{previous.step}'s, which the host has not waited for"
                landed = host.clone()
                host.fill_(NOT_LANDED)
                event = slots[key] = StandInEvent(det, "output copy",
                                                  lambda: host.copy_(landed))
                event.record()
                fields["event"] = event
            return fields

        monkeypatch.setattr(CpuGpuBuffer, "copy_to_gpu", checked_copy_to_gpu)
        monkeypatch.setattr(StagingBuffer, "stage", checked_stage)
        monkeypatch.setattr(OutputCopier, "copy", deferred_output_copy)

        # The runner's stages: checkpoints before and after each.
        for name in ("update_states", "build_sampling_metadata", "plan_prompt_logprobs",
                     "record_placeholders", "write_sampled_tokens"):
            monkeypatch.setattr(model_runner, name,
                                self._checked(name, getattr(model_runner, name)))
        execute_async, collect = (model_runner.ModelRunner.execute_async,
                                  model_runner.ModelRunner.collect)
        steps = itertools.count()

        def checked_execute_async(self, out):
            det.step = next(steps)
            return det._checked("execute_async", execute_async)(self, out)

        def checked_collect(self, step):
            out = det._checked("collect", collect)(self, step)
            assert step.event.done, f"collect read step {step.event.step}'s sampled ids " \
                "without waiting for their copy"
            return out

        monkeypatch.setattr(model_runner.ModelRunner, "execute_async", checked_execute_async)
        monkeypatch.setattr(model_runner.ModelRunner, "collect", checked_collect)

    def _checked(self, name: str, fn):
        def checked(*args, **kwargs):
            self.checkpoint(f"before {name}")
            out = fn(*args, **kwargs)
            self.checkpoint(f"after {name}")
            return out
        return checked


def _sampling_params(lengths) -> list[SamplingParams]:
    """Every sampler stage that stages per-step arrays: penalties (prompt and output ids),
    min_tokens with stop ids, logit bias, logprobs and prompt logprobs, seeds."""
    return [SamplingParams(temperature=0.8 if i % 2 else 0.0, top_p=0.9, top_k=20,
                           max_tokens=n, seed=100 + i, ignore_eos=True,
                           repetition_penalty=1.3, presence_penalty=0.5,
                           frequency_penalty=0.2, logprobs=3 if i % 3 == 0 else None,
                           prompt_logprobs=2 if i % 4 == 2 else None,
                           logit_bias={5: 3.0} if i % 4 == 1 else None,
                           min_tokens=2, stop_token_ids=[9])
            for i, n in enumerate(lengths)]


@pytest.mark.parametrize("mode, async_scheduling", [
    # The CUDA default's path: steps padded to graph sizes, uniform decodes in full
    # graphs, one step in flight (its outputs' wait comes after the next launch).
    (CudaGraphMode.FULL_AND_PIECEWISE, True),
    # Eager and synchronous: each step's outputs are waited for before the next launch.
    (None, False),
])
def test_no_pinned_source_is_rewritten_before_its_copy_is_known_done(
        ckpt, monkeypatch, mode, async_scheduling):
    _separate_zeroed_device_views(monkeypatch)
    # A KV cache of 26 blocks (24 hold one request of max_model_len): requests are
    # preempted and come back, so rows leave and join mid-run.
    monkeypatch.setattr(runner_startup, "num_cpu_blocks", lambda *args, **kwargs: 26)
    # The graphs' path (padding, full-graph steps) without Inductor: the pieces run as
    # traced; the host side is the same.
    monkeypatch.setattr(model_runner, "CompiledModel",
                        functools.partial(CompiledModel, piece_compiler="eager"))
    det = PinnedCopyRaceDetector(monkeypatch)
    engine = emulated_graph_engine(ckpt, mode)
    runner = engine.runner
    assert runner.num_blocks == 26
    assert runner._inputs_copied is None  # (the CPU's)
    runner._inputs_copied = StandInEvent(det, "inputs copied")
    det.name_buffers(runner)
    engine.set_async_scheduling(async_scheduling)
    prompts, lengths, arrivals = arrival_workload(seed=3)
    got = run_with_arrivals(engine, prompts, _sampling_params(lengths), arrivals)

    assert not det.races
    assert engine.scheduler.num_preemptions > 0
    # Every sampled id the host read had landed (it never saw NOT_LANDED), and the
    # requests ran to their lengths (a stop id could end one early).
    assert all(0 <= t < 256 for tokens in got for t in tokens)
    assert all(1 <= len(tokens) <= n for tokens, n in zip(got, lengths))
    # Not vacuous: the step inputs, the block table, the sampling rows, the placeholder
    # fill and the sampler's and prompt logprobs' staging buffers were all copied, and
    # every copy completed at an event.
    for name in ("runner.input_ids", "runner.positions", "runner.query_start_loc",
                 "runner.seq_lens", "runner.logits_indices",
                 "runner.input_batch.block_table.table",
                 "runner.input_batch.block_table.slot_mapping",
                 "runner.input_batch.sampling['temperature']",
                 "runner.sampling_staging.output_ids", "runner.sampling_staging.stop_ids",
                 "runner.sampling_staging.bias_ids",
                 "runner.prompt_logprobs_staging.token_rows"):
        assert det.issued.get(name), name
    assert "unnamed" not in " ".join(det.issued)
    assert det.completed == sum(det.issued.values()) and not det.pending
    if async_scheduling:  # placeholders filled from the last step's ids on the device
        assert det.issued.get("runner.placeholders.placeholder_src")
    if mode is not None:
        compiled = runner.compiled
        assert compiled.graphs.full.num_replays > 0 and compiled.graphs.piecewise.num_replays > 0
