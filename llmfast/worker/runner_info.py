"""`RunnerInfo`: what one rank's model runner tells the engine's process about itself
once initialised, whatever process it runs in: its device (name, memory, CUDA version,
measured there), the weight bytes a decode step streams on that device, what compiling
and capturing did.

The benchmarks and start-up reports read it (`LLMEngine.runner_info` is rank 0's,
`LLMEngine.runner_infos` every rank's) instead of the runner, which exists in the
engine's process only with the `uni` backend. Cheap to make and small to pickle: each
`mp` worker or Ray actor sends its own with its ready message.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from llmfast.compile.stats import CompileStats
from llmfast.models.weight_bytes import decode_weight_bytes

if TYPE_CHECKING:
    from llmfast.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class RunnerInfo:
    rank: int
    world_size: int  # tensor-parallel ranks
    device: str  # as the rank sees it: "cpu", "cuda:0" (a Ray actor sees its GPU as 0)
    device_name: str  # torch.cuda.get_device_name on CUDA; "cpu" otherwise
    # The device's total memory (CUDA; None on CPU) and the CUDA version of the rank's
    # torch build (None on CPU): the driving process may have no GPU, or another torch.
    device_memory_bytes: int | None
    cuda_version: str | None
    # Weight bytes one decode step reads on this rank: its shards and the replicated
    # norms (with one rank, the whole model; see models/weight_bytes.py).
    decode_weight_bytes: int
    # What compiling and capturing did by the end of start-up; None in eager mode.
    compile_stats: CompileStats | None
    # Triton variants the start-up compiled in threads ahead of their launches, and how
    # many more it compiled at a launch (worker/startup/kernel_precompile.py); None: no
    # precompile ran (CPU, or switched off).
    triton_variants: dict[str, int] | None = None


def runner_info(runner: ModelRunner) -> RunnerInfo:
    """`runner`'s info, from its public attributes; the compile stats are a copy (the
    runner's own keep counting)."""
    device = runner.device
    compiled = runner.compiled
    on_cuda = device.type == "cuda"
    props = torch.cuda.get_device_properties(device) if on_cuda else None
    return RunnerInfo(
        rank=runner.tp_group.rank,
        world_size=runner.tp_group.world_size,
        device=str(device),
        device_name=props.name if props else "cpu",
        device_memory_bytes=props.total_memory if props else None,
        cuda_version=torch.version.cuda if on_cuda else None,
        decode_weight_bytes=decode_weight_bytes(runner.model),
        compile_stats=None if compiled.eager else copy.deepcopy(compiled.stats),
        triton_variants=dict(runner.triton_variants) if runner.triton_variants else None,
    )
