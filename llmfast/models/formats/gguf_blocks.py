"""GGUF quantized blocks -> integer codes with one affine map per group of columns.

Every block format kept packed on the CPU decodes to `w = scale * code + offset`, with
`code` an unsigned integer of `bits` bits and (scale, offset) shared by `group` adjacent
columns of a row:

| type | block | bits | group | scale, offset |
|---|---|---|---|---|
| Q4_0 | 32 | 4 | 32 | d, -8 d |
| Q4_1 | 32 | 4 | 32 | d, m |
| Q8_0 | 32 | 8 | 32 | d, -128 d (the int8 code shifted by 128) |
| Q4_K | 256 | 4 | 32 | d * sc, -dmin * m (6-bit sc and m per 32) |
| Q5_K | 256 | 5 | 32 | d * sc, -dmin * m |
| Q6_K | 256 | 6 | 16 | d * sc, -32 d * sc (8-bit sc per 16) |

scale and offset are computed in float32 from the f16 fields and small integers: the
products are exact there, so `scale * code + offset` in float64 equals what
`gguf.quants.dequantize` gives (tests check this bit for bit).
"""

from __future__ import annotations

import numpy as np

from llmfast.kernels.cpu.affine_codes import AffineCodes

QK_K = 256  # elements of a K-quant super-block

# type name -> (elements per block, bytes per block)
BLOCK_LAYOUT = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}
PACKABLE_TYPES = tuple(BLOCK_LAYOUT)


def decode_blocks(raw: np.ndarray, type_name: str, cols: int) -> AffineCodes:
    """`raw`: a GGUF tensor's bytes as [rows, bytes per row] (the reader's layout);
    `cols`: elements per row."""
    if type_name not in BLOCK_LAYOUT:
        raise ValueError(f"no packed CPU form for GGUF type {type_name}")
    block_elems, block_bytes = BLOCK_LAYOUT[type_name]
    rows = raw.shape[0]
    if cols % block_elems or raw.shape[1] != cols // block_elems * block_bytes:
        raise ValueError(f"{type_name}: {raw.shape[1]} bytes cannot hold a row of {cols}")
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    codes, scale, offset, bits, group = _DECODERS[type_name](blocks)
    return AffineCodes(
        codes=codes.reshape(rows, cols),
        scale=scale.reshape(rows, cols // group).astype(np.float32),
        offset=offset.reshape(rows, cols // group).astype(np.float32),
        bits=bits,
        group=group,
    )


def _f16(field: np.ndarray) -> np.ndarray:
    """[n_blocks, 2] bytes -> [n_blocks, 1] float32."""
    return np.ascontiguousarray(field).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, span: int) -> np.ndarray:
    """Bytes [n, chunks * span] -> codes [n, chunks * 2 * span]: within each chunk of
    `span` bytes the low nibbles come first, then the high ones (ggml's order)."""
    n = qs.shape[0]
    chunks = qs.reshape(n, -1, 1, span)
    both = np.concatenate([chunks & 0x0F, chunks >> 4], axis=2)  # [n, chunks, 2, span]
    return both.reshape(n, -1)


def _q4_0(blocks):
    d = _f16(blocks[:, :2])
    return _nibbles(blocks[:, 2:], 16), d, -8 * d, 4, 32


def _q4_1(blocks):
    d, m = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    return _nibbles(blocks[:, 4:], 16), d, m, 4, 32


def _q8_0(blocks):
    d = _f16(blocks[:, :2])
    codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return codes, d, -128 * d, 8, 32


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins: bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same for
    the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high)."""
    s = scales.reshape(-1, 3, 4)
    lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_affine(blocks):
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mn = _k_scale_min(blocks[:, 4:16])
    return d * sc, -(dmin * mn)


def _q4_k(blocks):
    scale, offset = _k_affine(blocks)
    return _nibbles(blocks[:, 16:], 32), scale, offset, 4, 32


def _q5_k(blocks):
    scale, offset = _k_affine(blocks)
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 48:], 32).reshape(n, 8, 32)
    # Bit j of qh[i] is the fifth bit of element i of sub-block j.
    qh = blocks[:, 16:48].reshape(n, 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return (low | (high << 4)).reshape(n, -1), scale, offset, 5, 32


def _q6_k(blocks):
    n = blocks.shape[0]
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)  # [n, 16]
    d = _f16(blocks[:, 208:210])
    # Each half (128 elements) uses 64 bytes of ql (low nibbles: elements 0-63, high:
    # 64-127) and 32 bytes of qh (2-bit pairs 0-3 for elements 0-31, 32-63, ...).
    low = _nibbles(ql, 64).reshape(n, 2, 128)
    high = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = low | (high.reshape(n, 2, 128) << 4)
    scale = d * sc
    return codes.reshape(n, -1), scale, -32 * scale, 6, 16


_DECODERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
