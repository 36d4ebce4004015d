"""GGUF (llama.cpp) files → an HF-style directory, so that one loader serves both.

Architectures: `llama` (Llama, and Mistral and Mixtral, which llama.cpp writes as llama),
`qwen2` (Qwen2 / Qwen2.5: q/k/v biases), `qwen3` (per-head q/k norms), `qwen3moe`
(experts: models/formats/gguf_experts.py) and `gemma3` (Gemma 3 text: norms on both
sides of attention and the MLP, which llama.cpp stores as 1 + weight: one is taken off
again). Only llama's converter permutes the Q and K rows (its rope rotates adjacent
pairs); the others use the NeoX layout, which is HF's, as is.

The directory holds `config.json`, `generation_config.json`, `model.safetensors` (HF tensor
names, float32), the tokenizer files with the chat template, and `llmfast-gguf.json`, which
is written last and marks a finished conversion. It is built in a temporary sibling
directory and renamed into place, so an interrupted conversion never leaves a directory
that looks complete.

Why float32: dequantised Q4_1 / Q8_0 / K-quant values are products of an f16 scale and a
small integer plus an f16 offset; they need more mantissa bits than bf16 (8) or f16 (11)
hold, so only float32 keeps them exact (and equal to what transformers' own GGUF loader
produces). For SmolLM2-135M that is ~540 MB on disk, written once; the loader casts to the
run dtype (bf16 on CUDA) when it loads.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmfast.config import ModelConfig
from llmfast.models.families import hf_dict_from_model_config
from llmfast.models.formats.gguf_experts import (
    expected_expert_shapes,
    split_stack,
    stacked_name,
)
from llmfast.models.formats.gguf_metadata import (
    GGUFError,
    model_config_from_gguf,
    open_reader,
    read_field,
)
from llmfast.utils.errors import one_line
from llmfast.utils.progress import Progress

logger = logging.getLogger(__name__)


# Bump when the output of a conversion changes, so cached directories are rebuilt.
CONVERSION_VERSION = 2  # 2: special tokens from the GGUF ids
MARKER_NAME = "llmfast-gguf.json"

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
# Gemma 3: `ffn_norm` is the norm before the MLP, two more after attention and the MLP.
_SANDWICH_TENSORS = {
    **_LAYER_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Present in some llama GGUF files but carry nothing the HF layout needs: `rope_freqs`
# is read for llama3 rope scaling below, `attn_rot_embd` is an old precomputed table.
_IGNORED = re.compile(r"^(rope_freqs\.weight|blk\.\d+\.attn_rot_embd\.weight)$")
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

# BPE pre-tokenizers that transformers' GGUF reader does not know: digits are split one
# by one before the GPT-2 byte-level regex (what these models' own tokenizer.json does).
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact")


@dataclass(frozen=True)
class GGUFTensor:
    gguf_name: str
    hf_name: str
    reader_tensor: Any  # gguf.ReaderTensor


def convert_gguf_to_hf_dir(
    gguf_path: str | Path, out_dir: str | Path, progress: Progress | None = None
) -> Path:
    """Convert a GGUF file into an HF-style directory at `out_dir` (must not exist)."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    report = progress or (lambda stage, fraction: None)
    if out_dir.exists():
        raise GGUFError(f"cannot convert {gguf_path.name}: {out_dir} already exists")
    report(f"reading {gguf_path.name}", None)
    reader = open_reader(gguf_path)
    config = model_config_from_gguf(reader, gguf_path.name)
    tensors = plan_tensors(reader.tensors, config, gguf_path.name)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        state_dict = _dequantize_all(tensors, config, gguf_path.name, report)
        report("writing model.safetensors", None)
        from safetensors.torch import save_file

        save_file(state_dict, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del state_dict
        _write_json(tmp / "config.json", hf_dict_from_model_config(config))
        _write_json(tmp / "generation_config.json", _generation_config(reader, config))
        report("converting the tokenizer", None)
        _write_tokenizer(reader, gguf_path, tmp)
        types = Counter(t.reader_tensor.tensor_type.name for t in tensors)
        _write_json(
            tmp / MARKER_NAME,
            {
                "format_version": CONVERSION_VERSION,
                "source": gguf_path.name,
                "source_bytes": gguf_path.stat().st_size,
                "tensor_types": dict(sorted(types.items())),
            },
        )
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report("conversion done", 1.0)
    logger.info("converted %s to %s", gguf_path, out_dir)
    return out_dir


def is_converted(model_dir: str | Path) -> bool:
    """Whether `model_dir` is a finished conversion by this version of the converter."""
    marker = Path(model_dir) / MARKER_NAME
    try:
        return json.loads(marker.read_text()).get("format_version") == CONVERSION_VERSION
    except (OSError, ValueError, AttributeError):
        return False


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation. # weight: [num_heads * head_dim, in_features]

    HF rotates dimension i of a head with dimension i + head_dim/2 (`rotate_half`); ggml's
    llama rope rotates adjacent pairs (2i, 2i+1). llama.cpp's converter therefore
    interleaves the two halves of each head's rows: with head_dim 4, HF rows [a0 a1 b0 b1]
    are stored as [a0 b0 a1 b1]. Reading the stored rows as [head, pair, half] and swapping
    pair and half gives back [head, half, pair], the HF order.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    if head_dim * num_heads != rows or head_dim % 2:
        raise GGUFError(f"cannot un-permute {rows} rows into {num_heads} heads of even size")
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


def hf_row_order(weight: torch.Tensor, gguf_name: str, config: ModelConfig) -> torch.Tensor:
    """A GGUF tensor's rows (values or raw quantized blocks alike) in HF's order: only
    llama's converter permutes Q and K (weights and biases alike)."""
    permuted = config.architecture in ("LlamaForCausalLM", "MixtralForCausalLM")
    if permuted and ".attn_q." in gguf_name:
        return unpermute_qk(weight, config.num_attention_heads)
    if permuted and ".attn_k." in gguf_name:
        return unpermute_qk(weight, config.num_key_value_heads)
    return weight


def plan_tensors(tensors: Any, config: ModelConfig, name: str) -> list[GGUFTensor]:
    """Map every GGUF tensor (`reader.tensors`, or models/formats/gguf_tensors.py's) to its
    HF name; refuse unknown or missing ones."""
    planned: list[GGUFTensor] = []
    layer_tensors = _SANDWICH_TENSORS if config.sandwich_norms else _LAYER_TENSORS
    for t in tensors:
        if _IGNORED.match(t.name):
            continue
        match = _LAYER_NAME.match(t.name)
        stacked = stacked_name(t.name, config) if config.num_experts else None
        if stacked is not None:
            hf = stacked
        elif match and match[2] in layer_tensors and int(match[1]) < config.num_hidden_layers:
            hf = f"model.layers.{match[1]}.{layer_tensors[match[2]]}.{match[3]}"
        elif t.name.endswith(".weight") and t.name[:-7] in _GLOBAL_TENSORS:
            hf = f"{_GLOBAL_TENSORS[t.name[:-7]]}.weight"
        else:
            raise GGUFError(f"{name} has a tensor {t.name} that llmfast does not know")
        planned.append(GGUFTensor(t.name, hf, t))
    expected = _expected_shapes(config)
    missing = sorted(set(expected) - {p.hf_name for p in planned})
    if missing:
        raise GGUFError(f"{name} lacks {len(missing)} tensors, e.g. {missing[0]}")
    extra = sorted({p.hf_name for p in planned} - set(expected))
    if extra:
        raise GGUFError(
            f"{name} has a tensor its architecture does not use ({extra[0]}); not supported"
        )
    for p in planned:
        # GGUF lists dims fastest-first (ggml's ne order): the reverse of torch's shape.
        shape = tuple(int(d) for d in reversed(p.reader_tensor.shape.tolist()))
        if shape != expected[p.hf_name]:
            raise GGUFError(
                f"{name}: tensor {p.gguf_name} has shape {list(shape)}, "
                f"expected {list(expected[p.hf_name])} from the metadata"
            )
    return planned


def _expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i = c.hidden_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    per_layer = {
        "self_attn.q_proj.weight": (c.q_size, h),
        "self_attn.k_proj.weight": (c.kv_size, h),
        "self_attn.v_proj.weight": (c.kv_size, h),
        "self_attn.o_proj.weight": (h, c.q_size),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if c.sandwich_norms:
        per_layer["pre_feedforward_layernorm.weight"] = (h,)
        per_layer["post_feedforward_layernorm.weight"] = (h,)
    dense_mlp = {"mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
                 "mlp.down_proj.weight": (h, i)}
    if c.qkv_bias:
        per_layer.update({
            "self_attn.q_proj.bias": (c.q_size,),
            "self_attn.k_proj.bias": (c.kv_size,),
            "self_attn.v_proj.bias": (c.kv_size,),
        })
    if c.o_bias:
        per_layer["self_attn.o_proj.bias"] = (h,)
    if c.qk_norm:
        per_layer["self_attn.q_norm.weight"] = (c.head_dim,)
        per_layer["self_attn.k_norm.weight"] = (c.head_dim,)
    for layer in range(c.num_hidden_layers):
        sparse = c.is_sparse_layer(layer)
        for short, shape in {**per_layer, **({} if sparse else dense_mlp)}.items():
            shapes[f"model.layers.{layer}.{short}"] = shape
        if sparse:
            shapes.update(expected_expert_shapes(c, layer))
    return shapes


def _dequantize_all(
    tensors: list[GGUFTensor], config: ModelConfig, name: str, report: Progress
) -> dict[str, torch.Tensor]:
    import gguf

    state_dict: dict[str, torch.Tensor] = {}
    for n, t in enumerate(tensors):
        rt = t.reader_tensor
        try:
            array = gguf.quants.dequantize(rt.data, rt.tensor_type)
        except NotImplementedError:
            raise GGUFError(
                f"{name}: tensor {t.gguf_name} uses {rt.tensor_type.name}, which the gguf "
                "package cannot dequantise"
            ) from None
        except Exception as e:
            raise GGUFError(f"{name}: tensor {t.gguf_name} is unreadable: {one_line(e)}") from None
        # A copy: the reader's arrays are read-only views of the memory-mapped file.
        weight = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
        weight = hf_row_order(weight, t.gguf_name, config)
        if config.norm_offset and t.hf_name.endswith("norm.weight"):
            weight = weight - 1.0  # llama.cpp stores Gemma's norm as 1 + weight
        state_dict.update(split_stack(t.hf_name, weight))
        report("dequantising tensors", (n + 1) / len(tensors))
    return state_dict


def _generation_config(reader: Any, config: ModelConfig) -> dict[str, Any]:
    eos = list(config.eos_token_ids)
    out: dict[str, Any] = {"bos_token_id": config.bos_token_id}
    out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    pad = read_field(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        out["pad_token_id"] = int(pad)
    return out


def _write_tokenizer(reader: Any, gguf_path: Path, out_dir: Path) -> None:
    """transformers builds the tokenizer from the GGUF metadata; we save it as files."""
    if reader.get_field("tokenizer.ggml.tokens") is None:
        logger.warning("%s has no tokenizer; the converted model has none", gguf_path.name)
        return
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(gguf_path.parent.resolve()), gguf_file=gguf_path.name
        )
    except Exception as e:
        raise GGUFError(
            f"{gguf_path.name}: transformers cannot build its tokenizer: {one_line(e)}"
        ) from None
    if read_field(reader, "tokenizer.ggml.pre") in _DIGIT_SPLIT_PRE:
        from tokenizers import pre_tokenizers

        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    _pin_special_tokens(tokenizer, reader)
    tokenizer.save_pretrained(str(out_dir))


# GGUF id field -> the tokenizer's special-token attribute.
_SPECIAL_TOKEN_FIELDS = {
    "tokenizer.ggml.bos_token_id": "bos_token",
    "tokenizer.ggml.eos_token_id": "eos_token",
    "tokenizer.ggml.unknown_token_id": "unk_token",
    "tokenizer.ggml.padding_token_id": "pad_token",
}


def _pin_special_tokens(tokenizer: Any, reader: Any) -> None:
    """Sets BOS/EOS/UNK/PAD from the GGUF's own ids. transformers' GGUF reader is not to
    be trusted here: 5.17 (the GPU machines' version) names the BOS token as EOS too, so a
    chat model would stop at <|im_start|> and its end-of-turn would not be EOS."""
    tokens = read_field(reader, "tokenizer.ggml.tokens") or []
    for field, attribute in _SPECIAL_TOKEN_FIELDS.items():
        token_id = read_field(reader, field)
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            setattr(tokenizer, attribute, str(tokens[token_id]))


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
