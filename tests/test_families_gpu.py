"""Every family on CUDA: greedy tokens equal HF transformers' (fp32, same GPU) in every
execution mode, CUDA graphs included, under chunked prefill, preemption and prefix hits;
bf16 logits within the tolerance tests/test_families.py states; the new random presets
start, generate and chat in bf16.

Never run in a session without a GPU; `python -m pytest -m gpu` on a CUDA machine."""

from __future__ import annotations

import pytest
import torch

from llmfast import LLM, SamplingParams
from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.workloads import greedy_params as _params
from tests.helpers.workloads import random_workload as _workload
from tests.test_engine_gpu import MODES, hf_greedy_on_gpu
from tests.test_families import assert_bf16_logits_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# The mixtures of experts run the engine test too (fp32; the fused MoE layer in every mode).
ENGINE_FAMILIES = (*FAMILIES, "qwen3_moe", "mixtral")


@pytest.fixture(scope="module")
def family_env(tmp_path_factory):
    """family -> (checkpoint, prompts, lengths, HF greedy tokens), built once each."""
    envs = {}

    def get(family: str):
        if family not in envs:
            # head_dim 64 and block size 16: shapes the Triton kernels take on real models.
            path = make_hf_checkpoint(
                tmp_path_factory.mktemp(f"gpu-{family}") / "ckpt", family=family,
                hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                tie=family == "qwen2")
            prompts, lengths = _workload(12, shared_prefix=20)
            tokens = hf_greedy_on_gpu(load_hf_model(path).cuda(), prompts, lengths)
            envs[family] = (path, prompts, lengths, tokens)
        return envs[family]

    return get


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_engine_matches_hf_on_gpu(family_env, family, mode):
    path, prompts, lengths, tokens = family_env(family)
    # 10 blocks of 16 (block 0 reserved) for 16 prompts of 21-59 tokens: preemption (5 in
    # the same schedule on CPU); a 32-token budget: chunked prefills; the 20-token shared
    # prefix: cache hits.
    llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=128, block_size=16,
              max_num_batched_tokens=32, max_num_seqs=8, num_gpu_blocks_override=10,
              **MODES[mode])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(lengths))
    assert [o.outputs[0].token_ids for o in outs] == tokens
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.kv_cache_usage == 0.0
    if mode == "graphs":
        assert llm.engine.runner.compiled.stats.num_cuda_graphs > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_close_to_hf_fp32_on_gpu(family_env, family):
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model
    from tests.helpers.paged import PagedSequences

    path, prompts, _, _ = family_env(family)
    ours = build_model(resolve_model(str(path)), torch.bfloat16, "cuda", max_positions=128)
    got = PagedSequences(ours, 2, 128, block_size=16, device="cuda").step(
        {0: prompts[0], 1: prompts[1]})
    hf = load_hf_model(path).cuda()
    with torch.inference_mode():
        want = torch.cat([hf(torch.tensor([p], device="cuda")).logits[0] for p in prompts[:2]])
    assert_bf16_logits_close(got, want)


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "qwen3-0.6b"])
def test_random_preset_bf16_generates_and_chats(preset):
    llm = LLM(f"random:{preset}", device="cuda", max_model_len=1024)
    out = llm.generate([{"prompt_token_ids": list(range(10, 200))}] * 4,
                       SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)
    assert len({tuple(o.outputs[0].token_ids) for o in out}) == 1  # same prompt, same tokens
    ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}])
    reply = llm.generate({"prompt_token_ids": ids},
                         SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(reply[0].outputs[0].token_ids) == 8
