"""Inputs of the wrong type get a clear error instead of a TypeError from deep inside, or
worse, a silent conversion (1.7 -> 1, "5" -> 5, True -> 1)."""

from __future__ import annotations

import numpy as np
import pytest

from llmfast import LLM, SamplingParams
from llmfast.config import ConfigError
from llmfast.core.request import RequestRejected
from llmfast.engine.args import EngineArgs
from llmfast.sampling_params import SamplingParamsError
from tests.helpers.cli import TINY, assert_one_line_error, invoke


@pytest.fixture(scope="module")
def llm():
    return LLM("random:tiny", device="cpu", max_model_len=64)


@pytest.mark.parametrize("prompt, words", [
    ({"prompt_token_ids": [3, 1.7]}, "item 1 is float 1.7"),
    ({"prompt_token_ids": ["5", "6"]}, "item 0 is str '5'"),
    ({"prompt_token_ids": [True, 5]}, "item 0 is bool True"),
    ({"prompt_token_ids": "123"}, "a list of integers, not str"),
    ({"prompt_token_ids": 7}, "a list of integers, not int"),
    ([3, 4.0], "item 1 is float 4.0"),
])
def test_prompt_token_ids_must_be_integers(llm, prompt, words):
    with pytest.raises(RequestRejected) as info:
        llm.generate(prompt, SamplingParams(max_tokens=2))
    assert words in str(info.value) and "prompt token ids" in str(info.value)
    assert not llm.engine.has_unfinished()


def test_numpy_integers_are_integers(llm):
    params = SamplingParams(max_tokens=np.int64(3), top_k=np.int32(5), temperature=np.float32(0),
                            stop_token_ids=np.array([1]), ignore_eos=True)
    assert type(params.max_tokens) is int and params.stop_token_ids == (1,)
    out = llm.generate({"prompt_token_ids": np.array([3, 4, 5])}, params)[0]
    assert out.prompt_token_ids == [3, 4, 5] and all(type(t) is int for t in out.prompt_token_ids)
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("prompts, params, words", [
    # A dict of sampling fields iterated as its keys: 'str' has no attribute 'fit_to_model'.
    ("hi", {"max_tokens": 3}, "sampling_params must be a SamplingParams or a list of them, "
                              "one per prompt; got dict"),
    (["a", "b"], [SamplingParams(max_tokens=2), {"max_tokens": 2}], "got dict"),
    ("hi", "max_tokens=3", "got str"),
    (None, None, "prompts must be a str, a list of token ids, a dict with 'prompt_token_ids', "
                 "or a list of these; got NoneType None"),
    (5, None, "got int 5"),
])
def test_generate_arguments_of_the_wrong_type(llm, prompts, params, words):
    with pytest.raises(TypeError) as info:
        llm.generate(prompts, params)
    assert words in str(info.value)
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs, words", [
    ({"temperature": "0.5"}, "temperature must be a finite number, got str '0.5'"),
    ({"temperature": float("inf")}, "temperature must be a finite number"),
    ({"temperature": 1e39}, "temperature must be at most 3.403e+38"),  # inf as float32
    ({"repetition_penalty": 1e300}, "repetition_penalty must be at most"),
    ({"top_p": None}, "top_p must be a finite number, got NoneType"),
    ({"min_p": "0"}, "min_p must be a finite number"),
    ({"repetition_penalty": [1.1]}, "repetition_penalty must be a finite number"),
    ({"max_tokens": 5.0}, "max_tokens must be an integer, got float 5.0"),
    ({"top_k": 2.0}, "top_k must be an integer"),
    ({"min_tokens": "3"}, "min_tokens must be an integer"),
    ({"seed": True}, "seed must be an integer, got bool True"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"logprobs": True}, "logprobs must be an integer"),
    ({"ignore_eos": "no"}, "ignore_eos must be True or False, got str 'no'"),
    ({"stop": 5}, "stop must be a string or a list of strings, got int 5"),
    ({"stop": [5]}, "stop strings must be non-empty strings"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids must be integers; item 0 is float 1.5"),
    ({"stop_token_ids": ["7"]}, "item 0 is str '7'"),
    ({"stop_token_ids": 7}, "stop_token_ids must be a list of integers, not int"),
])
def test_wrong_typed_sampling_params(kwargs, words):
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"seed": -1}, "seed must be a non-negative integer, got int -1"),
    ({"seed": 1.5}, "seed must be a non-negative integer, got float"),
    ({"seed": True}, "got bool True"),
    ({"max_model_len": 0}, "max-model-len must be a positive integer, got int 0"),
    ({"max_model_len": -5}, "max-model-len must be a positive integer"),
    ({"max_num_seqs": "4"}, "max-num-seqs must be a positive integer, got str '4'"),
    ({"max_num_batched_tokens": 0}, "max-num-batched-tokens"),
    ({"block_size": 16.0}, "block-size must be a positive integer"),
    ({"kv_cache_memory": 0}, "kv-cache-memory must be a positive integer"),
    ({"num_gpu_blocks_override": 1}, "num-gpu-blocks-override must be an integer >= 2"),
    ({"compile": "yes"}, "compile must be True or False"),
    ({"enforce_eager": 1}, "enforce-eager must be True or False"),
    ({"async_scheduling": "on"}, "async-scheduling must be True or False"),
    ({"gpu_memory_utilization": "0.5"}, "gpu-memory-utilization must be a number"),
    ({"cuda_graph_sizes": [1, 2.5]}, "cuda-graph-sizes must be positive integers"),
    ({"device": 0}, "device must be a string"),
    ({"model": 5}, "model must be a path or name"),
])
def test_engine_args_validated_before_loading(kwargs, words):
    with pytest.raises(ConfigError) as info:
        EngineArgs(**kwargs)
    assert words in str(info.value)
    # The same through LLM(...), before the model is even looked up.
    with pytest.raises(ConfigError):
        LLM(**{"model": "/nonexistent/model", **kwargs})


def test_engine_args_that_stay_valid():
    import torch

    EngineArgs(seed=0, max_model_len=None, compile=None, kv_cache_memory=1 << 20,
               cuda_graph_sizes=(1, 2, 4), dtype=torch.bfloat16, max_num_seqs=np.int64(4))


@pytest.mark.parametrize("flag, value, words", [
    ("--max-model-len", "0", "max-model-len must be a positive integer"),
    ("--seed", "-1", "seed must be a non-negative integer"),
])
def test_cli_flags_fail_the_same_way(flag, value, words):
    assert_one_line_error(invoke("bench", *TINY, "--sizes", "1", flag, value), words)
