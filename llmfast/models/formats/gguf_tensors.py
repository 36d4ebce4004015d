"""A GGUF file's tensors without its metadata values: what packing its blocks needs.

`gguf.GGUFReader` builds a numpy view for every part of every metadata field; for a
tokenizer of 49k tokens and merges that is ~12 s of a 2-core machine's start-up, each
time. Here the metadata is skipped by its lengths (one struct read per string) and only
the tensor table is read (GGUF v2/v3, little-endian; the layout of ggml's gguf.h).
The tensors' bytes are views of a read-only memory map.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmfast.models.formats.gguf_metadata import GGUFError

# Metadata value types -> their fixed size in bytes (8 string and 9 array vary).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    """Quacks like `gguf.ReaderTensor` for what `plan_tensors` reads."""

    name: str
    shape: np.ndarray  # dims, fastest first (ggml's ne order)
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # [rows, bytes per row] uint8 (rows: the product of the slower dims)


def read_tensor_infos(path: Path) -> list[TensorInfo]:
    with path.open("rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(buf, path.name)
    except (struct.error, ValueError, KeyError) as e:
        raise GGUFError(f"{path.name} is not a readable GGUF file ({e})") from None


def _parse(buf: mmap.mmap, name: str) -> list[TensorInfo]:
    if buf[:4] != b"GGUF":
        raise GGUFError(f"{name} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise GGUFError(f"{name}: GGUF version {version} is not supported")
    pos = 24
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key, pos = _string(buf, pos)
        (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        if key == "general.alignment" and vtype == _UINT32:
            (alignment,) = struct.unpack_from("<I", buf, pos)
        pos = _skip_value(buf, pos, vtype)
    infos = []
    for _ in range(n_tensors):
        tname, pos = _string(buf, pos)
        (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
        pos += 8 * n_dims
        ttype, offset = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        infos.append((tname, dims, GGMLQuantizationType(ttype), offset))
    data_start = -(-pos // alignment) * alignment
    tensors = []
    for tname, dims, ttype, offset in infos:
        block_elems, block_bytes = GGML_QUANT_SIZES[ttype]
        row_bytes = dims[0] // block_elems * block_bytes
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        start = data_start + offset
        data = np.frombuffer(buf, np.uint8, rows * row_bytes, start).reshape(rows, row_bytes)
        tensors.append(TensorInfo(tname, np.array(dims), ttype, data))
    return tensors


def _string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + length
    return buf[pos + 8:end].decode("utf-8", errors="replace"), end


def _skip_value(buf: mmap.mmap, pos: int, vtype: int) -> int:
    if vtype in _SCALAR_BYTES:
        return pos + _SCALAR_BYTES[vtype]
    if vtype == _STRING:
        (length,) = struct.unpack_from("<Q", buf, pos)
        return pos + 8 + length
    if vtype == _ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _SCALAR_BYTES:
            return pos + count * _SCALAR_BYTES[etype]
        for _ in range(count):
            pos = _skip_value(buf, pos, etype)
        return pos
    raise ValueError(f"unknown metadata value type {vtype}")
