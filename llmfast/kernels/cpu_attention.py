"""Paged attention for CPU runs, vectorised over decode rows.

The reference implementation loops over requests in Python, which at 30 layers and
dozens of decoding requests costs more than the matmuls. Here:
- the step's *plan* (which rows decode, their gather indices and masks) depends only on
  the attention metadata, which is the same for every layer of a step, so it is built
  once and memoised on the metadata's bytes (a few KiB; hashing them costs microseconds);
- all single-token (decode) rows are served by one gather and one SDPA call per chunk,
  the GQA group folded into SDPA's query-length axis;
- prefill chunks use SDPA with an explicit causal mask and `enable_gqa`.

Slots past a request's context in its last block may hold stale values of an earlier
request: they are masked out of the softmax. They are always finite because the runner
zero-fills the cache at allocation (0 * NaN would otherwise leak into the output).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

# Upper bound on gathered key elements per decode chunk (keeps temporaries ~64 MiB fp32).
_MAX_GATHER_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class _DecodeChunk:
    tokens: torch.Tensor  # [D] rows of q / out
    blocks: torch.Tensor  # [D * num_blocks] cache blocks to gather, row-major
    mask: torch.Tensor  # [D, 1, 1, L] True where the key position is in the context
    num_blocks: int


@dataclass(frozen=True)
class _PrefillRow:
    q_start: int
    q_end: int
    seq_len: int
    blocks: torch.Tensor  # [ceil(seq_len / block_size)]
    mask: torch.Tensor  # [num_q, seq_len] causal: query i sees positions <= its own


@dataclass(frozen=True)
class _Plan:
    decode: tuple[_DecodeChunk, ...]
    prefill: tuple[_PrefillRow, ...]


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    table = np.ascontiguousarray(block_table.numpy())
    plan = _build_plan(
        query_start_loc.numpy().tobytes(),
        seq_lens.numpy().tobytes(),
        table.tobytes(),
        table.shape,
        block_size,
        num_kv_heads * head_dim,
    )
    for chunk in plan.decode:
        _decode(q, k_cache, v_cache, chunk, scale, out)
    for row in plan.prefill:
        _prefill(q, k_cache, v_cache, row, scale, out)


@functools.lru_cache(maxsize=4)
def _build_plan(qsl_bytes: bytes, lens_bytes: bytes, table_bytes: bytes,
                table_shape: tuple[int, int], block_size: int, row_elements: int) -> _Plan:
    starts = np.frombuffer(qsl_bytes, dtype=np.int32).astype(np.int64)
    lens = np.frombuffer(lens_bytes, dtype=np.int32).astype(np.int64)
    table = np.frombuffer(table_bytes, dtype=np.int32).reshape(table_shape)
    num_q = np.diff(starts)
    decode_rows = np.flatnonzero(num_q == 1)
    # Longest first, so each chunk pads to a similar length.
    decode_rows = decode_rows[np.argsort(-lens[decode_rows], kind="stable")]
    decode = []
    i = 0
    while i < len(decode_rows):
        num_blocks = int(-(-lens[decode_rows[i]] // block_size))
        per_row = num_blocks * block_size * row_elements
        rows = decode_rows[i : i + max(1, _MAX_GATHER_ELEMENTS // per_row)]
        i += len(rows)
        positions = np.arange(num_blocks * block_size)
        decode.append(_DecodeChunk(
            tokens=torch.from_numpy(starts[rows]),
            blocks=torch.from_numpy(table[rows, :num_blocks].astype(np.int64).reshape(-1)),
            mask=torch.from_numpy(positions[None, :] < lens[rows, None])[:, None, None, :],
            num_blocks=num_blocks,
        ))
    prefill = []
    for r in np.flatnonzero(num_q > 1):
        n, seq_len = int(num_q[r]), int(lens[r])
        q_pos = np.arange(seq_len - n, seq_len)[:, None]
        prefill.append(_PrefillRow(
            q_start=int(starts[r]),
            q_end=int(starts[r + 1]),
            seq_len=seq_len,
            blocks=torch.from_numpy(table[r, : -(-seq_len // block_size)].astype(np.int64)),
            mask=torch.from_numpy(np.arange(seq_len)[None, :] <= q_pos),
        ))
    return _Plan(tuple(decode), tuple(prefill))


def _decode(q, k_cache, v_cache, chunk: _DecodeChunk, scale: float, out) -> None:
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_rows = chunk.tokens.shape[0]
    group = q.shape[1] // num_kv_heads
    length = chunk.num_blocks * block_size
    # [D, L, num_kv_heads, head_dim] -> strided [D, num_kv_heads, L, head_dim] views.
    shape = (num_rows, length, num_kv_heads, head_dim)
    keys = k_cache.index_select(0, chunk.blocks).view(shape).transpose(1, 2)
    values = v_cache.index_select(0, chunk.blocks).view(shape).transpose(1, 2)
    # The group's query heads become SDPA's query positions: [D, num_kv_heads, group, hd].
    queries = q.index_select(0, chunk.tokens).view(num_rows, num_kv_heads, group, head_dim)
    dtype = torch.float32
    result = F.scaled_dot_product_attention(
        queries.to(dtype), keys.to(dtype), values.to(dtype), attn_mask=chunk.mask, scale=scale
    )
    out.index_copy_(0, chunk.tokens, result.reshape(num_rows, -1, head_dim).to(out.dtype))


def _prefill(q, k_cache, v_cache, row: _PrefillRow, scale: float, out) -> None:
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    # [seq_len, num_kv_heads, head_dim] -> [num_kv_heads, seq_len, head_dim]
    keys = k_cache.index_select(0, row.blocks).flatten(0, 1)[: row.seq_len].transpose(0, 1)
    values = v_cache.index_select(0, row.blocks).flatten(0, 1)[: row.seq_len].transpose(0, 1)
    dtype = torch.float32
    result = F.scaled_dot_product_attention(
        q[row.q_start : row.q_end].transpose(0, 1).to(dtype),  # [num_heads, num_q, head_dim]
        keys.to(dtype),
        values.to(dtype),
        attn_mask=row.mask,
        scale=scale,
        enable_gqa=True,
    )
    out[row.q_start : row.q_end] = result.transpose(0, 1).to(out.dtype)
