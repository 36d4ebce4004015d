"""Custom ops `llmfast::unified_attention` and `llmfast::reshape_and_cache`.

Registered with `torch.library.custom_op` so that Dynamo records them as single opaque
nodes (the compile backend splits the graph there) and aot/Inductor keep their in-place
writes (every mutated tensor is listed in `mutates_args`).

Dispatch: Triton kernels on CUDA, and on CPU when `TRITON_INTERPRET=1` (tests); on
plain CPU the vectorised torch path in `attention/cpu.py`. The reference implementations
here are the test oracle.

Shapes (T = tokens in the step, padded; R = requests):
    q    [T, num_heads, head_dim]        k, v  [T, num_kv_heads, head_dim]
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping [T] int64 (-1: padding token, not written)
    block_table [R, max_blocks_per_req] int32
    query_start_loc [R + 1] int32 (cumsum of scheduled tokens; rows past
        query_start_loc[R] are padding and their `out` rows are left unspecified)
    seq_lens [R] int32 (context length after this step, new tokens included)
    out  [T, num_heads, head_dim]
    positions [T] int, cos_sin [max_positions, head_dim] float32 (optional, together):
        q and k are not rotated yet; the op applies the rotary embedding first (on the
        Triton path in its KV write, attention/triton/rope_cache.py)
    window (optional int): a sliding-window layer's: the query at position p sees the
        keys at (p - window, p] only (HF's `kv_idx > q_idx - sliding_window`)
"""

from __future__ import annotations

import torch

from llmfast.attention.cpu import paged_attention_cpu
from llmfast.config import FP8_E4M3_MAX
from llmfast.kernels.triton_mode import use_triton


def _triton_attention():
    """llmfast.attention.triton.launch, imported at the first Triton call (a CPU-only process
    never imports Triton's kernels), then bound: an import statement costs ~1 us a call,
    and the eager attention path makes two calls per layer per step."""
    global _ATTENTION
    from llmfast.attention.triton import launch as attention

    _ATTENTION = attention
    return attention


_ATTENTION = None


# ----------------------------------------------------------------------------- reference


def reshape_and_cache_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    has_padding: bool | None = None,
) -> None:
    """`has_padding`: whether slot_mapping holds a -1 (None: look; a step's eager layers
    pass what the first of them found, attention/cpu_step.py)."""
    # A slot indexes the cache viewed as [num_blocks * block_size, num_kv_heads, head_dim];
    # view (not reshape) so a non-contiguous cache fails loudly instead of writing a copy.
    num_tokens = slot_mapping.shape[0]
    if k.shape[0] != num_tokens:
        k, v = k[:num_tokens], v[:num_tokens]
    if has_padding is None:
        has_padding = bool((slot_mapping < 0).any())
    if has_padding:  # padding tokens: drop them
        valid = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    _write_rows(k_flat, slot_mapping, k)
    _write_rows(v_flat, slot_mapping, v)


def _write_rows(cache_flat: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """cache_flat[slots] = x in the cache's dtype. An fp8 cache: clamped to +-448 first
    (e4m3fn has no inf), and copied as bytes (torch has no fp8 index_copy_ on CPU)."""
    if cache_flat.dtype != torch.float8_e4m3fn:
        cache_flat.index_copy_(0, slots, x if x.dtype == cache_flat.dtype
                               else x.to(cache_flat.dtype))
        return
    x = x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(cache_flat.dtype)
    cache_flat.view(torch.uint8).index_copy_(0, slots, x.view(torch.uint8))


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    compute_dtype: torch.dtype = torch.float32,
    window: int | None = None,
) -> None:
    """Causal attention of each request's query tokens over its paged context.

    The query tokens of request r are the last `num_q` tokens of its `seq_len` context,
    so query i (0-based within the request) sits at position seq_len - num_q + i and sees
    context positions 0 .. that position (with a `window`, only the last `window` of
    them).
    """
    num_heads = q.shape[1]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    tables = block_table.cpu() if block_table.device.type != "cpu" else block_table
    for r, seq_len in enumerate(lens):
        q_start, q_end = starts[r], starts[r + 1]
        num_q = q_end - q_start
        if num_q == 0:
            continue
        num_blocks = -(-seq_len // block_size)
        blocks = tables[r, :num_blocks].to(k_cache.device, torch.long)
        # [seq_len, num_kv_heads, head_dim]
        keys = _blocks(k_cache, blocks).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        values = _blocks(v_cache, blocks).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        keys = keys.to(compute_dtype).repeat_interleave(group, dim=1)
        values = values.to(compute_dtype).repeat_interleave(group, dim=1)
        queries = q[q_start:q_end].to(compute_dtype)  # [num_q, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        q_pos = torch.arange(seq_len - num_q, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", probs, values).to(out.dtype)


def _blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks]; an fp8 cache's gathered as bytes (torch's indexing kernels do not
    all take float8 types)."""
    if cache.dtype != torch.float8_e4m3fn:
        return cache[blocks]
    return cache.view(torch.uint8)[blocks].view(cache.dtype)


# ----------------------------------------------------------------------------- ops


@torch.library.custom_op("llmfast::reshape_and_cache", mutates_args=("k_cache", "v_cache"))
def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if use_triton(k):
        (_ATTENTION or _triton_attention()).reshape_and_cache(k, v, k_cache, v_cache,
                                                               slot_mapping)
    else:
        reshape_and_cache_reference(k, v, k_cache, v_cache, slot_mapping)


@reshape_and_cache.register_fake
def _(k, v, k_cache, v_cache, slot_mapping) -> None:
    return None


def unified_attention_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    positions: torch.Tensor | None = None,
    cos_sin: torch.Tensor | None = None,
    max_query_len: torch.Tensor | None = None,
    window: int | None = None,
) -> None:
    """The op's body. Eager callers may call it directly: the custom-op dispatcher adds
    ~90 us per call on CPU, 30 calls a step; compiled graphs must use the op. (The eager
    CPU decoder's own path, `Attention.attend_cpu`, calls the torch branch's two
    functions itself with its step's memo.)"""
    triton = use_triton(q)
    if positions is not None and not triton:  # torch: rotate, then as usual
        q, k = _rotate_reference(positions, q, cos_sin), _rotate_reference(positions, k, cos_sin)
        positions = None
    if triton:
        attention = _ATTENTION or _triton_attention()
        if positions is not None:
            # Rotation and KV write first (the rotated queries go to `out`, which the
            # attention then reads and overwrites: each of its programs reads its rows
            # of q before any program writes those rows of out), or for a uniform
            # decode step inside the attention kernel itself (triton/launch.py).
            # (max_query_len lives on the CPU: reading it waits for nothing; ~0.2 us.)
            uniform = max_query_len is not None and max_query_len.item() <= 1
            attention.unified_attention(
                q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, out,
                new_tokens=(k, v, slot_mapping, positions, cos_sin), uniform_decode=uniform,
                window=window)
            return
        attention.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
        attention.unified_attention(
            q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, out,
            window=window,
        )
    else:
        reshape_and_cache_reference(k, v, k_cache, v_cache, slot_mapping)
        paged_attention_cpu(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale,
                            out, window)


@torch.library.custom_op(
    "llmfast::unified_attention", mutates_args=("k_cache", "v_cache", "out")
)
def unified_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    positions: torch.Tensor | None = None,
    cos_sin: torch.Tensor | None = None,
    max_query_len: torch.Tensor | None = None,
    window: int | None = None,
) -> None:
    """(Rotate q and k, when positions are given,) write the new tokens' k/v into the
    paged cache, then attend (see module doc). `max_query_len` ([1] int32, CPU): 1 for a
    uniform decode step (AttentionMetadata)."""
    unified_attention_impl(
        q, k, v, k_cache, v_cache, slot_mapping, block_table, query_start_loc, seq_lens, scale,
        out, positions, cos_sin, max_query_len, window,
    )


@unified_attention.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, block_table, query_start_loc, seq_lens, scale,
      out, positions=None, cos_sin=None, max_query_len=None, window=None):
    return None


def _rotate_reference(positions: torch.Tensor, x: torch.Tensor,
                      cos_sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated as the rotary reference does."""
    from llmfast.kernels.layers.rotary_reference import rotary_reference, rotate_sign

    return rotary_reference(positions, x, cos_sin, rotate_sign(x.device))


def direct_impl(target) -> object | None:
    """The plain Python implementation behind a splitting op, for the split graph to call
    instead of the op: outside Inductor's pieces nothing needs the dispatcher, and going
    through `custom_op`'s wrappers costs ~150 us a call on CPU (30 calls per step)."""
    if target in SPLITTING_OPS["llmfast::unified_attention"]:
        return unified_attention_impl
    return None


# Dynamo records a call as either the overload packet or its `.default` overload.
SPLITTING_OPS = {
    "llmfast::unified_attention": (
        torch.ops.llmfast.unified_attention,
        torch.ops.llmfast.unified_attention.default,
    ),
}
