"""Tiny llama GGUF files written as llama.cpp writes them (permuted Q/K, optional
quantisation), from a random HF model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.helpers.tokenizers import CHATML, SPECIALS

TINY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)
# HF → GGUF names, as llama.cpp's converter writes them.
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q and K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


# Gemma 3's: the norm before the MLP is `ffn_norm`, two more after attention and the MLP.
GEMMA3_NAMES = {
    **GGUF_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# Mixtures of experts: 4 experts of 32 columns, 2 per token.
EXPERTS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
}
# HF's in-memory expert tensors (transformers 5 stacks them) -> GGUF's stacks.
GGUF_EXPERT_NAMES = {"mlp.gate": "ffn_gate_inp", "mlp.experts.down_proj": "ffn_down_exps"}


def tiny_llama(vocab_size: int, tie: bool, seed: int = 0, family: str = "llama",
               **overrides):
    """A tiny random HF model of `family` (an HF model_type; Llama unless told)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **{**TINY, **EXPERTS.get(family, {}), **overrides},
                                  vocab_size=vocab_size, tie_word_embeddings=tie)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Norms too: a norm weight that is dropped or misplaced must show.
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    return model


def gguf_name(hf: str, names: dict[str, str] = GGUF_NAMES) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    stacked = GGUF_EXPERT_NAMES.get(rest.removesuffix(".weight"))
    if stacked is not None:
        return f"blk.{layer}.{stacked}.weight"
    module, kind = rest.rsplit(".", 1)  # kind: weight or bias
    return f"blk.{layer}.{names[module]}.{kind}"


def _expert_tensors(name: str, data: np.ndarray, names: dict[str, str] = GGUF_NAMES
                    ) -> list[tuple[str, np.ndarray]]:
    """HF's stacked gate/up [E, 2I, H] -> GGUF's ffn_gate_exps and ffn_up_exps [E, I, H];
    other tensors as they are."""
    if not name.endswith("mlp.experts.gate_up_proj"):
        return [(gguf_name(name, names), data)]
    layer = name.split(".")[2]
    inter = data.shape[1] // 2
    return [(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(data[:, :inter])),
            (f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(data[:, inter:]))]


def quantized_blocks(data: np.ndarray, qtype, seed: int = 0) -> np.ndarray:
    """data [..., cols] as `qtype`'s blocks [..., bytes]: gguf.quants' quantizer where it
    has one; the K-quants, which it only dequantizes, get random blocks (every byte
    random but the f16 scale fields: small finite values), so the weights are not
    `data` but valid blocks of that type."""
    import gguf

    try:
        return gguf.quants.quantize(data, qtype)
    except NotImplementedError:
        pass
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (data.size // block_elems, block_bytes), dtype=np.uint8)
    halves = np.float16(rng.uniform(1e-4, 2e-4, (blocks.shape[0], 2))).view(np.uint8)
    if qtype == gguf.GGMLQuantizationType.Q6_K:  # d last
        blocks[:, -2:] = halves[:, :2]
    else:  # d, dmin first
        blocks[:, :4] = halves
    return blocks.reshape(*data.shape[:-1], -1)


def write_llama_gguf(path: Path, model, tokenizer, quant=None, arch: str = "llama",
                     quant_embedding: bool = False) -> Path:
    """A GGUF as llama.cpp writes it: for arch llama permuted Q/K, for gemma3 its norms
    as 1 + weight and its window; optional `quant` for matrices (the embedding then gets
    F16, to cover a third tensor type, unless `quant_embedding`: `quant` too)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    names = GGUF_NAMES
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        names = GEMMA3_NAMES
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template(CHATML)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            data = llamacpp_permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llamacpp_permute(data, cfg.num_key_value_heads)
        elif arch == "gemma3" and name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        for tensor_name, data in _expert_tensors(name, data, names):
            if quant is not None and data.ndim >= 2:
                if "embed" in name and not quant_embedding:
                    w.add_tensor(tensor_name, data.astype(np.float16))
                else:
                    w.add_tensor(tensor_name, quantized_blocks(data, quant), raw_dtype=quant)
            else:
                w.add_tensor(tensor_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
