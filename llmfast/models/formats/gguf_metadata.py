"""Reading a GGUF file's metadata: the architecture, the `ModelConfig` it describes
(families, RoPE scaling including llama3's per-frequency divisors) and its stop tokens.
The tensors themselves are converted by `models/gguf.py`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from llmfast.config import ConfigError, ModelConfig, RopeScaling
from llmfast.models.families import family_config
from llmfast.models.formats.gguf_experts import expert_fields
from llmfast.utils.errors import one_line

# general.architecture -> the HF architecture its conversion becomes.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


class GGUFError(ConfigError):
    """A GGUF file llmfast cannot convert; the message is one user-facing line."""


def open_reader(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise GGUFError(f"GGUF file {path} not found")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # a parser of untrusted bytes: any failure means a bad file
        raise GGUFError(
            f"{path.name} is not a readable GGUF file (truncated or corrupt?): {one_line(e)}"
        ) from None


def read_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    if field is None:
        return default
    try:
        return field.contents()
    except Exception as e:
        raise GGUFError(f"GGUF metadata {key} is unreadable: {one_line(e)}") from None


def model_config_from_gguf(reader: Any, name: str) -> ModelConfig:
    arch = read_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{name} holds a {arch or 'unlabelled'!r} model (general.architecture); "
            f"llmfast converts {', '.join(repr(a) for a in GGUF_ARCHITECTURES)} GGUF files"
        )
    architecture, experts = GGUF_ARCHITECTURES[arch], {}
    num_experts = int(read_field(reader, f"{arch}.expert_count") or 0)
    if num_experts > 0:  # llama.cpp writes Mixtral as a llama with experts
        architecture = "MixtralForCausalLM" if arch == "llama" else architecture
        if architecture not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
            raise GGUFError(f"{name} is a mixture-of-experts {arch}; not supported")
        try:
            experts = expert_fields(lambda key: read_field(reader, key), arch, num_experts,
                                    name)
        except ConfigError as e:
            raise GGUFError(str(e)) from None
    elif arch == "qwen3moe":
        raise GGUFError(f"{name} lacks the metadata {arch}.expert_count")

    def required(key: str) -> Any:
        value = read_field(reader, f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"{name} lacks the metadata {arch}.{key}")
        return value

    hidden = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    head_dim = int(read_field(reader, f"{arch}.attention.key_length") or hidden // max(num_heads, 1))
    value_dim = int(read_field(reader, f"{arch}.attention.value_length") or head_dim)
    rope_dim = int(read_field(reader, f"{arch}.rope.dimension_count") or head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
        raise GGUFError(
            f"{name}: key/value/rope dimensions {head_dim}/{value_dim}/{rope_dim} differ; "
            "llmfast needs one head_dim with full rotary embedding"
        )
    tensor_names = {t.name: t for t in reader.tensors}
    embed = tensor_names.get("token_embd.weight")
    if embed is None:
        raise GGUFError(f"{name} has no token_embd.weight tensor")
    rope_theta = float(read_field(reader, f"{arch}.rope.freq_base", 10000.0))
    try:
        return family_config(
            architecture,
            # Llama's and Qwen3's `attention_bias`: biases on q, k, v and the output.
            attention_bias="blk.0.attn_output.bias" in tensor_names,
            hidden_size=hidden,
            num_hidden_layers=int(required("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(
                read_field(reader, f"{arch}.attention.head_count_kv") or num_heads
            ),
            head_dim=head_dim,
            intermediate_size=int(required("feed_forward_length")),
            # The embedding's row count is the truth; `{arch}.vocab_size` is often absent.
            vocab_size=int(embed.shape[-1]),
            rms_norm_eps=float(
                read_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
            ),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling(reader, arch, tensor_names, rope_theta, head_dim, name),
            tie_word_embeddings="output.weight" not in tensor_names,
            max_position_embeddings=int(read_field(reader, f"{arch}.context_length") or 2048),
            bos_token_id=read_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=_stop_ids(reader),
            torch_dtype="float32",
            **experts,
            **(_gemma3_fields(reader, arch, hidden, num_heads, head_dim, name)
               if arch == "gemma3" else {}),
        )
    except ConfigError as e:
        raise GGUFError(f"{name}: {e}") from None


def _gemma3_fields(reader: Any, arch: str, hidden: int, num_heads: int, head_dim: int,
                   name: str) -> dict[str, Any]:
    """What llama.cpp's gemma3 graph fixes rather than stores: every sixth layer global,
    the local layers' RoPE base 10000, the attention scale 1 / sqrt(head_dim) (the 27B's,
    62 layers: 1 / sqrt(hidden / heads), its query_pre_attn_scalar)."""
    if read_field(reader, f"{arch}.attn_logit_softcapping") is not None:
        raise GGUFError(f"{name}: attention logit soft-capping is not supported")
    num_layers = int(read_field(reader, f"{arch}.block_count"))
    window = read_field(reader, f"{arch}.attention.sliding_window")
    cap = read_field(reader, f"{arch}.final_logit_softcapping")
    return dict(
        hidden_act="gelu_pytorch_tanh",
        sliding_window=None if window is None else int(window),
        layer_types=() if window is None else tuple(
            "sliding_attention" if (i + 1) % 6 else "full_attention"
            for i in range(num_layers)),
        rope_local_theta=10000.0,
        query_pre_attn_scalar=float(hidden // num_heads if num_layers == 62 else head_dim),
        final_logit_softcapping=None if cap is None else float(cap),
    )


def _stop_ids(reader: Any) -> tuple[int, ...]:
    # eot / eom are llama.cpp's names for extra end-of-turn tokens (Llama 3's <|eot_id|>).
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [read_field(reader, f"tokenizer.ggml.{k}") for k in keys]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _rope_scaling(
    reader: Any, arch: str, tensors: dict[str, Any], theta: float, head_dim: int, name: str
) -> RopeScaling:
    kind = read_field(reader, f"{arch}.rope.scaling.type", "none")
    factor = float(read_field(reader, f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if "rope_freqs.weight" in tensors:
        # llama.cpp stores llama3 scaling as per-frequency divisors, not as parameters.
        import gguf

        t = tensors["rope_freqs.weight"]
        freqs = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64)
        return _llama3_from_freqs(freqs.reshape(-1), theta, head_dim, name)
    if kind in ("none", "", None) or factor == 1.0:
        return RopeScaling()
    if kind == "linear":
        return RopeScaling("linear", factor)
    if kind == "yarn":  # Qwen's long-context setting; the betas are the paper's defaults
        original = read_field(reader, f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise GGUFError(f"{name} uses yarn rope scaling without its original context")
        return RopeScaling("yarn", factor, original_max_position_embeddings=int(original))
    raise GGUFError(
        f"{name} uses {kind!r} rope scaling; llmfast supports linear, llama3 and yarn"
    )


def _llama3_from_freqs(freqs: np.ndarray, theta: float, head_dim: int, name: str) -> RopeScaling:
    """Recognise llama3 scaling in `rope_freqs`: its largest divisor is the factor, and the
    other parameters must be Llama 3's (low 1, high 4, original context 8192), which is
    checked by recomputing the divisors the way llama.cpp's converter does."""
    scaling = RopeScaling("llama3", float(freqs.max()), 1.0, 4.0, 8192)
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    expected = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            expected.append(1.0)
        elif wavelen > low_wavelen:
            expected.append(scaling.factor)
        else:
            smooth = (old / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            expected.append(1.0 / ((1 - smooth) / scaling.factor + smooth))
    if freqs.shape != (head_dim // 2,) or not np.allclose(freqs, expected, rtol=1e-3):
        raise GGUFError(
            f"{name}: rope_freqs do not match llama3 scaling with Llama 3's parameters; "
            "convert the HF checkpoint instead"
        )
    return scaling
