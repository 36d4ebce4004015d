"""Sliding windows on CUDA (`python -m pytest -m gpu` on a CUDA machine; never run
without a GPU): tiny random Mistral (window 16, every layer: its blocks are freed) and
Gemma 3 text (sliding-global-sliding; and seven layers in four KV-cache groups) give
HF's greedy tokens (fp32, same GPU) in every execution mode past the window, under chunked prefill, preemption and prefix hits; the
random Gemma 3 1B preset's logits equal HF's on the same weights at a prompt longer
than its 512-token window."""

from __future__ import annotations

import pytest
import torch

from llmfast import LLM
from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.workloads import greedy_params
from tests.test_engine_gpu import MODES, hf_greedy_on_gpu
from tests.test_sliding_models import long_workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# head_dim 64 and block size 16: shapes the Triton kernels take on real models; a
# 16-token window is one block, so the first visited tile starts mid-window.
SHAPES = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
CHECKPOINTS = {
    "mistral": dict(family="mistral", sliding_window=16),
    "gemma3_text": dict(family="gemma3_text", tie=True),
    # Seven layers, two global: four KV-cache groups of two-layer pages, one padded
    # (core/kv_cache_groups.py): each layer reads its group's tables in every mode.
    "gemma3_groups": dict(family="gemma3_text", tie=True, num_hidden_layers=7,
                          layer_types=["sliding_attention", "sliding_attention",
                                       "full_attention"] * 2 + ["sliding_attention"]),
}
# Blocks of the cache: Gemma's are KV-cache groups' pages (one or two layers), of which a
# 128-token request holds up to 8 + 2 x 4 (three groups) or 8 + 3 x 4 (four): still
# preempting.
NUM_BLOCKS = {"mistral": 10, "gemma3_text": 20, "gemma3_groups": 28}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    envs = {}

    def get(name):
        if name not in envs:
            path = make_hf_checkpoint(tmp_path_factory.mktemp(f"gpu-{name}") / "ckpt",
                                      **SHAPES, **CHECKPOINTS[name])
            prompts, lengths = long_workload(9)
            tokens = hf_greedy_on_gpu(load_hf_model(path).cuda(), prompts, lengths)
            envs[name] = (path, prompts, lengths, tokens)
        return envs[name]

    return get


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_sliding_models_match_hf_on_gpu(env, name, mode):
    path, prompts, lengths, tokens = env(name)
    llm = LLM(str(path), device="cuda", dtype="float32", max_model_len=128, block_size=16,
              max_num_batched_tokens=32, max_num_seqs=8,
              num_gpu_blocks_override=NUM_BLOCKS[name], **MODES[mode])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(lengths))
    assert [o.outputs[0].token_ids for o in outs] == tokens
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    if name != "mistral":  # (Mistral frees what leaves its window: it may not need to)
        assert stats.num_preemptions > 0


def test_gemma3_1b_random_logits_match_hf():
    from llmfast.bench.hf import hf_model_from_llmfast
    from llmfast.models.loading.loader import build_model
    from llmfast.models.sources.model_source import resolve_model
    from tests.helpers.paged import PagedSequences

    source = resolve_model("random:gemma-3-1b")
    ours = build_model(source, torch.float32, "cuda", max_positions=2048, seed=0)
    hf = hf_model_from_llmfast(ours, source.config).cuda().eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 250000, (700,), generator=gen).tolist()  # window 512
    got = PagedSequences(ours, num_seqs=1, max_len=768, block_size=16,
                         device="cuda").step({0: prompt})
    with torch.inference_mode():
        want = hf(torch.tensor([prompt], device="cuda")).logits[0]
    err = (got.float() - want.float()).abs().max().item()
    assert err <= 1e-3 * want.abs().max().item(), err
