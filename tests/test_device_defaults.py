"""Engine limits sized for the device, and the KV-cache budget's one-line error."""

from __future__ import annotations

import pytest
import torch

from llmfast.engine.args import DEFAULT_STEP_LIMITS, EngineArgs, default_step_limits
from llmfast.config import CacheConfig
from llmfast.worker.startup.kv_cache_sizing import (
    GiB,
    KVCacheOutOfMemory,
    KVCacheTooSmall,
    gpu_kv_budget,
    gpu_kv_cache_bytes,
    kv_cache_out_of_memory,
)
from tests.helpers.engine_config import engine_config


def test_step_limits_by_device_kind():
    assert default_step_limits(torch.device("cpu")) == (256, 2048)
    assert default_step_limits(torch.device("cuda")) == (512, 8192)
    assert default_step_limits(torch.device("cuda:1")) == DEFAULT_STEP_LIMITS["cuda"]
    seqs, tokens = default_step_limits(torch.device("cuda"))
    assert tokens >= seqs  # a decode step of a full batch fits in one step's budget


def test_cpu_engine_config_takes_the_cpu_defaults_unless_set():
    config, _ = engine_config(EngineArgs(model="random:tiny", device="cpu"))
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (256, 2048)
    config, _ = engine_config(EngineArgs(model="random:tiny", device="cpu", max_num_seqs=8,
                                         max_num_batched_tokens=100))
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (8, 100)
    # Graph sizes above the resolved budget are dropped.
    assert max(config.compile.cuda_graph_sizes) <= 100


def test_gpu_kv_budget_worked_example():
    # 80 GiB x 0.9 = 72 GiB; peak 3 GiB; others 1 GiB -> 68 GiB.
    budget = gpu_kv_budget(80 * GiB, 1 * GiB, 0.9, 3 * GiB, block_bytes=2 << 20)
    assert budget == int(80 * GiB * 0.9) - 4 * GiB


@pytest.mark.parametrize("peak, others", [(75 * GiB, 0), (40 * GiB, 40 * GiB)])
def test_gpu_kv_budget_model_does_not_fit(peak, others):
    with pytest.raises(KVCacheTooSmall) as info:
        gpu_kv_budget(80 * GiB, others, 0.9, peak, block_bytes=2 << 20)
    message = str(info.value)
    assert "\n" not in message and "does not fit" in message
    assert f"{peak / GiB:.2f} GiB at its peak" in message
    assert "--gpu-memory-utilization 0.9 allows 72.00 GiB of 80.00 GiB" in message


def test_gpu_kv_budget_less_than_one_block_is_an_error():
    allowed = int(10 * GiB * 0.5)
    with pytest.raises(KVCacheTooSmall):
        gpu_kv_budget(10 * GiB, 0, 0.5, allowed - 100, block_bytes=4096)
    assert gpu_kv_budget(10 * GiB, 0, 0.5, allowed - 4096, block_bytes=4096) == 4096


def test_kv_cache_memory_sizes_the_cache_on_cuda_too():
    """Several engines on one GPU (bench_executor.py compares three): --kv-cache-memory
    is taken as it is, not --gpu-memory-utilization's share of the device (which would
    count the first engine's cache as another process's and leave the second none).
    The arithmetic is apart from the device query, so it is checked here without a GPU."""
    cache = CacheConfig(block_size=16, kv_cache_memory=4 * GiB)
    # 80 GiB x 0.9, another engine holding 10 GiB, a 3 GiB peak: 59 GiB left, 4 asked.
    assert gpu_kv_cache_bytes(cache, 80 * GiB, 10 * GiB, 3 * GiB, 1 << 20) == 4 * GiB
    assert gpu_kv_cache_bytes(CacheConfig(block_size=16), 80 * GiB, 10 * GiB, 3 * GiB,
                              1 << 20) == int(72 * GiB) - 13 * GiB
    # More than is left: refused now, in one line, not an out-of-memory mid-serving.
    with pytest.raises(KVCacheOutOfMemory) as info:
        gpu_kv_cache_bytes(cache, 80 * GiB, 60 * GiB, 10 * GiB, 1 << 20)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("--kv-cache-memory 4.00 GiB does not fit: 2.00 GiB")
    error = kv_cache_out_of_memory(4096, 1 << 20, GiB, torch.device("cuda"), cache)
    assert str(error).endswith("lower --kv-cache-memory")
