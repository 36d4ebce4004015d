"""Checkpoint weights into a built model: every tensor of the safetensors files (single
or sharded) streamed straight into its (possibly fused, possibly sliced) parameter, each
parameter row written exactly once."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from llmfast.models.decoder import DecoderForCausalLM
from llmfast.models.formats.safetensors_reader import (
    SafetensorsFile,
    SafetensorsFormatError,
    TensorEntry,
    TensorReader,
)
from llmfast.models.loading.load_error import PICKLE_SUFFIXES, LoadError, pickle_refusal
from llmfast.models.loading.load_progress import ByteProgress
from llmfast.models.loading.loader_target import target
from llmfast.models.sharding import ShardSlice, checkpoint_slice
from llmfast.models.loading.validate import is_ignorable
from llmfast.utils.progress import Progress

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise LoadError(f"{index} is not a valid safetensors index") from None
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise LoadError(f"{model_dir}: shards named in the index are missing: {missing[:3]}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        if any(next(model_dir.glob(f"*{s}"), None) is not None for s in PICKLE_SUFFIXES):
            raise pickle_refusal(model_dir)
        raise LoadError(f"{model_dir} has no *.safetensors weights")
    return files


def load_safetensors_weights(
    model: DecoderForCausalLM, model_dir: Path, progress: Progress | None = None
) -> int:
    """Stream every checkpoint tensor into its (possibly fused) parameter, checking that
    each parameter row is written exactly once.

    Each tensor's bytes are read from the file straight into its parameter (CPU) or
    through two pinned chunks onto the device (CUDA), cast there when the checkpoint's
    dtype differs (`safetensors_reader`); no CPU copy of the model exists at any point.
    A tensor-parallel rank reads only its slice of each tensor (models/sharding.py).
    Returns the bytes read from the files.
    """
    params = dict(model.named_parameters())  # a tied head appears once
    all_params = dict(model.named_parameters(remove_duplicate=False))
    rows_written = {id(p): 0 for p in params.values()}
    device = next(model.parameters()).device
    files = [_open_safetensors(f) for f in safetensors_files(model_dir)]
    meter = ByteProgress("loading weights", sum(f.data_bytes for f in files), progress, device)
    with TensorReader(device) as reader:
        for file in files:
            done_before = meter.done_bytes
            try:
                fd = os.open(file.path, os.O_RDONLY)
            except OSError as e:
                raise LoadError(f"cannot read {file.path}: {e}") from None
            try:
                for name, entry in file.entries.items():
                    found = (None if is_ignorable(name, model.config)
                             else target(model, name, all_params))
                    if found is None:
                        logger.debug("skipping checkpoint tensor %s", name)
                        continue
                    param, rows = found
                    shard = checkpoint_slice(name, model.config, model.tp)
                    rows = _rows_filled(param, rows, shard, rows_written)
                    dest = param.data if rows is None else param.data[rows]
                    if _shard_shape(entry, shard) != tuple(dest.shape):
                        raise LoadError(
                            f"{file.path.name}: {name} has shape {entry.shape}, the config "
                            f"implies {tuple(dest.shape)}"
                        )
                    reader.read(fd, entry, dest, shard)
                    rows_written[id(param)] += dest.shape[0]
                    meter.add(entry.nbytes)
            except SafetensorsFormatError as e:
                raise LoadError(f"{file.path} is corrupt or truncated: {e}") from None
            except OSError as e:
                raise LoadError(f"cannot read {file.path}: {e}") from None
            finally:
                os.close(fd)
            meter.add(file.data_bytes - (meter.done_bytes - done_before))  # skipped ones
    rate = meter.finish()
    logger.info("loaded %.2f GB of weights at %.2f GB/s", meter.done_bytes / 1e9, rate / 1e9)
    missing = [n for n, p in params.items() if rows_written[id(p)] != p.shape[0]]
    if missing:
        raise LoadError(
            f"{model_dir}: checkpoint lacks weights for {len(missing)} parameters, "
            f"e.g. {missing[0]}"
        )
    return reader.bytes_read


def _rows_filled(param: torch.Tensor, rows: slice | None, shard: ShardSlice | None,
                 rows_written: dict[int, int]) -> slice | None:
    """The rows of `param` a (sliced) tensor fills: a vocabulary slice shorter than the
    rank's rows (the last rank's) fills the first ones; the rest are zero padding,
    zeroed and counted as written here."""
    if rows is not None or shard is None or shard.dim != 0 or shard.size == param.shape[0]:
        return rows
    param.data[shard.size:].zero_()
    rows_written[id(param)] += param.shape[0] - shard.size
    return slice(0, shard.size)


def _shard_shape(entry: TensorEntry, shard: ShardSlice | None) -> tuple[int, ...]:
    if shard is None:
        return entry.shape
    shape = list(entry.shape)
    shape[shard.dim] = shard.size
    return tuple(shape)


def _open_safetensors(path: Path) -> SafetensorsFile:
    try:
        return SafetensorsFile.open(path)
    except SafetensorsFormatError as e:
        raise LoadError(f"{path} is corrupt or truncated: {e}") from None
    except OSError as e:
        raise LoadError(f"cannot read {path}: {e}") from None
