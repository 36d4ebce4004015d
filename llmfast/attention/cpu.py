"""Paged attention for CPU runs, vectorised over decode rows.

The reference implementation loops over requests in Python, which at 30 layers and
dozens of decoding requests costs more than the matmuls. Here:
- the step's *plan* (which rows decode, their gather indices and masks) depends only on
  the attention metadata, which is the same for every layer of a step, so it is built
  once and memoised on the metadata's bytes (a few KiB; hashing them costs microseconds)
  by the cache owner's `AttentionWorkspaces`, which frees it with the cache;
- all single-token (decode) rows are served by one gather and one SDPA call per chunk,
  the GQA group folded into SDPA's query-length axis; a chunk of one row (batch 1)
  slices its keys to the visible ones instead of masking, and a chunk whose rows are
  consecutive slices q and out instead of gathering and scattering them;
- prefill chunks use SDPA with an explicit causal mask and `enable_gqa`;
- a sliding-window layer's plan gathers only the blocks that hold a key some query's
  window reaches (per row from its own first such block), and its masks hide the keys
  that left the window: the work stays bounded by the window, not the context;
- masks are additive float32 (0 or -inf), made once with the plan: SDPA would otherwise
  convert a boolean one in every layer.

An eager step that carries a `CpuStepState` (attention/cpu_step.py) looks its plan up
once per KV-cache group and window (`step_plan`); a call without one (compiled graphs,
tests) finds it in the owner's memo by the metadata's bytes, as each layer did before.

Slots past a request's context in its last block may hold stale values of an earlier
request: they are masked out of the softmax. They are always finite because the runner
zero-fills the cache at allocation (0 * NaN would otherwise leak into the output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from llmfast.attention.workspaces import AttentionWorkspaces

# Upper bound on gathered key elements per decode chunk (keeps temporaries ~64 MiB fp32).
_MAX_GATHER_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class _DecodeChunk:
    tokens: torch.Tensor  # [D] rows of q / out
    blocks: torch.Tensor  # [D * num_blocks] cache blocks to gather, row-major
    # [D, 1, 1, L] float32: 0 where the key position is visible, -inf where not; None
    # for a chunk of one row, whose visible keys are the slice `keys`.
    mask: torch.Tensor | None
    num_blocks: int  # per row, from the row's first block in its window
    first_token: int | None  # tokens[0] when the rows are consecutive, else None
    keys: slice  # the gathered positions attended (all of them when masked)


@dataclass(frozen=True)
class _PrefillRow:
    q_start: int
    q_end: int
    num_keys: int  # keys gathered: the context from the first block any query sees
    blocks: torch.Tensor  # [ceil(num_keys / block_size)]
    mask: torch.Tensor  # [num_q, num_keys] float32 causal (and windowed): 0 where query i sees


@dataclass(frozen=True)
class _Gathered:
    """One decode chunk's or prefill row's gather targets in a plan's buffer, and the
    views attention reads them through (made once per plan and cache layout: every
    layer of the step gathers into the same places)."""

    k_out: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_out: torch.Tensor
    # decode: strided [D, kv_heads, L', head_dim]; prefill: [kv_heads, num_keys, head_dim]
    keys: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class _Workspace:
    buffer: torch.Tensor  # [2, max_gather_blocks, block_size, kv_heads, head_dim]
    decode: tuple[_Gathered, ...]  # per decode chunk
    prefill: tuple[_Gathered, ...]  # per prefill row


@dataclass(frozen=True)
class _Plan:
    decode: tuple[_DecodeChunk, ...]
    prefill: tuple[_PrefillRow, ...]
    max_gather_blocks: int  # the most cache blocks one decode chunk or prefill row reads
    # Gathered keys and values (`_Workspace`), allocated by the first layer and reused by
    # the others (keyed by dtype and block shape, as two caches may share a plan). A
    # fresh tensor per gather costs more than the gather: large allocations come straight
    # from mmap, and first-touch page faults on tens of MiB a layer dominated decode at
    # batch 64.
    workspace: dict = field(default_factory=dict, compare=False, hash=False)

    def gathered(self, cache: torch.Tensor) -> _Workspace:
        key = (cache.dtype, cache.shape[1:])
        ws = self.workspace.get(key)
        if ws is None:
            ws = self.workspace[key] = self._workspace(cache)
        return ws

    def _workspace(self, cache: torch.Tensor) -> _Workspace:
        block_size, num_kv_heads, head_dim = cache.shape[1:]
        buf = cache.new_empty((2, self.max_gather_blocks, *cache.shape[1:]))
        decode = []
        for chunk in self.decode:
            k_out, v_out = buf[0, : chunk.blocks.shape[0]], buf[1, : chunk.blocks.shape[0]]
            # [D, L, kv_heads, head_dim] -> strided [D, kv_heads, L', head_dim] (L': the
            # visible slice of a one-row chunk, else L)
            shape = (chunk.tokens.shape[0], chunk.num_blocks * block_size, num_kv_heads,
                     head_dim)
            decode.append(_Gathered(k_out, v_out,
                                    k_out.view(shape)[:, chunk.keys].transpose(1, 2),
                                    v_out.view(shape)[:, chunk.keys].transpose(1, 2)))
        prefill = []
        for row in self.prefill:
            k_out, v_out = buf[0, : row.blocks.shape[0]], buf[1, : row.blocks.shape[0]]
            # [seq_len, kv_heads, head_dim] -> [kv_heads, seq_len, head_dim]
            prefill.append(_Gathered(k_out, v_out,
                                     k_out.flatten(0, 1)[: row.num_keys].transpose(0, 1),
                                     v_out.flatten(0, 1)[: row.num_keys].transpose(0, 1)))
        return _Workspace(buf, tuple(decode), tuple(prefill))


def plan_key(k_cache: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
             seq_lens: torch.Tensor, window: int | None) -> tuple:
    """What a plan depends on: the metadata's bytes, the cache's block layout, the window."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    table = np.ascontiguousarray(block_table.numpy())
    return (query_start_loc.numpy().tobytes(), seq_lens.numpy().tobytes(), table.tobytes(),
            table.shape, block_size, num_kv_heads * head_dim, window)


def step_plan(k_cache: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor,
              seq_lens: torch.Tensor, window: int | None) -> _Plan:
    """The plan of a step's attention over `k_cache`: from the cache owner's memo (built
    there once), or built now where nobody owns the cache."""
    key = plan_key(k_cache, block_table, query_start_loc, seq_lens, window)
    owner = AttentionWorkspaces.of(k_cache)
    return (owner.cpu_plan(key, lambda: _build_plan(*key)) if owner is not None
            else _build_plan(*key))


def paged_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    plan: _Plan | None = None,
) -> None:
    """`plan`: this step's (`step_plan` of the same arguments), if the caller has it."""
    if plan is None:
        plan = step_plan(k_cache, block_table, query_start_loc, seq_lens, window)
    ws = plan.gathered(k_cache)
    for chunk, gathered in zip(plan.decode, ws.decode):
        _decode(q, k_cache, v_cache, chunk, gathered, scale, out)
    for row, gathered in zip(plan.prefill, ws.prefill):
        _prefill(q, k_cache, v_cache, row, gathered, scale, out)


def _additive(visible: np.ndarray) -> torch.Tensor:
    """A boolean mask as SDPA's additive float32 one: 0 where visible, -inf where not."""
    return torch.from_numpy(np.where(visible, np.float32(0), np.float32(-np.inf)))


def _build_plan(qsl_bytes: bytes, lens_bytes: bytes, table_bytes: bytes,
                table_shape: tuple[int, int], block_size: int, row_elements: int,
                window: int | None) -> _Plan:
    starts = np.frombuffer(qsl_bytes, dtype=np.int32).astype(np.int64)
    lens = np.frombuffer(lens_bytes, dtype=np.int32).astype(np.int64)
    table = np.frombuffer(table_bytes, dtype=np.int32).reshape(table_shape)
    num_q = np.diff(starts)
    # Each row's first block any of its queries sees (the first query's window start).
    first_block = np.zeros_like(lens) if window is None else \
        np.maximum(lens - num_q - window + 1, 0) // block_size
    row_blocks = -(-lens // block_size) - first_block  # blocks each row gathers
    decode_rows = np.flatnonzero(num_q == 1)
    # Longest first, so each chunk pads to a similar length.
    decode_rows = decode_rows[np.argsort(-row_blocks[decode_rows], kind="stable")]
    decode = []
    i = 0
    while i < len(decode_rows):
        num_blocks = int(row_blocks[decode_rows[i]])
        per_row = num_blocks * block_size * row_elements
        rows = decode_rows[i : i + max(1, _MAX_GATHER_ELEMENTS // per_row)]
        i += len(rows)
        key_pos = np.arange(num_blocks * block_size)[None, :]
        if window is None:
            blocks = table[rows, :num_blocks]
            visible = key_pos < lens[rows, None]
        else:
            # Row r gathers blocks first_block[r] .. + num_blocks (clipped to the table:
            # the clipped ones are masked out).
            columns = np.minimum(first_block[rows, None] + np.arange(num_blocks),
                                 table.shape[1] - 1)
            blocks = np.take_along_axis(table[rows], columns, axis=1)
            key_pos = key_pos + first_block[rows, None] * block_size
            visible = (key_pos < lens[rows, None]) & (key_pos >= lens[rows, None] - window)
        tokens = starts[rows]
        consecutive = bool((np.diff(tokens) == 1).all())
        if len(rows) == 1:  # its visible keys are one run of the gathered positions
            seen = np.flatnonzero(visible[0])
            mask, keys = None, slice(int(seen[0]), int(seen[-1]) + 1)
        else:
            mask, keys = _additive(visible)[:, None, None, :], slice(None)
        decode.append(_DecodeChunk(
            tokens=torch.from_numpy(tokens),
            blocks=torch.from_numpy(blocks.astype(np.int64).reshape(-1)),
            mask=mask,
            num_blocks=num_blocks,
            first_token=int(tokens[0]) if consecutive else None,
            keys=keys,
        ))
    prefill = []
    for r in np.flatnonzero(num_q > 1):
        n, seq_len, first = int(num_q[r]), int(lens[r]), int(first_block[r])
        q_pos = np.arange(seq_len - n, seq_len)[:, None]
        key_pos = np.arange(first * block_size, seq_len)[None, :]
        visible = key_pos <= q_pos
        if window is not None:
            visible &= key_pos > q_pos - window
        prefill.append(_PrefillRow(
            q_start=int(starts[r]),
            q_end=int(starts[r + 1]),
            num_keys=seq_len - first * block_size,
            blocks=torch.from_numpy(
                table[r, first : -(-seq_len // block_size)].astype(np.int64)),
            mask=_additive(visible),
        ))
    max_gather_blocks = max(
        [c.blocks.shape[0] for c in decode] + [r.blocks.shape[0] for r in prefill], default=0
    )
    return _Plan(tuple(decode), tuple(prefill), max_gather_blocks)


def _gather(k_cache, v_cache, blocks: torch.Tensor, gathered: _Gathered) -> tuple:
    """The keys and values attention reads (float32), after gathering `blocks` into the
    plan's buffer."""
    torch.index_select(k_cache, 0, blocks, out=gathered.k_out)
    torch.index_select(v_cache, 0, blocks, out=gathered.v_out)
    if k_cache.dtype == torch.float32:
        return gathered.keys, gathered.values
    return gathered.keys.float(), gathered.values.float()


def _decode(q, k_cache, v_cache, chunk: _DecodeChunk, gathered: _Gathered, scale: float,
            out) -> None:
    num_kv_heads, head_dim = k_cache.shape[2:]
    num_rows = chunk.tokens.shape[0]
    keys, values = _gather(k_cache, v_cache, chunk.blocks, gathered)
    first = chunk.first_token
    rows = (q[first : first + num_rows] if first is not None
            else q.index_select(0, chunk.tokens))
    # The group's query heads become SDPA's query positions: [D, num_kv_heads, group, hd].
    queries = rows.view(num_rows, num_kv_heads, -1, head_dim)
    result = F.scaled_dot_product_attention(
        queries if queries.dtype == torch.float32 else queries.float(), keys, values,
        attn_mask=chunk.mask, scale=scale,
    ).reshape(num_rows, -1, head_dim)
    if first is not None:
        out[first : first + num_rows] = result
    else:
        out.index_copy_(0, chunk.tokens, result.to(out.dtype))


def _prefill(q, k_cache, v_cache, row: _PrefillRow, gathered: _Gathered, scale: float,
             out) -> None:
    keys, values = _gather(k_cache, v_cache, row.blocks, gathered)
    result = F.scaled_dot_product_attention(
        q[row.q_start : row.q_end].transpose(0, 1).float(),  # [num_heads, num_q, head_dim]
        keys,
        values,
        attn_mask=row.mask,
        scale=scale,
        enable_gqa=True,
    )
    out[row.q_start : row.q_end] = result.transpose(0, 1).to(out.dtype)
