"""The executor on CUDA: one worker process (mp, TP=1, NCCL-free) and, on a machine with
two GPUs, two ranks over NCCL give the in-process runner's greedy tokens, sync and
async, on the preempting, prefix-caching workload."""

from __future__ import annotations

import pytest
import torch

from llmfast import LLM
from tests.helpers.checkpoints import make_hf_checkpoint
from tests.helpers.tensor_parallel import ENGINE, run_workload

pytestmark = pytest.mark.gpu
CUDA = {**ENGINE, "device": "cuda", "block_size": 16, "num_gpu_blocks_override": 8,
        "dtype": "float32", "enforce_eager": True}


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="tensor parallelism over NCCL needs two GPUs"))])
def test_mp_on_cuda_tokens_equal_uni(tp, tmp_path):
    path = make_hf_checkpoint(tmp_path / "model", family="llama")
    want, _, _ = run_workload(LLM(str(path), async_scheduling=False, **CUDA))
    llm = LLM(str(path), tensor_parallel_size=tp, distributed_executor_backend="mp",
              async_scheduling=False, **CUDA)
    for async_scheduling in (False, True):
        llm.engine.set_async_scheduling(async_scheduling)
        tokens, preemptions, _ = run_workload(llm)
        assert tokens == want, async_scheduling
        assert preemptions > 0
    llm.engine.shutdown()
