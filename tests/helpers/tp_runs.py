"""What a tensor-parallel rank runs in the tests (`tests/helpers/ranks.py` spawns them;
with `TensorParallelGroup.single()` the same functions give the TP=1 reference).

- `model_logits`: the model alone, a prefill and a decode step over a paged cache;
- `runner_tokens`: the real `ModelRunner` fed as the executor feeds it: rank 0's
  scheduler makes each step's SchedulerOutput, every rank receives the same one
  (broadcast), executes it, and rank 0's sampled ids go back to the scheduler.
Results are plain numpy / lists (pickled by value between processes).
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

from llmfast.distributed import TensorParallelGroup
from tests.helpers.compiled import compiled_model
from tests.helpers.paged import PagedSequences
from tests.helpers import engine_config as two_steps


def model_logits(group: TensorParallelGroup, spec: str, prompts: list[list[int]],
                 next_ids: list[int], quantization: str | None = None) -> np.ndarray:
    """[prefill tokens + one decode token per prompt, vocab] float32 logits."""
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model

    model = build_model(resolve_model(spec), torch.float32, "cpu", max_positions=128, seed=0,
                        tp=group, quantization=quantization)
    return paged_logits(model, prompts, next_ids)


def paged_logits(model, prompts: list[list[int]], next_ids: list[int]) -> np.ndarray:
    """`model_logits`'s prefill and decode step, for a model built by the caller."""
    seqs = PagedSequences(model, len(prompts), max_len=96, block_size=4)
    prefill = seqs.step(dict(enumerate(prompts)))
    decode = seqs.step({i: [t] for i, t in enumerate(next_ids)})
    return torch.cat([prefill, decode]).numpy()


def engine_config(spec: str, world_size: int, compiled: bool = False,
                  async_scheduling: bool = False, device: str = "cpu",
                  quantization: str | None = None):
    from llmfast.engine.args import EngineArgs

    on_cuda = device.startswith("cuda")
    args = EngineArgs(model=spec, device=device, dtype="float32", max_num_seqs=8,
                      max_num_batched_tokens=64, max_model_len=128,
                      block_size=16 if on_cuda else 4,
                      num_gpu_blocks_override=96, enforce_eager=not compiled,
                      compile=compiled, async_scheduling=async_scheduling,
                      tensor_parallel_size=world_size,
                      distributed_executor_backend="mp" if world_size > 1 else "uni",
                      quantization=quantization)
    return two_steps.engine_config(args)


def _broadcast(obj, group: TensorParallelGroup):
    if group.world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=group.first_rank_global, group=group.process_group)
    return box[0]


def runner_tokens(group: TensorParallelGroup, spec: str, prompts: list[list[int]],
                  max_tokens: int, compiled: bool = False, async_scheduling: bool = False,
                  compile_cache: str | None = None, device_type: str = "cpu",
                  quantization: str | None = None) -> dict[str, list[int]] | None:
    """Greedy output ids per request (rank 0; None on the others). The budget (64
    tokens) chunks long prompts, so steps mix prefill chunks and decodes.
    `compile_cache`: LLMFAST_CACHE for this process (compiled runs). `device_type`
    "cuda": rank r on cuda:r (compiled: CUDA graphs of both kinds). `quantization`:
    the engine's flag (e.g. "fp8")."""
    if compile_cache is not None:
        os.environ["LLMFAST_CACHE"] = compile_cache
    from llmfast.core.request import Request
    from llmfast.core.scheduler import Scheduler
    from llmfast.sampling_params import SamplingParams
    from llmfast.worker.model_runner import ModelRunner

    device = f"cuda:{group.rank}" if device_type == "cuda" else "cpu"
    config, source = engine_config(spec, group.world_size, compiled, async_scheduling, device,
                                   quantization)
    runner = ModelRunner(config, source, tp_group=group)
    num_blocks = runner.initialize()
    scheduler = requests = None
    if group.is_first_rank:
        scheduler = Scheduler(config.scheduler, config.cache, num_blocks)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        requests = [Request(str(i), p, params) for i, p in enumerate(prompts)]
        for r in requests:
            scheduler.add_request(r)
    in_flight = None
    while _broadcast(scheduler is None or scheduler.has_unfinished_requests(), group):
        out = _broadcast(scheduler.schedule() if scheduler else None, group)
        pending = runner.execute_async(out)
        step = None if pending is None else (out, pending)
        if async_scheduling:  # collect the previous step while this one runs
            step, in_flight = in_flight, step
        if step is not None:
            runner_out = runner.collect(step[1])
            if scheduler is not None:
                scheduler.update(step[0], runner_out)
    if requests is None:
        return None
    return {r.request_id: list(r.output_token_ids) for r in requests}


def compiled_logits(group: TensorParallelGroup, spec: str, prompts: list[list[int]],
                    next_ids: list[int]) -> np.ndarray:
    """`model_logits` through torch.compile with the piecewise backend, its pieces run
    as FX code (no Inductor): Dynamo's trace of the collectives and the split."""
    from llmfast.config import CompileConfig
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model

    model = build_model(resolve_model(spec), torch.float32, "cpu", max_positions=128, seed=0,
                        tp=group)
    compiled = compiled_model(model, CompileConfig(use_compile_cache=False), "cpu", 256,
                             piece_compiler="eager")
    seqs = PagedSequences(model, len(prompts), max_len=96, block_size=4, forward=compiled)
    prefill = seqs.step(dict(enumerate(prompts)))
    decode = seqs.step({i: [t] for i, t in enumerate(next_ids)})
    assert compiled.stats.one_graph
    return torch.cat([prefill, decode]).numpy()


def run_cases(group: TensorParallelGroup, cases: list[tuple[str, tuple]]) -> list:
    """Several of the functions above in one process (a rank's start-up is the cost)."""
    return [globals()[name](group, *args) for name, args in cases]


def assert_ranks_match_tp1(cases: list, rank_results: list) -> list:
    """Each case's results on every rank against TP=1's in this process: logits to
    float32 rounding on every rank, greedy tokens equal on rank 0 (None elsewhere).
    Returns TP=1's results."""
    wants = []
    for i, (name, args) in enumerate(cases):
        want = run_cases(TensorParallelGroup.single(), [(name, args)])[0]
        wants.append(want)
        got = [r[i] for r in rank_results]
        if name == "model_logits":
            for rank_logits in got:
                np.testing.assert_allclose(rank_logits, want, rtol=0, atol=2e-5,
                                           err_msg=str(args[0]))
        else:
            assert got[0] == want, args[0]
            assert all(g is None for g in got[1:])
    return wants
