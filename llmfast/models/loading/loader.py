"""`build_model`: a `ModelSource` into a model on its device, in its dtype, with its
weights (the checkpoint's, or seeded random ones for a preset). The checkpoint is
checked against the config before anything is allocated; each parameter is allocated
once, where and as it will live; no transformers model is built.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from safetensors import SafetensorError

from llmfast.config import ConfigError
from llmfast.distributed import TensorParallelGroup
from llmfast.models.loading.checkpoint_weights import load_safetensors_weights, safetensors_files
from llmfast.models.decoder import DecoderForCausalLM
from llmfast.models.loading.load_error import LoadError
from llmfast.models.loading.loader_target import target
from llmfast.models.sources.model_source import ModelSource
from llmfast.models.loading.random_weights import init_random_weights
from llmfast.models.loading.validate import check_checkpoint, check_weights_fit, safetensors_shapes
from llmfast.models.formats.gguf_metadata import GGUFError
from llmfast.models.quantization.fp8 import quantize_fp8
from llmfast.models.quantization.gguf import pack_gguf_linears, wants_gguf_packing
from llmfast.models.weight_bytes import weight_bytes
from llmfast.utils.host_memory import available_host_memory
from llmfast.utils.progress import Progress

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def allocate_as(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """While constructing the model: parameters are allocated on `device` in `dtype`
    (default device and dtype) and left uninitialised (no `reset_parameters`: we
    overwrite every value). So each parameter is allocated exactly once, where and as it
    will live. Buffers with an explicit dtype, such as the float32 RoPE table, keep it.
    (On the meta device, where the config check builds its model, ops with meta kernels
    written in Python would import torch._dynamo on first use, 1.5-6 s: the RoPE table,
    the one computed buffer, is left empty there; see models/rope.py.)"""
    classes = (torch.nn.Linear, torch.nn.Embedding)
    saved_init = {cls: cls.__dict__["reset_parameters"] for cls in classes}
    saved_dtype = torch.get_default_dtype()
    for cls in classes:
        cls.reset_parameters = lambda self: None  # type: ignore[method-assign]
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(saved_dtype)
        for cls, method in saved_init.items():
            cls.reset_parameters = method  # type: ignore[method-assign]


def _check_before_allocating(model: DecoderForCausalLM, rank_model: DecoderForCausalLM,
                             source: ModelSource, dtype: torch.dtype,
                             device: torch.device) -> None:
    """`model`: the whole model on meta (what the checkpoint holds); `rank_model`: this
    rank's part of it (what must fit), the same object for one rank."""
    where = source.spec if source.path is None else str(source.path)
    try:
        check_weights_fit(rank_model, dtype, device, _available_memory(device))
        if source.path is not None:
            shapes = safetensors_shapes(safetensors_files(source.path))
            check_checkpoint(model, shapes, lambda name: target(model, name))
    except ConfigError as e:
        raise LoadError(f"{where}: {e}") from None
    except SafetensorError as e:
        raise LoadError(f"{where}: a safetensors file is corrupt or truncated: {e}") from None
    except OSError as e:
        raise LoadError(f"{where}: cannot read the weights: {e}") from None


def _available_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        return available_host_memory()
    return None


def build_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    tp: TensorParallelGroup | None = None,
    quantization: str | None = None,
) -> DecoderForCausalLM:
    """Check the checkpoint against the config on a meta-device model, then allocate
    the model directly on `device` in `dtype` (`allocate_as`: each parameter once,
    uninitialised) and write its weights in place: seeded random values for a preset,
    the checkpoint's for a directory. `tp`: build and load this rank's shard only.
    `quantization` ("fp8"): then quantize the projections, the one point where every
    weight (and every tensor-parallel shard) is final, whatever the source. "gguf", or
    None on the CPU for a quantized GGUF source: its linear layers become packed blocks
    (models/quantization/gguf.py); "none": the weights stay as loaded."""
    device = torch.device(device)
    tp = tp or TensorParallelGroup.single()
    try:
        pack_gguf = wants_gguf_packing(quantization, source.gguf_path, device, tp.world_size)
    except GGUFError as e:
        raise LoadError(str(e)) from None
    try:
        source.config.check_tensor_parallel(tp.world_size)
    except ConfigError as e:
        raise LoadError(f"{source.spec}: {e}") from None
    with allocate_as(torch.device("meta"), dtype):
        shapes = DecoderForCausalLM(source.config, max_positions=max_positions)
        rank_shapes = shapes if tp.world_size == 1 else DecoderForCausalLM(
            source.config, max_positions=max_positions, tp=tp)
    _check_before_allocating(shapes, rank_shapes, source, dtype, device)
    del shapes, rank_shapes
    with allocate_as(device, dtype):
        model = DecoderForCausalLM(source.config, max_positions=max_positions, tp=tp)
    if source.path is None:
        init_random_weights(model, seed, progress)
    else:
        load_safetensors_weights(model, source.path, progress)
    model.eval().requires_grad_(False)
    if quantization == "fp8":
        _quantize_fp8(model)
    elif pack_gguf:
        _pack_gguf(model, source.gguf_path)
    return model


def _pack_gguf(model: DecoderForCausalLM, gguf_path) -> None:
    try:
        summary = pack_gguf_linears(model, gguf_path)
    except (GGUFError, OSError, ValueError) as e:
        raise LoadError(f"{gguf_path}: cannot keep its blocks packed: {e}") from None
    logger.info("gguf: %d linear layers kept packed (%.1f MiB float32 -> %.1f MiB); the "
                "weights take %.1f MiB", summary.packed, summary.bytes_before / 2**20,
                summary.bytes_after / 2**20, weight_bytes(model) / 2**20)


def _quantize_fp8(model: DecoderForCausalLM) -> None:
    summary = quantize_fp8(model)
    logger.info("fp8: %d projections quantized to float8_e4m3fn (%.1f MiB -> %.1f MiB); "
                "the weights take %.1f MiB", summary.quantized, summary.bytes_before / 2**20,
                summary.bytes_after / 2**20, weight_bytes(model) / 2**20)
