"""KV-cache sizing: how many blocks fit in the memory left after weights and activations;
the cache's allocation, refused with one line when it does not fit."""

from __future__ import annotations

import dataclasses
import logging

import torch

from llmfast.config import CacheConfig, EngineConfig, ModelConfig, kv_cache_torch_dtype
from llmfast.models.sharding import rank_model_config
from llmfast.utils.host_memory import available_host_memory

logger = logging.getLogger(__name__)

GiB = 1 << 30
DEFAULT_CPU_KV_CACHE_BYTES = 1 * GiB


class KVCacheTooSmall(ValueError):
    """The KV cache cannot hold even one request; one user-facing line."""


class KVCacheOutOfMemory(ValueError):
    """The KV cache asked for does not fit in memory; one user-facing line."""


def kv_cache_size_flag(device: torch.device, cache: CacheConfig) -> str:
    """The flag that sizes the KV cache on `device` as configured: the one a memory error
    tells the user to change (--gpu-memory-utilization means nothing on a CPU)."""
    if cache.num_gpu_blocks_override is not None:
        return "--num-gpu-blocks-override"
    if cache.kv_cache_memory is not None or device.type != "cuda":
        return "--kv-cache-memory"
    return "--gpu-memory-utilization"


def kv_cache_out_of_memory(num_blocks: int, block_bytes: int, available: int | None,
                           device: torch.device, cache: CacheConfig) -> KVCacheOutOfMemory:
    """The error naming what was asked, what is there, and the setting to lower."""
    there = "unknown" if available is None else f"{available / GiB:.2f} GiB"
    return KVCacheOutOfMemory(
        f"cannot allocate the KV cache: {num_blocks * block_bytes / GiB:.2f} GiB asked "
        f"({num_blocks} blocks of {block_bytes} bytes), {there} available on {device}; "
        f"lower {kv_cache_size_flag(device, cache)}")


def check_kv_cache_fits_host(num_blocks: int, block_bytes: int, device: torch.device,
                             cache: CacheConfig) -> None:
    """On CPU, refuse a cache larger than the available RAM before allocating it: Linux
    would grant the allocation and the OOM killer end the process while it is zeroed."""
    if device.type != "cpu":
        return
    available = available_host_memory()
    if num_blocks * block_bytes > available:
        raise kv_cache_out_of_memory(num_blocks, block_bytes, available, device, cache)


def allocate_kv_cache(model: ModelConfig, cache: CacheConfig, num_blocks: int,
                      block_bytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """All layers' K and V blocks in one zero-filled tensor (`model`: this rank's
    config, its KV heads)."""
    # [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]
    shape = (model.num_hidden_layers, 2, num_blocks, cache.block_size,
             model.num_key_value_heads, model.head_dim)
    check_kv_cache_fits_host(num_blocks, block_bytes, device, cache)
    try:
        kv_cache = torch.empty(shape, dtype=dtype, device=device)
    except (torch.OutOfMemoryError, RuntimeError):  # RuntimeError: the CPU allocator's
        available = (torch.cuda.mem_get_info(device)[0]
                     if device.type == "cuda" else available_host_memory())
        raise kv_cache_out_of_memory(num_blocks, block_bytes, available, device,
                                     cache) from None
    # fill_ writes every page now: on Linux, reading never-written (calloc'd) pages
    # of a big CPU tensor was measured ~50x slower than reading written ones.
    return kv_cache.fill_(0)


def kv_block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers, keys and values."""
    per_token = 2 * model.num_hidden_layers * model.kv_size * dtype.itemsize
    return per_token * block_size


def default_cpu_kv_cache_bytes(available: int) -> int:
    """The CPU KV cache's bytes when --kv-cache-memory is not set: 1 GiB, or a quarter of
    the `available` host memory where that is less."""
    return min(DEFAULT_CPU_KV_CACHE_BYTES, available // 4)


def num_cpu_blocks(cache: CacheConfig, model: ModelConfig, dtype: torch.dtype,
                   available: int | None = None, extra_block_bytes: int = 0) -> int:
    """Blocks of the CPU KV cache: --kv-cache-memory's worth, else the default share of
    `available` host memory (default: what the kernel reports now). `extra_block_bytes`:
    what each block costs beyond the model's own (a draft model's cache of the same
    blocks, speculative decoding)."""
    budget = cache.kv_cache_memory
    if budget is None:
        budget = default_cpu_kv_cache_bytes(
            available_host_memory() if available is None else available)
    return budget // (kv_block_bytes(model, cache.block_size, dtype) + extra_block_bytes)


def num_gpu_blocks(
    cache: CacheConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device,
    peak_bytes: int, extra_block_bytes: int = 0,
) -> int:
    """Blocks that fit in `gpu_memory_utilization` of the device after the profiled peak
    (weights + the largest forward's activations + the CUDA graphs' estimate, from the
    caller); with `kv_cache_memory` set, that many bytes' worth instead (several engines sharing
    one GPU, e.g. benchmarks comparing executors)."""
    block_bytes = kv_block_bytes(model, cache.block_size, dtype) + extra_block_bytes
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = max(total - free - torch.cuda.memory_reserved(device), 0)
    return gpu_kv_cache_bytes(cache, total, used_by_others, peak_bytes, block_bytes) \
        // block_bytes


def gpu_kv_cache_bytes(cache: CacheConfig, total: int, used_by_others: int, peak_bytes: int,
                       block_bytes: int) -> int:
    """The KV cache's bytes on a GPU: `gpu_kv_budget`, or `kv_cache_memory` where set, if
    it fits in that budget (else a one-line KVCacheOutOfMemory now, rather than the
    forward running out of memory mid-serving)."""
    budget = gpu_kv_budget(total, used_by_others, cache.gpu_memory_utilization, peak_bytes,
                           block_bytes)
    logger.info(
        "KV cache budget %.2f GiB (total %.1f GiB x %.2f, peak %.2f GiB, others %.2f GiB)",
        budget / GiB, total / GiB, cache.gpu_memory_utilization, peak_bytes / GiB,
        used_by_others / GiB,
    )
    if cache.kv_cache_memory is None:
        return budget
    if cache.kv_cache_memory > budget:
        raise KVCacheOutOfMemory(
            f"--kv-cache-memory {cache.kv_cache_memory / GiB:.2f} GiB does not fit: "
            f"{budget / GiB:.2f} GiB is left under --gpu-memory-utilization "
            f"{cache.gpu_memory_utilization:g} after the model's peak "
            f"({peak_bytes / GiB:.2f} GiB) and other processes ({used_by_others / GiB:.2f} "
            "GiB); lower --kv-cache-memory or raise --gpu-memory-utilization")
    return cache.kv_cache_memory


def gpu_kv_budget(total: int, used_by_others: int, utilization: float, peak_bytes: int,
                  block_bytes: int) -> int:
    """Bytes left for the KV cache: `utilization` of the device, less what the model
    needs at its peak (weights, activations, graphs) and what other processes hold.

    Worked example: 80 GiB x 0.9 = 72 GiB; peak 3 GiB; others 1 GiB -> 68 GiB.
    Raises KVCacheTooSmall (one line, with the numbers) when not even one block fits.
    """
    allowed = int(total * utilization)
    budget = allowed - peak_bytes - used_by_others
    if budget < block_bytes:
        raise KVCacheTooSmall(
            f"the model does not fit: it needs {peak_bytes / GiB:.2f} GiB at its peak "
            f"(weights, activations, CUDA graphs) and other processes hold "
            f"{used_by_others / GiB:.2f} GiB, but --gpu-memory-utilization {utilization:g} "
            f"allows {allowed / GiB:.2f} GiB of {total / GiB:.2f} GiB, leaving no room for "
            "the KV cache; raise --gpu-memory-utilization, lower --max-num-batched-tokens / "
            "--max-num-seqs, or use a smaller model or dtype"
        )
    return budget


def check_fits_one_request(num_blocks: int, block_size: int, max_model_len: int,
                           block_bytes: int, device: torch.device, cache: CacheConfig) -> None:
    """A KVCacheTooSmall naming the flag that fixes it on `device` unless one sequence of
    max_model_len tokens fits in the cache."""
    usable = num_blocks - 1  # block 0 is the null block
    needed = -(-max_model_len // block_size)
    flag = kv_cache_size_flag(device, cache)
    if usable < 1:
        raise KVCacheTooSmall(
            f"KV cache memory too small: not even one block of {block_bytes} bytes fits; "
            f"raise {flag} or lower --block-size"
        )
    if usable < needed:
        if flag == "--kv-cache-memory":  # the size that would do, in the flag's own units
            flag += f" to {(needed + 1) * block_bytes / GiB:.2f}GiB"
        raise KVCacheTooSmall(
            f"KV cache holds {usable * block_size} tokens, fewer than max-model-len "
            f"{max_model_len}; raise {flag} or lower --max-model-len to "
            f"{usable * block_size}"
        )


def cpu_rank_cache(cache: CacheConfig, world_size: int,
                   available: int | None = None) -> CacheConfig:
    """One CPU rank's cache config: where every rank's KV cache comes out of the same host
    memory, a share of the default budget, so that N ranks together take what one process
    would. `available`: host bytes free (default: now)."""
    if cache.kv_cache_memory is not None or cache.num_gpu_blocks_override is not None \
            or world_size == 1:
        return cache
    budget = default_cpu_kv_cache_bytes(
        available_host_memory() if available is None else available)
    return dataclasses.replace(cache, kv_cache_memory=max(1, budget // world_size))


def fit_cpu_max_model_len(config: EngineConfig, available: int | None = None) -> EngineConfig:
    """On a CPU, where the KV cache's size is known before anything is loaded: `config`
    with max-model-len cut to what the cache holds, where that is less (logged in one
    line, unless the weights will not fit: the loader's error then stands alone), so that a preset with a long context still starts (qwen3-0.6b: 4656 of its
    8192 tokens in the default 1 GiB of float32). For a max-model-len the user did not
    set; one they set is checked by `check_fits_one_request`, as is a cache that cannot
    hold one block. `available`: host bytes free (default: now); the runner sizes its
    cache after loading, so the weights (and their oneDNN packs) come off it first."""
    world = config.parallel.tensor_parallel_size
    if available is None:
        available = available_host_memory()
    weights, packs = _cpu_load_bytes(config)
    if weights > available:  # the loader refuses them in one line: nothing to say here
        return config
    available -= weights + packs
    cache = cpu_rank_cache(config.cache, world, available)
    model = rank_model_config(config.model, world)  # one rank's KV heads
    kv_dtype = kv_cache_torch_dtype(cache.kv_cache_dtype, config.torch_dtype)
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
    else:
        num_blocks = num_cpu_blocks(cache, model, kv_dtype, available)
    holds = (num_blocks - 1) * cache.block_size  # block 0 is the null block
    max_model_len = config.scheduler.max_model_len
    if holds < 1 or holds >= max_model_len:
        return config
    logger.warning("max-model-len %d, what the KV cache holds (%.1f MiB; raise %s for more; "
                   "the model has %d positions)", holds,
                   num_blocks * kv_block_bytes(model, cache.block_size, kv_dtype) / 2**20,
                   kv_cache_size_flag(torch.device("cpu"), config.cache),
                   config.model.max_position_embeddings)
    return dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, max_model_len=holds))


def _cpu_load_bytes(config: EngineConfig) -> tuple[int, int]:
    """Host bytes the model takes before the KV cache is sized: its weights in the model
    dtype (all ranks: they share the host), and the eager runner's oneDNN packs of
    float32 weights, as much again where that fits in a quarter of the RAM (model_runner,
    kernels/cpu/linear.py)."""
    from llmfast.kernels.cpu.linear import prepack_budget_bytes
    from llmfast.models.decoder import DecoderForCausalLM
    from llmfast.models.loading.loader import allocate_as
    from llmfast.models.weight_bytes import weight_bytes

    with allocate_as(torch.device("meta"), config.torch_dtype):  # shapes only, no init
        model = DecoderForCausalLM(config.model, max_positions=1)
    weights = weight_bytes(model)
    budget = prepack_budget_bytes()
    packs = weights if (config.compile.enforce_eager and config.torch_dtype == torch.float32
                        and budget and weights <= budget) else 0
    return weights, packs
