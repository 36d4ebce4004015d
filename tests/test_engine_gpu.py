"""The engine on CUDA: greedy tokens equal HF transformers' (fp32, same GPU) in every
execution mode, CUDA graphs included; random presets start and generate in bf16.

Never run in a session without a GPU; `python -m pytest -m gpu` on a CUDA machine."""

from __future__ import annotations

import pytest
import torch

from llmfast import LLM, SamplingParams
from tests.helpers.checkpoints import load_hf_model, make_hf_checkpoint
from tests.helpers.workloads import greedy_params, random_workload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MODES = {
    "eager": dict(enforce_eager=True),
    "compiled": dict(compile=True, cuda_graphs=False),
    "graphs": dict(compile=True, cuda_graphs=True),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # head_dim 64 and block size 16: shapes the Triton kernels take on real models.
    return make_hf_checkpoint(tmp_path_factory.mktemp("gpu") / "ckpt", hidden_size=256,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def hf_greedy_on_gpu(hf, prompts, lengths) -> list[list[int]]:
    """HF's greedy continuation of each prompt alone (no KV cache: the plainest path)."""
    out = []
    with torch.inference_mode():
        for p, n in zip(prompts, lengths):
            ids = torch.tensor([p], device="cuda")
            tokens = []
            for _ in range(n):
                token = int(hf(ids).logits[0, -1].argmax())
                tokens.append(token)
                ids = torch.cat([ids, torch.tensor([[token]], device="cuda")], dim=1)
            out.append(tokens)
    return out


@pytest.fixture(scope="module")
def expected(ckpt):
    prompts, lengths = random_workload(7)
    return prompts, lengths, hf_greedy_on_gpu(load_hf_model(ckpt).cuda(), prompts, lengths)


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_matches_hf_on_gpu(ckpt, expected, mode):
    prompts, lengths, tokens = expected
    llm = LLM(str(ckpt), device="cuda", dtype="float32", max_model_len=128, block_size=16,
              max_num_batched_tokens=256, gpu_memory_utilization=0.3, **MODES[mode])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(lengths))
    for out, want in zip(outs, tokens):
        assert out.outputs[0].token_ids == want
    if mode == "graphs":
        assert llm.engine.runner.compiled.stats.num_cuda_graphs > 0
    assert llm.engine.stats().kv_cache_usage == 0.0


def test_chunked_prefill_and_preemption_on_gpu(ckpt, expected):
    prompts, lengths, tokens = expected
    llm = LLM(str(ckpt), device="cuda", dtype="float32", max_model_len=64, block_size=16,
              max_num_batched_tokens=16, max_num_seqs=8, num_gpu_blocks_override=12,
              compile=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy_params(lengths))
    assert [o.outputs[0].token_ids for o in outs] == tokens


def test_random_preset_bf16_generates():
    llm = LLM("random:llama-3.2-1b", device="cuda", max_model_len=1024)
    out = llm.generate([{"prompt_token_ids": list(range(10, 200))}] * 4,
                       SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 16 for o in out)
    assert len({tuple(o.outputs[0].token_ids) for o in out}) == 1  # same prompt, same tokens


def test_threads_and_streams_share_one_engine_on_gpu(ckpt, expected):
    """Outputs routed to their owners with CUDA graphs replayed from whichever thread
    steps the engine (tests/test_llm_routing.py on CPU)."""
    import threading

    prompts, lengths, tokens = expected
    llm = LLM(str(ckpt), device="cuda", dtype="float32", max_model_len=128, block_size=16,
              max_num_batched_tokens=256, gpu_memory_utilization=0.3, **MODES["graphs"])
    params = greedy_params(lengths)
    halves = [range(len(prompts) // 2), range(len(prompts) // 2, len(prompts))]
    got: dict[int, list] = {}

    def worker(k):
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in halves[k]],
                            [params[i] for i in halves[k]])
        got[k] = [o.outputs[0].token_ids for o in outs]

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    stream = llm.stream({"prompt_token_ids": prompts[0]}, params[0])
    for t in threads:
        t.start()
    streamed = [t for out in stream for t in out.outputs[0].delta_token_ids]
    for t in threads:
        t.join(timeout=300)
    assert got[0] + got[1] == tokens and streamed == tokens[0]
    assert llm.engine.stats().kv_cache_usage == 0.0
