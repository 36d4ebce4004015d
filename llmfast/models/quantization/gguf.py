"""`--quantization gguf` (the default on the CPU for a quantized GGUF model): each linear
layer whose GGUF tensors are in a packed block type (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K)
becomes an `Int4Linear` built from the file's blocks (kernels/cpu/int4_linear.py); its
float32 weight is freed. Fused projections (qkv, gate_up) stack their parts' rows, which
must share one type. A tied lm_head is packed from the embedding's blocks while the
embedding itself stays float32: a step reads only its batch's rows of it.

The model is first loaded as today (the converted float32 directory), so every other
parameter, and every check of the loader, is unchanged; packing replaces modules after.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from llmfast.kernels.cpu.int4_linear import Int4Linear, int4_supported, pack_int4
from llmfast.models.formats.gguf import hf_row_order, plan_tensors
from llmfast.models.formats.gguf_blocks import PACKABLE_TYPES, decode_blocks
from llmfast.models.formats.gguf_metadata import GGUFError
from llmfast.models.formats.gguf_tensors import read_tensor_infos
from llmfast.models.quantization.gguf_pack_cache import load_packed, pack_cache_path, save_packed

logger = logging.getLogger(__name__)

# A fused module -> the HF projections stacked in its rows, in order.
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True)
class GGUFPackSummary:
    packed: int  # linear layers now Int4Linear
    kept: tuple[str, ...]  # layers left float32 (a type with no packed form, mixed types)
    bytes_before: int  # the packed layers' float32 weights
    bytes_after: int  # their packed weights and scales


def packable_gguf(gguf_path: Path) -> bool:
    """Whether the file's linear weights are (mostly) in a packed block type."""
    types = [t.tensor_type.name for t in read_tensor_infos(gguf_path) if len(t.shape) == 2]
    return int4_supported() and sum(t in PACKABLE_TYPES for t in types) * 2 > len(types)


def wants_gguf_packing(quantization: str | None, gguf_path: Path | None,
                       device: torch.device, tp_world_size: int) -> bool:
    """Whether to pack: `--quantization gguf` asks for it (an error where it cannot be
    done), the default (None) packs a quantized GGUF on the CPU, anything else does not."""
    if quantization == "gguf":
        if gguf_path is None:
            raise GGUFError("--quantization gguf needs a .gguf model (or the default model)")
        if device.type != "cpu":
            raise GGUFError("--quantization gguf runs on the CPU only; on CUDA use "
                            "--quantization none")
        if tp_world_size > 1:
            raise GGUFError("--quantization gguf does not run tensor-parallel")
        if not packable_gguf(gguf_path):
            raise GGUFError(f"{gguf_path.name} has no linear weights in a packed type ("
                            + ", ".join(PACKABLE_TYPES) + "); use --quantization none")
        return True
    return (quantization is None and gguf_path is not None and device.type == "cpu"
            and tp_world_size == 1 and packable_gguf(gguf_path))


def pack_gguf_linears(model: nn.Module, gguf_path: Path,
                      use_cache: bool = True) -> GGUFPackSummary:
    """Replace, in place, each linear layer of a loaded CPU `model` whose weight comes
    from packable GGUF blocks of `gguf_path` by an `Int4Linear`; with `use_cache`, the
    packed tensors come from (or go to) the start-up cache (gguf_pack_cache.py)."""
    config = model.config
    by_hf = {t.hf_name: t for t in plan_tensors(read_tensor_infos(gguf_path), config,
                                                  gguf_path.name)}
    cache_path = pack_cache_path(gguf_path) if use_cache else None
    cached = load_packed(cache_path) if cache_path is not None else None
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    kept, before, after, made = [], 0, 0, {}
    for name in names:
        layer = model.get_submodule(name)
        sources = _hf_sources(name, config.tie_word_embeddings)
        tensors = [by_hf.get(source) for source in sources]
        types = {t.reader_tensor.tensor_type.name for t in tensors if t is not None}
        if None in tensors or len(types) != 1 or not types <= set(PACKABLE_TYPES):
            kept.append(name)
            continue
        shape = (layer.in_features, layer.out_features)
        packed = cached.get(name) if cached is not None else None
        if packed is None or (packed.in_features, packed.out_features) != shape:
            (type_name,) = types
            raw = torch.cat([hf_row_order(torch.from_numpy(np.array(t.reader_tensor.data)),
                                          t.gguf_name, config) for t in tensors])
            codes = decode_blocks(raw.numpy(), type_name, layer.in_features)
            if codes.codes.shape[0] != layer.out_features:
                kept.append(name)
                continue
            packed = pack_int4(codes)
            made[name] = packed
        bias = None if layer.bias is None else layer.bias.detach()
        module = Int4Linear(packed, bias)
        before += layer.weight.numel() * layer.weight.element_size()
        after += sum(p.numel() * p.element_size() for p in module.parameters())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)
        del layer
    if cache_path is not None and made:
        save_packed(cache_path, {name: model.get_submodule(name).packed()
                                 for name in names if name not in kept})
    if kept:
        logger.info("gguf: %d linear layer(s) kept float32: %s", len(kept),
                    ", ".join(kept[:4]) + (" ..." if len(kept) > 4 else ""))
    logger.info("gguf: %d packed linear layer(s) %s", len(names) - len(kept),
                "from the start-up cache" if cached is not None and not made
                else f"packed now ({len(made)})")
    return GGUFPackSummary(len(names) - len(kept), tuple(kept), before, after)


def _hf_sources(module_name: str, tied: bool) -> list[str]:
    """The HF weight names a linear module's rows come from."""
    if module_name == "lm_head":
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    prefix, _, leaf = module_name.rpartition(".")
    parts = _FUSED_PARTS.get(leaf, (leaf,))
    return [f"{prefix}.{part}.weight" for part in parts]
