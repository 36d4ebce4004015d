"""The HF transformers baseline: the same weights and workload through `generate`, as a
user who already has transformers would run it (left-padded batches, greedy).

A model directory is loaded with `AutoModelForCausalLM.from_pretrained`; a `random:`
preset has no directory, so the HF model of its family is built from its config and
llmfast's own random weights are copied in (unfused), which makes both engines compute
the same function. When the model runs in workers (mp, ray) its weights are not in this
process: the preset's weights are drawn again here, whole (the values depend only on the
preset, the seed and the device kind; tensor-parallel ranks hold slices of the same).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from llmfast.bench.throughput import ThroughputResult, throughput_result
from llmfast.bench.workload import BenchError, BenchRequest
from llmfast.models.families import hf_dict_from_model_config
from llmfast.utils.progress import CountProgress

logger = logging.getLogger(__name__)


def hf_state_dict_from_llmfast(model, config) -> dict[str, torch.Tensor]:
    """Split llmfast's fused projections back into HF names: qkv_proj rows are
    [q_size | kv_size | kv_size], gate_up_proj rows [intermediate | intermediate]. A
    mixture of experts' stacks become transformers 5's (`experts.gate_up_proj`
    [E, 2I, H], `experts.down_proj` [E, H, I]); the router's name is HF's already."""
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    experts, moe_inter, hidden = (config.num_experts, config.moe_intermediate_size,
                                  config.hidden_size)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_weight"):
            state[name.removesuffix("_weight") + "_proj"] = tensor.view(
                experts, 2 * moe_inter, hidden)
            continue
        if name.endswith("mlp.experts.down_weight"):
            state[name.removesuffix("_weight") + "_proj"] = tensor.view(
                experts, hidden, moe_inter)
            continue
        if ".self_attn.qkv_proj." in name:  # weight, and bias for Qwen2
            prefix, kind = name.rsplit("qkv_proj.", 1)
            state[f"{prefix}q_proj.{kind}"] = tensor[:q]
            state[f"{prefix}k_proj.{kind}"] = tensor[q: q + kv]
            state[f"{prefix}v_proj.{kind}"] = tensor[q + kv:]
        elif name.endswith("mlp.gate_up_proj.weight"):
            prefix = name.removesuffix("gate_up_proj.weight")
            state[prefix + "gate_proj.weight"] = tensor[:inter]
            state[prefix + "up_proj.weight"] = tensor[inter:]
        elif tensor.is_floating_point() and "rotary" not in name:
            state[name] = tensor
    return state


def load_hf_model(engine):
    """The HF model for the engine's weights, in its dtype and on its device."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise BenchError(f"--baseline hf needs transformers: {e}") from None
    dtype = engine.config.torch_dtype
    device = torch.device(engine.config.device)
    source = engine.source
    if source.path is not None:
        model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype)
    else:
        model = hf_model_from_llmfast(llmfast_model(engine), source.config)
    return model.to(device=device, dtype=dtype).eval()


def llmfast_model(engine):
    """The engine's whole model in this process: the in-process runner's, else (the
    runners are in workers) a `random:` preset's weights drawn again here, as the
    ranks drew them (same seed, dtype and device kind)."""
    runner = engine.executor.local_runner
    if runner is not None:
        return runner.model
    from llmfast.models.loading.loader import build_model

    config = engine.config
    return build_model(engine.source, config.torch_dtype, config.device,
                       max_positions=config.scheduler.max_model_len, seed=config.seed)


def hf_model_from_llmfast(model, config):
    """The HF model of `config`'s family holding `model`'s weights (on the CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = hf_dict_from_model_config(config)
    model_type = hf_cfg.pop("model_type")
    for key in ("architectures", "torch_dtype"):
        hf_cfg.pop(key)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **hf_cfg))
    hf = hf.to_empty(device="cpu")
    state = hf_state_dict_from_llmfast(model, config)
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    # Only non-persistent buffers may be left (RoPE inv_freq), recomputed below.
    if unexpected or any("rotary" not in m for m in missing):
        raise BenchError(f"cannot map llmfast weights to HF: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    if config.tie_word_embeddings:
        hf.tie_weights()
    embed = hf.model.embed_tokens
    if hasattr(embed, "scalar_embed_scale"):  # Gemma's scale: a buffer left empty above
        embed.embed_scale = torch.tensor(embed.scalar_embed_scale)
    rotary = hf.model.rotary_emb
    with torch.device("cpu"):
        hf.model.rotary_emb = type(rotary)(config=hf.config)
    return hf


def run_hf_baseline(model, requests: Sequence[BenchRequest], batch_size: int | None = None,
                    pad_token_id: int = 0,
                    progress: CountProgress | None = None) -> ThroughputResult:
    """Greedy `generate` over left-padded batches of `batch_size` (None: all at once).

    Requests are grouped by output length (sorted), each batch generating exactly its
    longest output (min_new_tokens = max_new_tokens, so EOS cannot end it early); only a
    request's own output length counts as real tokens."""
    device = next(model.parameters()).device
    with torch.inference_mode():  # warm-up, untimed, as for llmfast
        model.generate(input_ids=torch.tensor([[1, 2, 3, 4]], device=device), max_new_tokens=2,
                       min_new_tokens=2, do_sample=False, pad_token_id=pad_token_id,
                       temperature=None, top_p=None, top_k=None)
    order = sorted(range(len(requests)), key=lambda i: requests[i].output_len)
    size = batch_size or len(requests)
    batches = [order[i: i + size] for i in range(0, len(order), size)]
    output_tokens = 0
    t0 = time.perf_counter()
    for n, batch in enumerate(batches):
        prompts = [requests[i].prompt_token_ids for i in batch]
        width = max(map(len, prompts))
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        new_tokens = max(requests[i].output_len for i in batch)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device),
                max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                pad_token_id=pad_token_id, temperature=None, top_p=None, top_k=None,
            )
        generated = out.shape[1] - width
        if generated != new_tokens:
            logger.warning("HF generated %d tokens instead of %d", generated, new_tokens)
        output_tokens += sum(min(requests[i].output_len, generated) for i in batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if progress:
            progress(n + 1, len(batches))
    return throughput_result(requests, output_tokens, time.perf_counter() - t0)


HF_BATCH_CANDIDATES = (8, 16, 32, 64, 128, 256, 512)


def hf_batch_candidates(num_requests: int) -> list[int]:
    """Batch sizes to probe: the powers of two from 8 below the request count, and the
    request count itself (all at once). E.g. 100 -> [8, 16, 32, 64, 100]."""
    sizes = [b for b in HF_BATCH_CANDIDATES if b < num_requests]
    return [*sizes, num_requests]


def tune_hf_batch_size(model, requests: Sequence[BenchRequest], candidates: Sequence[int],
                       pad_token_id: int = 0,
                       progress: CountProgress | None = None
                       ) -> tuple[int, dict[int, float | None], ThroughputResult | None]:
    """The batch size at which `generate` gives the most output tokens/s: one batch of
    the first `b` requests per candidate (ascending), stopping at the first that runs
    out of memory or is slower than the one before. Returns (best, {size: tok/s or
    None for out of memory}, the best probe's result when it ran every request: then it
    is the baseline run itself, and need not be repeated)."""
    probes: dict[int, float | None] = {}
    best, best_rate, best_result = candidates[0], -1.0, None
    for n, size in enumerate(sorted(candidates)):
        try:
            result = run_hf_baseline(model, requests[:size], size, pad_token_id)
        except torch.cuda.OutOfMemoryError:
            probes[size] = None
            torch.cuda.empty_cache()
            break
        probes[size] = rate = result.output_tokens_per_s
        if progress:
            progress(n + 1, len(candidates))
        if rate <= best_rate:
            break
        best, best_rate, best_result = size, rate, result
    logger.info("HF generate batch size %d is the fastest of %s", best, probes)
    return best, probes, best_result if best >= len(requests) else None
