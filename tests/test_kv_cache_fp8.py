"""`--kv-cache-dtype fp8` end to end: the engine against HF transformers whose KV cache
is fake-quantized the same way, under chunked prefill and async scheduling; compiled =
eager; twice the blocks in the same memory; prefix caching; the flag.

The oracle follows what the kernels read (attention/triton/kernels.py): a step writes
its own tokens' K/V into the cache first and attends to them from there, so every key
and value attention sees, the step's own included, is the fp8 rounding of the clamped
float one. HF's `DynamicCache.update` returns the states it attends to: the subclass
below rounds them before storing and returning them.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from llmfast import LLM, SamplingParams
from llmfast.config import CacheConfig, ConfigError
from llmfast.engine.args import EngineArgs
from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.cli import TINY, assert_one_line_error, invoke
from tests.helpers.workloads import greedy_params, random_workload
from tests.helpers.engine_config import engine_config

FP8 = torch.float8_e4m3fn


def fake_quant_kv(t: torch.Tensor) -> torch.Tensor:
    """What an fp8 cache holds, dequantized (scale 1.0), in t's dtype."""
    return t.clamp(-448.0, 448.0).to(FP8).to(t.dtype)


class Fp8DynamicCache(DynamicCache):
    """HF's cache holding (and attending to) fp8-rounded keys and values."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(fake_quant_kv(key_states), fake_quant_kv(value_states),
                              layer_idx, *args, **kwargs)


def hf_greedy(hf, prompt: list[int], n: int, fp8: bool = True) -> tuple[list[int], list]:
    """Greedy continuation (eos ignored) and each step's log-softmax, float32."""
    ids = torch.tensor([prompt])
    past = Fp8DynamicCache() if fp8 else DynamicCache()
    tokens, logprobs = [], []
    with torch.inference_mode():
        for _ in range(n):
            res = hf(ids if not tokens else ids[:, -1:], past_key_values=past, use_cache=True)
            logits = res.logits[0, -1]
            tokens.append(int(logits.argmax()))
            logprobs.append(logits.log_softmax(-1))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, logprobs


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # Larger weights than the default 0.1 make K/V of a few units: fp8's rounding (~3%
    # relative) then moves logprobs by much more than float32's noise.
    return make_hf_checkpoint(tmp_path_factory.mktemp("kvfp8") / "ckpt", seed=3)


@pytest.fixture(scope="module")
def hf(ckpt):
    return load_hf_model(ckpt)


@pytest.fixture(scope="module")
def oracle(hf):
    cache = {}

    def expected(prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in cache:
            cache[key] = hf_greedy(hf, prompt, n)[0]
        return cache[key]

    return expected


def _llm(ckpt, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", kv_cache_dtype="fp8", max_model_len=128,
                block_size=4, seed=0)
    args.update(kw)
    return LLM(str(ckpt), **args)


def _generate(llm: LLM, prompts, lengths):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(lengths))
    return [o.outputs[0].token_ids for o in outs], outs


@pytest.mark.parametrize("kw", [
    {},
    {"max_num_batched_tokens": 8, "max_num_seqs": 8},  # chunked prefill
    {"async_scheduling": True, "max_num_batched_tokens": 16},
], ids=["batched", "chunked", "async"])
def test_greedy_matches_hf_with_fp8_cache(ckpt, oracle, kw):
    prompts, lengths = random_workload(5)
    llm = _llm(ckpt, **kw)
    assert llm.engine.runner.kv_cache.dtype == FP8
    tokens, _ = _generate(llm, prompts, lengths)
    assert tokens == [oracle(p, n) for p, n in zip(prompts, lengths)]


def test_logprobs_match_the_fake_quantized_oracle_not_the_float_one(ckpt, hf):
    """Logprobs of the first sampled tokens: within float32 noise of the fp8-cache
    oracle, and measurably away from HF with a float cache (so the test can tell)."""
    prompt = [5, 17, 33, 2, 90, 41, 7, 100, 3, 3, 250, 12]
    llm = _llm(ckpt)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0]
    got = torch.tensor([entry[t] for entry, t in zip(out.logprobs, out.token_ids)],
                       dtype=torch.float64)
    tokens, fp8_lp = hf_greedy(hf, prompt, 6)
    _, float_lp = hf_greedy(hf, prompt, 6, fp8=False)
    assert out.token_ids == tokens
    want = torch.tensor([lp[t] for lp, t in zip(fp8_lp, tokens)], dtype=torch.float64)
    plain = torch.tensor([lp[t] for lp, t in zip(float_lp, tokens)], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    assert (plain - want).abs().max() > 1e-2


def test_compiled_matches_eager(ckpt):
    prompts, lengths = random_workload(6)
    eager, _ = _generate(_llm(ckpt, enforce_eager=True), prompts, lengths)
    compiled, _ = _generate(_llm(ckpt, compile=True), prompts, lengths)
    assert compiled == eager


@pytest.mark.parametrize("dtype, factor", [("bfloat16", 2), ("float32", 4)])
def test_same_memory_holds_more_blocks(ckpt, dtype, factor):
    """fp8 elements are 1 byte: at the same --kv-cache-memory, 2x a bf16 cache's blocks
    (4x a float32 one's)."""
    runners = [_llm(ckpt, dtype=dtype, kv_cache_dtype=kv, kv_cache_memory="1MiB",
                    enforce_eager=True).engine.runner for kv in ("auto", "fp8")]
    assert runners[0].kv_cache.dtype == getattr(torch, dtype)
    assert runners[1].kv_cache.dtype == FP8
    assert runners[1].num_blocks == factor * runners[0].num_blocks
    assert runners[1].kv_cache.nbytes == runners[0].kv_cache.nbytes


def test_prefix_caching_still_matches(ckpt, oracle):
    prompts, lengths = random_workload(3, shared_prefix=20)
    llm = _llm(ckpt, max_num_batched_tokens=64)
    for _ in range(2):  # the second round is served from the cache
        tokens, outs = _generate(llm, prompts, lengths)
        assert tokens == [oracle(p, n) for p, n in zip(prompts, lengths)]
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert llm.engine.stats().prefix_cache_hits > 0


# ----------------------------------------------------------------- the flag


def test_flag_parses_and_reaches_the_config():
    for given, want in (("auto", "auto"), ("fp8", "fp8"), ("fp8_e4m3", "fp8")):
        args = EngineArgs.from_kwargs(model="random:tiny", device="cpu", kv_cache_dtype=given)
        config, _ = engine_config(args)
        assert config.cache.kv_cache_dtype == want
    assert CacheConfig().kv_cache_dtype == "auto"
    with pytest.raises(ConfigError, match="unknown kv cache dtype 'int8'"):
        EngineArgs.from_kwargs(kv_cache_dtype="int8")
    with pytest.raises(ConfigError, match="kv cache dtype must be one of auto, fp8"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")


def test_bad_flag_value_is_one_line_usage_error():
    result = invoke("generate", "hi", *TINY, "--kv-cache-dtype", "fp16")
    assert_one_line_error(result, "unknown kv cache dtype 'fp16'; use auto or fp8")
    assert result.exit_code == 2
