"""Memory on a CPU: max-model-len fitted to the KV cache when the user set none, and every
memory error naming the flag that fixes it on the device at hand (--gpu-memory-utilization
means nothing on a CPU). Memory limits are given through the sizing functions' own
inputs (the bytes available, --kv-cache-memory), never by replacing their results."""

from __future__ import annotations

import logging

import pytest
import torch

from llmfast import LLM
from llmfast.config import CacheConfig
from llmfast.engine.args import EngineArgs
from llmfast.models.decoder import DecoderForCausalLM
from llmfast.models.loading.validate import check_weights_fit
from llmfast.models.sources.random_presets import RANDOM_PRESETS
from llmfast.worker.startup.kv_cache_sizing import (
    GiB,
    KVCacheTooSmall,
    check_fits_one_request,
    fit_cpu_max_model_len,
)
from tests.helpers.cli import TINY, assert_one_line_error, invoke
from tests.helpers.engine_config import engine_config

MiB = 1 << 20


def _token_bytes(preset: str, itemsize: int = 4) -> int:
    """K and V of one token over all layers, from the preset's shape (the naive sum)."""
    c = RANDOM_PRESETS[preset]
    return sum(2 * c.num_key_value_heads * c.head_dim * itemsize
               for _ in range(c.num_hidden_layers))


def test_tiny_kv_cache_fits_max_model_len_and_says_so(caplog):
    # random:tiny: 2 layers x 2 KV heads x 16 dims x K,V x 4 bytes = 512 bytes a token,
    # 8 KiB a block of 16; 64 KiB is 8 blocks, 7 usable (block 0 is the null block).
    assert _token_bytes("tiny") == 512
    with caplog.at_level(logging.WARNING, "llmfast"):
        llm = LLM("random:tiny", device="cpu", kv_cache_memory=64 * 1024, enforce_eager=True)
    assert llm.engine.config.scheduler.max_model_len == 112
    [line] = [r.getMessage() for r in caplog.records if "max-model-len" in r.getMessage()]
    assert line.startswith("max-model-len 112, what the KV cache holds (0.1 MiB; raise "
                           "--kv-cache-memory for more; the model has 4096 positions)")
    from llmfast import SamplingParams

    out = llm.generate([[5] * 100], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    # Cut at the fitted max-model-len: 100 prompt tokens + 12.
    assert len(out.outputs[0].token_ids) == 12


def test_the_cli_prints_the_fitted_length():
    result = invoke("generate", "hi", *TINY, "--kv-cache-memory", "64KiB", "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    assert "max-model-len 112, what the KV cache holds" in " ".join(result.stderr.split())


@pytest.mark.parametrize("free_after_load, tokens", [
    # The default budget: 1 GiB, or a quarter of the memory left after loading.
    (60 * GiB, (GiB // (16 * _token_bytes("qwen3-0.6b")) - 1) * 16),
    (2 * GiB, (512 * MiB // (16 * _token_bytes("qwen3-0.6b")) - 1) * 16),
])
def test_qwen3_preset_fitted_to_the_default_cache(free_after_load, tokens):
    """The README's random:qwen3-0.6b on a CPU: 4656 of its 8192 tokens fit in 1 GiB."""
    config, _ = engine_config(EngineArgs(model="random:qwen3-0.6b", device="cpu",
                                         max_model_len=8192))
    assert config.scheduler.max_model_len == 8192  # set by the user: kept
    # What loading takes first: 596M parameters in float32, and as much again for the
    # eager runner's oneDNN packs (on a machine with 4x that in RAM).
    load = 2 * 596_049_920 * 4
    fitted = fit_cpu_max_model_len(config, available=load + free_after_load)
    assert fitted.scheduler.max_model_len == tokens < 8192
    assert fitted.model == config.model and fitted.cache == config.cache
    if free_after_load == 60 * GiB:
        assert tokens == 4656  # the figure a user meets
    # No room for a block once the weights are in: left to the runner's error; no room
    # for the weights: to the loader's, with nothing logged before it.
    assert fit_cpu_max_model_len(config, available=load).scheduler.max_model_len == 8192
    assert fit_cpu_max_model_len(config, available=GiB).scheduler.max_model_len == 8192


def test_bfloat16_fits_twice_the_tokens():
    f32, _ = engine_config(EngineArgs(model="random:qwen3-0.6b", device="cpu",
                                      max_model_len=8192))
    bf16, _ = engine_config(EngineArgs(model="random:qwen3-0.6b", device="cpu", dtype="bfloat16",
                                       max_model_len=8192))
    # 512 MiB left for the cache after loading either (float32 weights and their packs;
    # bfloat16 weights, not packed).
    small = fit_cpu_max_model_len(f32, available=8 * 596_049_920 + 2 * GiB)
    large = fit_cpu_max_model_len(bf16, available=2 * 596_049_920 + 2 * GiB)
    assert large.scheduler.max_model_len in (2 * small.scheduler.max_model_len,
                                             2 * small.scheduler.max_model_len + 16)


def test_tensor_parallel_ranks_share_the_cache_and_the_heads():
    """Two CPU ranks: each holds half the KV heads in half the budget, so the fitted
    length is one process's."""
    one, _ = engine_config(EngineArgs(model="random:qwen3-0.6b", device="cpu",
                                      max_model_len=8192))
    two, _ = engine_config(EngineArgs(model="random:qwen3-0.6b", device="cpu", max_model_len=8192,
                                      tensor_parallel_size=2))
    fit = [fit_cpu_max_model_len(c, available=32 * GiB).scheduler.max_model_len
           for c in (one, two)]
    assert fit[0] == 4656 and abs(fit[1] - fit[0]) <= 16


def test_a_long_enough_cache_is_left_alone(caplog):
    with caplog.at_level(logging.WARNING, "llmfast"):
        config, _ = engine_config(EngineArgs(model="random:tiny", device="cpu"))
    assert config.scheduler.max_model_len == 4096
    assert not [r for r in caplog.records if "max-model-len" in r.getMessage()]


def test_max_model_len_set_above_the_cache_names_the_cpu_flags():
    result = invoke("generate", "hi", *TINY, "--kv-cache-memory", "64KiB",
                    "--max-model-len", "4096", "--max-tokens", "2")
    line = assert_one_line_error(result, "KV cache holds 112 tokens, fewer than max-model-len "
                                         "4096")
    # 4096 tokens = 256 blocks + the null block, 8 KiB each.
    assert f"raise --kv-cache-memory to {257 * 8192 / GiB:.2f}GiB" in line
    assert "lower --max-model-len to 112" in line
    assert "gpu" not in line.lower()


def test_kv_errors_name_the_flag_of_each_device():
    block = 8192  # random:tiny's, in float32
    auto = CacheConfig(block_size=16)
    with pytest.raises(KVCacheTooSmall) as cuda:
        check_fits_one_request(8, 16, 4096, block, torch.device("cuda"), auto)
    assert "raise --gpu-memory-utilization or lower --max-model-len to 112" in str(cuda.value)
    with pytest.raises(KVCacheTooSmall) as cpu:
        check_fits_one_request(8, 16, 4096, block, torch.device("cpu"), auto)
    assert "--kv-cache-memory to" in str(cpu.value) and "gpu" not in str(cpu.value)
    override = CacheConfig(block_size=16, num_gpu_blocks_override=8)
    for device in ("cpu", "cuda"):
        with pytest.raises(KVCacheTooSmall) as info:
            check_fits_one_request(8, 16, 4096, block, torch.device(device), override)
        assert "raise --num-gpu-blocks-override" in str(info.value)
    with pytest.raises(KVCacheTooSmall) as none:
        check_fits_one_request(1, 16, 4096, block, torch.device("cpu"), auto)
    assert "not even one block" in str(none.value) and "--kv-cache-memory" in str(none.value)
    check_fits_one_request(257, 16, 4096, block, torch.device("cpu"), auto)  # fits


def _meta_model(preset: str) -> DecoderForCausalLM:
    with torch.device("meta"):
        return DecoderForCausalLM(RANDOM_PRESETS[preset])


def test_qwen3_8b_weights_error_names_bfloat16():
    """The README's random:qwen3-8b on a 24 GB CPU machine (22.5 GiB available)."""
    model = _meta_model("qwen3-8b")
    with pytest.raises(ValueError) as info:
        check_weights_fit(model, torch.float32, torch.device("cpu"), int(22.5 * GiB))
    message = str(info.value)
    assert message.startswith("the weights need 30.5 GiB in float32, only 22.5 GiB is "
                              "available on cpu")
    assert message.endswith("--dtype bfloat16 halves them (15.3 GiB)")
    check_weights_fit(model, torch.bfloat16, torch.device("cpu"), int(22.5 * GiB))


def test_weights_error_without_a_dtype_that_fits():
    model = _meta_model("qwen3-8b")
    with pytest.raises(ValueError) as cpu:
        check_weights_fit(model, torch.float32, torch.device("cpu"), 8 * GiB)
    assert "--dtype" not in str(cpu.value) and "smaller model" in str(cpu.value)
    with pytest.raises(ValueError) as cuda:
        check_weights_fit(model, torch.bfloat16, torch.device("cuda"), 8 * GiB)
    assert "--tensor-parallel-size" in str(cuda.value) and "--dtype" not in str(cuda.value)
