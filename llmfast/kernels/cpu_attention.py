"""Paged attention for CPU runs, vectorised over decode rows.

The reference implementation loops over requests in Python, which at 30 layers and
dozens of decoding requests costs more than the matmuls. Here all single-token (decode)
rows of a step are served by one gather + two batched matmuls per layer, in chunks
that bound the gathered bytes; prefill chunks use SDPA with an explicit causal mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Upper bound on gathered key elements per decode chunk (keeps temporaries ~64 MiB fp32).
_MAX_GATHER_ELEMENTS = 1 << 24


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
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    decode_rows, prefill_rows = [], []
    for r in range(len(lens)):
        num_q = starts[r + 1] - starts[r]
        if num_q == 1:
            decode_rows.append(r)
        elif num_q > 1:
            prefill_rows.append(r)
    if decode_rows:
        _decode(q, k_cache, v_cache, block_table, starts, lens, decode_rows, scale, out)
    for r in prefill_rows:
        _prefill(q, k_cache, v_cache, block_table, starts[r], starts[r + 1], lens[r], r,
                 scale, out)


def _decode(q, k_cache, v_cache, block_table, starts, lens, rows, scale, out) -> None:
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    # Longest first, so each chunk pads to a similar length.
    rows = sorted(rows, key=lambda r: -lens[r])
    i = 0
    while i < len(rows):
        max_len = lens[rows[i]]
        num_blocks = -(-max_len // block_size)
        per_row = num_blocks * block_size * num_kv_heads * head_dim
        chunk = rows[i : i + max(1, _MAX_GATHER_ELEMENTS // per_row)]
        i += len(chunk)
        idx = torch.tensor(chunk)
        tokens = torch.tensor([starts[r] for r in chunk])
        blocks = block_table[idx, :num_blocks].long().view(-1)  # [D * num_blocks]
        # [D, L, num_kv_heads, head_dim] with L = num_blocks * block_size; index_select
        # is several times faster than advanced indexing here.
        shape = (len(chunk), num_blocks * block_size, num_kv_heads, head_dim)
        keys = k_cache.index_select(0, blocks).view(shape).float()
        values = v_cache.index_select(0, blocks).view(shape).float()
        queries = q[tokens].float().view(len(chunk), num_kv_heads, group, head_dim)
        # [D, num_kv_heads, group, L]
        scores = torch.einsum("dkgh,dlkh->dkgl", queries, keys) * scale
        valid = torch.arange(keys.shape[1]) < torch.tensor([lens[r] for r in chunk])[:, None]
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        # Slots past seq_len in the last block may hold anything (even NaN from a stale
        # block); 0 * NaN is NaN, so zero them in the gathered copy.
        values.masked_fill_(~valid[:, :, None, None], 0.0)
        result = torch.einsum("dkgl,dlkh->dkgh", probs, values)
        out[tokens] = result.reshape(len(chunk), -1, head_dim).to(out.dtype)


def _prefill(q, k_cache, v_cache, block_table, q_start, q_end, seq_len, row, scale, out):
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_q = q_end - q_start
    blocks = block_table[row, : -(-seq_len // block_size)].long()
    keys = k_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, hd]
    values = v_cache.index_select(0, blocks).flatten(0, 1)[:seq_len]
    group = q.shape[1] // num_kv_heads
    # Query i sits at position seq_len - num_q + i and sees positions <= its own.
    q_pos = torch.arange(seq_len - num_q, seq_len)[:, None]
    mask = torch.arange(seq_len)[None, :] <= q_pos  # [num_q, seq_len]
    dtype = torch.float32
    result = F.scaled_dot_product_attention(
        q[q_start:q_end].transpose(0, 1).to(dtype),  # [num_heads, num_q, head_dim]
        keys.transpose(0, 1).to(dtype).repeat_interleave(group, dim=0),
        values.transpose(0, 1).to(dtype).repeat_interleave(group, dim=0),
        attn_mask=mask,
        scale=scale,
    )
    out[q_start:q_end] = result.transpose(0, 1).to(out.dtype)
