"""Triton kernels of the unified paged attention (any mix of decode rows and prefill
chunks in one launch); the launch side is launch.py.

Design
- Grid (query tiles, kv heads, kv splits). Each request's query tokens are cut into tiles
  of BLOCK_Q tokens; request r's tiles are numbered from `query_start_loc[r] // BLOCK_Q + r`,
  which bounds the total by `num_tokens // BLOCK_Q + num_reqs` (a host-known count). A
  program finds its request inside the kernel (a guess exact for decode steps, checked,
  else a binary search over query_start_loc), so the launch never reads a device value
  (CUDA-graph safe); surplus tiles exit at once.
- Decode region (DECODE_REGION, prefill-like launches of several requests): a request
  with at most DEC_BLOCK_Q query tokens (a decode among chunked prefills) is not given a
  prefill-sized tile, most of whose rows would be padding (16x the tensor-core work at
  64 rows per tile and a group of 4), but programs of its own past the query tiles:
  `dec_splits` per request, each with decode-sized tiles (DEC_BLOCK_Q tokens,
  DEC_BLOCK_N keys) over its share of the context, merged like a decode launch's. The
  query tiles of such a request exit at once, and the region's programs of a longer
  request. The program count stays host-known: query tiles + num_reqs * dec_splits.
- GQA packing: a program holds BLOCK_Q tokens x all query heads of one kv head
  (BLOCK_M = BLOCK_Q * GROUP_P rows), so each K/V tile is loaded once per group.
- The loop walks the context in BLOCK_N-key tiles, gathering physical blocks through the
  block table per key (BLOCK_N need not equal block_size), with an online softmax in
  fp32 (exp2, scale folded in) and a causal mask against each row's position.
- Sliding window (SLIDING, a layer's window a runtime argument): a row at position p
  sees keys (p - window, p]. The key tiles before the tile's first row's window are not
  visited (`_first_kv_tile` moves the loop's start, and the KV splits divide the tiles
  from there, so decode work is bounded by the window, not the context); the tiles
  that some row's window has left run masked before the unmasked bulk. SLIDING off
  compiles the code as it was.
- KV cache dtype: the cache is in q's dtype, or in float8_e4m3fn (--kv-cache-dtype fp8,
  scale 1.0) whose loads are converted to q's dtype before the dots (CONVERT_KV).
- This step's own tokens: the op writes their K/V into the cache (kv_write.py, or
  rope_cache.py, which rotates q and k first) before this kernel runs, and the kernel
  reads every key, the step's own included, from the cache: with an fp8 cache the step
  attends to its own K/V as rounded to fp8, never to the fresh higher-precision k/v.
- Uniform decode with RoPE (`_decode_rope_attention_kernel`: one new token per
  request, the model's rotation fused into the op): one launch instead of rope_cache.py's
  and this one. A program per (request, kv head, split); q is loaded first (its loads
  in flight with the new key's), the split holding the last key tile writes the new key
  (rotated) and value into the cache, then a CTA barrier, q is rotated, and the key
  loop reads the new key and value with the rest. Only that
  program reads them: a request's one token is one query tile. The same numerics as the
  two kernels (rotation, rounding, fp8 conversion).
- `q` may be `out` itself (the fused rotation leaves the rotated queries there): a
  program reads its rows of q before it, or the last split of its tile, writes those
  rows of out, and no two tiles share a row.
- Flash-decoding: with few decode rows and long contexts the kv-split axis cuts the
  context into up to `num_splits` ranges; each writes unnormalised partials (acc, max,
  sum) to a workspace and the last to finish merges them (FUSED_MERGE; else a second
  kernel does). The split counts (`num_splits`, and the decode region's `dec_splits`)
  are runtime arguments under a constexpr bound (SPLIT_BOUND, DEC_SPLIT_BOUND: 1, or the
  most splits any decode launch of the shape takes on the device:
  attention_config.split_bound), so one compiled kernel serves every batch size
  rather than one per split count: a variant not compiled at start-up costs ~1-2 s of
  Triton compilation in the first step that needs it (a mixed step of 2-16 requests
  took 1.9 s on an H100 while the region's split count was a constexpr). The count
  comes from shapes only (the block table's width: a full CUDA graph
  launches for max_model_len), so with the fused merge the kernel sizes the splits for
  the *live* context: at least MIN_SPLIT_TILES key tiles each, the programs past the
  last used split exit at once, and a context that needs one split is written straight
  to `out` with no partials or merge. E.g. num_splits 32, BLOCK_N 64, MIN_SPLIT_TILES 2:
  a 140-key context (3 tiles) uses 2 splits (tiles 0-1, tile 2), an 8192-key one 32
  splits of 4 tiles.
"""

from __future__ import annotations

import triton
import triton.language as tl

from llmfast.attention.triton.kv_write import store_at_slot


@triton.jit
def _attend_kv_tiles(
    acc, l_i, m_i, q, q_pos, tile_from, tile_to, kv_end,
    k_base, v_base, table, offs_d, q_ptr,
    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, scale_log2, window,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CONVERT_KV: tl.constexpr, SLIDING: tl.constexpr,
):
    """Online-softmax update over key tiles [tile_from, tile_to) of one request.

    MASKED=False is for tiles every row of the tile may see whole (the bulk of a long
    context): no causal or bounds masks in the loop. MASKED=True handles the tail, and
    with SLIDING the head: a row at position p sees keys (p - window, p] only.
    CONVERT_KV: the cache's dtype is not q's (an fp8 cache): loaded K/V are converted to
    q's dtype (the compute dtype; scale 1.0) before the dots, and P is rounded to q's
    dtype rather than the cache's. False (a cache in q's dtype) leaves the code as it
    was, so those caches compute bit-identically.
    """
    d_mask = offs_d < HEAD_DIM  # all-true unless head_dim was padded to a power of 2
    for kv_tile in range(tile_from, tile_to):
        offs_n = kv_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        # Paged gather: key n lives in physical block table[n // BLOCK_SIZE].
        if MASKED:
            n_valid = offs_n < kv_end
            block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_valid, other=0)
        else:
            block = tl.load(table + offs_n // BLOCK_SIZE)
        block = block.to(tl.int64)
        k_off = block * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks  # [BLOCK_N]
        v_off = block * stride_vb + (offs_n % BLOCK_SIZE) * stride_vs
        k_ptrs = k_base + k_off[None, :] + offs_d[:, None] * stride_kd  # [HEAD_DIM_P, BLOCK_N]
        v_ptrs = v_base + v_off[:, None] + offs_d[None, :] * stride_vd  # [BLOCK_N, HEAD_DIM_P]
        if MASKED:
            k = tl.load(k_ptrs, mask=n_valid[None, :] & d_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=n_valid[:, None] & d_mask[None, :], other=0.0)
        elif HEAD_DIM != HEAD_DIM_P:
            k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if CONVERT_KV:
            k = k.to(q_ptr.dtype.element_ty)
            v = v.to(q_ptr.dtype.element_ty)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
            if SLIDING:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # P is rounded to the cache dtype for the second matmul (tensor cores); with a
        # converted (fp8) cache to q's, the dtype V was converted to.
        if CONVERT_KV:
            p = p.to(q_ptr.dtype.element_ty)
        else:
            p = p.to(v_base.dtype.element_ty)
        if UPCAST:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


# Not specialized on (Triton would compile a variant for a value of 1, another for
# multiples of 16): counts that change with the batch, and the block table's row stride,
# which is 1 for the start-up memory profile's one-block table and the table's width
# after it (one variant, compiled by that profile, serves both).
@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "num_splits", "dec_splits",
                               "window", "stride_bt"])
def _unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, arrivals_ptr,
    block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    num_reqs, num_tokens, scale_log2, num_splits, dec_splits, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_BOUND: tl.constexpr,
    FUSED_MERGE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CONVERT_KV: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
    DECODE_REGION: tl.constexpr, DEC_BLOCK_Q: tl.constexpr, DEC_BLOCK_N: tl.constexpr,
    DEC_SPLIT_BOUND: tl.constexpr, ONE_KV_LOOP: tl.constexpr, DEC_ONE_KV_LOOP: tl.constexpr,
    SLIDING: tl.constexpr,
):
    kv_head = tl.program_id(1)
    # Query tiles of BLOCK_Q tokens (the main region); with DECODE_REGION, the programs
    # past them are the decode region's, num_reqs x dec_splits of them (module doc).
    num_tiles = num_tokens // BLOCK_Q + num_reqs
    if DECODE_REGION:
        if tl.program_id(0) >= num_tiles:
            # Program num_tiles + r * dec_splits + s: request r's split s. E.g. 3
            # requests, 2 splits, 40 main tiles: programs 40..45 = (r0 s0, r0 s1, r1 s0,
            # r1 s1, r2 s0, r2 s1). Their merge counters are indexed by request: the
            # query tiles beside a region never split, so they use none.
            index = tl.program_id(0) - num_tiles
            req = index // dec_splits
            q_start = tl.load(query_start_loc_ptr + req)
            num_q = tl.load(query_start_loc_ptr + req + 1) - q_start
            seq_len = tl.load(seq_lens_ptr + req)
            if num_q > DEC_BLOCK_Q:  # the main region's request
                return
            _attend_query_tile(
                q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
                part_acc_ptr, part_max_ptr, part_sum_ptr, arrivals_ptr,
                block_table_ptr, req, q_start, num_q, seq_len, 0, kv_head,
                index % dec_splits, dec_splits, req, req * DEC_BLOCK_Q,
                num_reqs * DEC_BLOCK_Q, scale_log2,
                stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
                stride_vb, stride_vs, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
                stride_bt, 0, window,
                NUM_HEADS, GROUP, GROUP_P, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE,
                DEC_BLOCK_Q, DEC_BLOCK_N, DEC_SPLIT_BOUND, DEC_SPLIT_BOUND > 1, UPCAST,
                DOT_PRECISION,
                CONVERT_KV, MIN_SPLIT_TILES, DEC_ONE_KV_LOOP, False, SLIDING,
            )
            return
    # Highest tiles first: in a prefill they see the longest context, and starting the
    # longest programs first shortens the tail of the launch.
    tile = num_tiles - 1 - tl.program_id(0)
    split = tl.program_id(2)

    # Request r owns tiles [qsl[r] // BLOCK_Q + r, qsl[r+1] // BLOCK_Q + r + 1): find the
    # last r whose first tile is <= tile. E.g. BLOCK_Q 4, qsl [0, 1, 18, 19]: requests
    # start at tiles 0, 1, 6 and tile 3 belongs to request 1 (its tokens 8..11).
    # First a guess, right whenever every request so far has one token (a decode step):
    # then qsl[r] = r, request r starts at tile r + r // BLOCK_Q, and tile t belongs to
    # request t - (t + 1) // (BLOCK_Q + 1) (BLOCK_Q 4: tiles 0..10 -> requests 0, 1, 2,
    # 3, 3, 4, 5, 6, 7, 7, 8; tiles 4 and 9 are surplus). Checked against the request's
    # bounds, loaded with its seq_len in one round trip; a miss (prefill tiles) falls
    # back to the binary search, log2(num_reqs) dependent loads.
    guess = tl.minimum(tile - (tile + 1) // (BLOCK_Q + 1), num_reqs - 1)
    q_start = tl.load(query_start_loc_ptr + guess)
    q_end = tl.load(query_start_loc_ptr + guess + 1)
    seq_len = tl.load(seq_lens_ptr + guess)
    # Tiles past the last request's belong to it (surplus): no upper bound for it.
    found = (q_start // BLOCK_Q + guess <= tile) & (
        (tile < q_end // BLOCK_Q + guess + 1) | (guess == num_reqs - 1))
    req = guess
    if not found:
        lo = tl.zeros([], dtype=tl.int32)
        hi = num_reqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            mid_first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            lo = tl.where(mid_first <= tile, mid, lo)
            hi = tl.where(mid_first <= tile, hi, mid - 1)
        req = lo
        # The three loads in one round trip.
        q_start = tl.load(query_start_loc_ptr + req)
        q_end = tl.load(query_start_loc_ptr + req + 1)
        seq_len = tl.load(seq_lens_ptr + req)
    num_q = q_end - q_start
    if DECODE_REGION:
        if num_q <= DEC_BLOCK_Q:  # the decode region's request
            return
    q_lo = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q  # first query of the tile in req
    _attend_query_tile(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        part_acc_ptr, part_max_ptr, part_sum_ptr, arrivals_ptr,
        block_table_ptr, req, q_start, num_q, seq_len, q_lo, kv_head,
        split, num_splits, tile, q_start + q_lo, num_tokens, scale_log2,
        stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
        stride_bt, 0, window,
        NUM_HEADS, GROUP, GROUP_P, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE,
        BLOCK_Q, BLOCK_N, SPLIT_BOUND, FUSED_MERGE, UPCAST, DOT_PRECISION,
        CONVERT_KV, MIN_SPLIT_TILES, ONE_KV_LOOP, False, SLIDING,
    )


@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "num_splits", "window", "stride_bt"])
def _decode_rope_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, arrivals_ptr,
    block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    k_ptr, v_ptr, slot_mapping_ptr, positions_ptr, cos_sin_ptr,
    num_reqs, num_tokens, scale_log2, num_splits, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt, stride_nkt, stride_nkh, stride_nvt, stride_nvh, stride_cs,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_BOUND: tl.constexpr,
    FUSED_MERGE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CONVERT_KV: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr, ONE_KV_LOOP: tl.constexpr,
    CLAMP: tl.constexpr, SLIDING: tl.constexpr,
):
    """Uniform decode (one new token per request) with RoPE and the KV write fused in:
    what rope_cache.py's kernel and this module's kernel do in two launches, in one.
    Program (request, kv head, split). q is rotated after its load
    (`_rotate`), never stored. The new key and value of the kv
    head are written by the one split that reads them, the one holding the last key
    tile, before its key loop (the CTA barrier orders its stores before its loads); no
    other program reads them, as every request has one query tile. Numerics are the
    two kernels', element for element: the same rotation, rounding and fp8 conversion
    (kv_write._cache_value)."""
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    num_q = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    token = q_start.to(tl.int64)
    # (A padding request has no token: `_attend_query_tile` returns at once for it.)
    pos = tl.load(positions_ptr + token, mask=num_q > 0, other=0)
    slot = tl.load(slot_mapping_ptr + token, mask=num_q > 0, other=-1)
    num_kv_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    tile_lo, tile_hi, num_used = _split_range(
        num_kv_tiles, _first_kv_tile(seq_len - num_q, 0, window, BLOCK_N, SLIDING), split,
        num_splits, SPLIT_BOUND, FUSED_MERGE, MIN_SPLIT_TILES)
    # No branch around the write: its loads and the queries' (which need only the token)
    # are all issued before any of them is used, one memory round trip for both instead
    # of the queries' waiting behind the write and its barrier (or, the queries first,
    # the write's behind the queries' rotation, which the compiler places before a
    # branch). Masked off: the write where this program does not write, the queries of a
    # split left empty.
    write = (num_q > 0) & (split < num_used) & (tile_hi == num_kv_tiles) & (slot >= 0)
    offs_d = tl.arange(0, HEAD_DIM_P)[None, :]  # [1, HEAD_DIM_P]
    d_valid = offs_d < HEAD_DIM
    write_mask = d_valid & write
    q_rows, q_mask = _query_rows(q_ptr, q_start, num_q, 0, kv_head, split < num_used,
                                 stride_qt, stride_qh, GROUP, GROUP_P, HEAD_DIM, HEAD_DIM_P,
                                 BLOCK_Q)
    q = tl.load(q_rows + offs_d * stride_qd, mask=q_mask, other=0.0)
    q_partner, q_cos, q_sin = _rope_operands(q_rows, stride_qd, q_mask, cos_sin_ptr, pos,
                                             stride_cs, offs_d, HEAD_DIM // 2)
    k_row = k_ptr + token * stride_nkt + kv_head * stride_nkh
    k = tl.load(k_row + offs_d, mask=write_mask, other=0.0)
    k_partner, k_cos, k_sin = _rope_operands(k_row, 1, write_mask, cos_sin_ptr, pos,
                                             stride_cs, offs_d, HEAD_DIM // 2)
    v = tl.load(v_ptr + token * stride_nvt + kv_head * stride_nvh + offs_d,
                mask=write_mask, other=0.0)
    k = _rotate(k, k_partner, k_cos, k_sin, offs_d, HEAD_DIM // 2)
    store_at_slot(k_cache_ptr, slot, stride_kb, stride_ks,
                   kv_head * stride_kh + offs_d * stride_kd, k, write_mask, BLOCK_SIZE, CLAMP)
    store_at_slot(v_cache_ptr, slot, stride_vb, stride_vs,
                   kv_head * stride_vh + offs_d * stride_vd, v, write_mask, BLOCK_SIZE, CLAMP)
    tl.debug_barrier()
    q = _rotate(q, q_partner, q_cos, q_sin, offs_d, HEAD_DIM // 2)
    _attend_query_tile(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
        part_acc_ptr, part_max_ptr, part_sum_ptr, arrivals_ptr,
        block_table_ptr, req, q_start, num_q, seq_len, 0, kv_head,
        split, num_splits, req, q_start, num_tokens, scale_log2,
        stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
        stride_vb, stride_vs, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
        stride_bt, q, window,
        NUM_HEADS, GROUP, GROUP_P, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE,
        BLOCK_Q, BLOCK_N, SPLIT_BOUND, FUSED_MERGE, UPCAST, DOT_PRECISION,
        CONVERT_KV, MIN_SPLIT_TILES, ONE_KV_LOOP, True, SLIDING,
    )


@triton.jit
def _query_rows(q_ptr, q_start, num_q, q_lo, kv_head, live, stride_qt, stride_qh,
                GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                HEAD_DIM_P: tl.constexpr, BLOCK_Q: tl.constexpr):
    """(rows [BLOCK_M, 1], mask [BLOCK_M, HEAD_DIM_P]): where the query tile of tokens
    [q_lo, q_lo + BLOCK_Q) of a request (starting at token q_start, num_q of them) for the
    query heads of `kv_head` lies, row m being token q_lo + m // GROUP_P, head
    kv_head * GROUP + m % GROUP_P; masked where there is no such row, or everywhere
    unless `live`. Element d of a row: rows + d * stride_qd."""
    offs_m = tl.arange(0, BLOCK_Q * GROUP_P)
    q_local = q_lo + offs_m // GROUP_P
    head = kv_head * GROUP + offs_m % GROUP_P
    row_valid = (q_local < num_q) & (offs_m % GROUP_P < GROUP) & live
    token = (q_start + q_local).to(tl.int64)
    rows = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    return rows, row_valid[:, None] & (tl.arange(0, HEAD_DIM_P)[None, :] < HEAD_DIM)


@triton.jit
def _first_kv_tile(ctx_len, q_lo, window, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """The first key tile a query tile whose first row sits at position ctx_len + q_lo
    can see: 0, or with SLIDING the tile of key ctx_len + q_lo - window + 1, so that the
    tiles wholly before every row's window are never visited (decode cost stops growing
    with the context)."""
    first = ctx_len * 0
    if SLIDING:
        first = tl.maximum(ctx_len + q_lo - window + 1, 0) // BLOCK_N
    return first


@triton.jit
def _split_range(num_kv_tiles, first_tile, split, num_splits, SPLIT_BOUND: tl.constexpr,
                 FUSED_MERGE: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr):
    """(tile_lo, tile_hi, num_used): the key tiles [tile_lo, tile_hi) of split `split`
    of a request's tiles [first_tile, num_kv_tiles), and how many splits hold any. With
    the fused merge the splits are sized for the live context (module doc) and splits >=
    num_used hold none; the second merge kernel reads every split, so then all are
    used, some empty."""
    tile_lo = first_tile
    tile_hi = num_kv_tiles
    num_used = num_kv_tiles * 0 + 1
    if SPLIT_BOUND > 1:
        live_tiles = num_kv_tiles - first_tile
        per_split = (live_tiles + num_splits - 1) // num_splits
        if FUSED_MERGE:
            per_split = tl.maximum(per_split, MIN_SPLIT_TILES)
            num_used = (live_tiles + per_split - 1) // per_split
        else:
            num_used = num_kv_tiles * 0 + num_splits
        tile_lo = first_tile + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_kv_tiles)
    return tile_lo, tile_hi, num_used


@triton.jit
def _rope_operands(rows, stride_d, mask, cos_sin_ptr, pos, stride_cs, offs_d,
                   HALF: tl.constexpr):
    """What rotating the rows at `rows` takes besides the rows themselves, loaded:
    (partner, cos, sin). Each element's partner is from the other half (x[d + HALF] for
    d < HALF, x[d - HALF] after); cos and sin are the table's row of `pos`."""
    first = offs_d < HALF
    within = tl.where(first, offs_d, offs_d - HALF)  # the index into the half
    partner = tl.load(rows + tl.where(first, offs_d + HALF, within) * stride_d, mask=mask,
                      other=0.0)
    valid = offs_d < 2 * HALF
    row = cos_sin_ptr + pos.to(tl.int64) * stride_cs
    cos = tl.load(row + within, mask=valid, other=0.0)
    sin = tl.load(row + HALF + within, mask=valid, other=0.0)
    return partner, cos, sin


@triton.jit
def _rotate(x, partner, cos, sin, offs_d, HALF: tl.constexpr):
    """x rotated (`_rope_operands`' operands), in float32, rounded to x's dtype. The same
    expressions as the rotary kernel's `rotate_halves`, element for element: x1 cos - x2
    sin, then x2 cos + x1 sin."""
    first = offs_d < HALF
    xf = x.to(tl.float32)
    pf = partner.to(tl.float32)
    rotated = tl.where(first, xf * cos - pf * sin, xf * cos + pf * sin)
    return rotated.to(x.dtype)


@triton.jit
def _attend_query_tile(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr, arrivals_ptr,
    block_table_ptr, req, q_start, num_q, seq_len, q_lo, kv_head,
    split, num_splits, counter_tile, part_first, part_rows, scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt, q_given, window,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_BOUND: tl.constexpr,
    FUSED_MERGE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CONVERT_KV: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr, ONE_KV_LOOP: tl.constexpr,
    Q_GIVEN: tl.constexpr, SLIDING: tl.constexpr,
):
    """One program's share of attention: query tokens [q_lo, q_lo + BLOCK_Q) of request
    `req` (starting at token q_start, num_q of them, seq_len keys with them) for the
    query heads of `kv_head`, over KV split `split` of `num_splits` (a runtime value:
    one compiled variant serves every split count; SPLIT_BOUND bounds it, and is 1 for
    an unsplit launch, whose split code is not compiled in).

    With splits, the partials' token rows of this tile start at `part_first` of
    `part_rows` (the main region: the token's own index of num_tokens; the decode
    region: req * BLOCK_Q of num_reqs * BLOCK_Q, so its scratch scales with requests,
    not with the launch's tokens), and the fused merge's counter is `counter_tile`'s.

    Q_GIVEN: the tile's queries are `q_given` ([BLOCK_Q * GROUP_P, HEAD_DIM_P], rows as
    `_query_rows` lays them out: the fused decode kernel loads them before its KV
    write); else they are loaded here."""
    if q_lo >= num_q:  # surplus tile (or a padding request with no tokens)
        return
    ctx_len = seq_len - num_q  # cached prefix before this step's tokens

    # Keys the tile's last query can see; earlier rows are cut by the causal mask.
    kv_end = ctx_len + tl.minimum(q_lo + BLOCK_Q, num_q)
    num_kv_tiles = (kv_end + BLOCK_N - 1) // BLOCK_N
    tile_lo, tile_hi, num_used = _split_range(
        num_kv_tiles, _first_kv_tile(ctx_len, q_lo, window, BLOCK_N, SLIDING), split,
        num_splits, SPLIT_BOUND, FUSED_MERGE, MIN_SPLIT_TILES)
    if split >= num_used:  # a split the live context leaves empty (fused merge)
        return

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    # Row m of the tile is token q_lo + m // GROUP_P, query head kv_head*GROUP + m % GROUP_P.
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_lo + offs_m // GROUP_P
    head = kv_head * GROUP + offs_m % GROUP_P
    row_valid = (q_local < num_q) & (offs_m % GROUP_P < GROUP)
    token = (q_start + q_local).to(tl.int64)
    q_pos = ctx_len + q_local  # [BLOCK_M] position of each row in its sequence
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_valid = offs_d < HEAD_DIM

    if Q_GIVEN:
        q = q_given
    else:
        q_rows, q_mask = _query_rows(q_ptr, q_start, num_q, q_lo, kv_head, True, stride_qt,
                                     stride_qh, GROUP, GROUP_P, HEAD_DIM, HEAD_DIM_P, BLOCK_Q)
        q = tl.load(q_rows + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # A finite floor instead of -inf keeps fully masked rows NaN-free: exp2(-inf - m) = 0.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    table = block_table_ptr + req.to(tl.int64) * stride_bt
    # Keys < ctx_len + q_lo + 1 are visible to every row of the tile: those whole
    # tiles run unmasked, the rest (the causal diagonal) masked. ONE_KV_LOOP: every
    # tile masked, in one loop, so the tail tile's loads are pipelined with the bulk's
    # instead of waiting for that loop to drain (a decode's last split: 1 of ~2-3
    # tiles at short contexts).
    # SLIDING: the tiles before every row's window were skipped (`_first_kv_tile`);
    # those holding a key that some row's window has left (tiles below `tile_bulk`)
    # run masked before the bulk.
    if ONE_KV_LOOP:
        tile_mid = tile_lo
    else:
        tile_bulk = tile_lo
        if SLIDING:
            # The first tile whose keys are all >= kv_end - window (the last row's
            # window start); tiles before it are masked.
            tile_bulk = tl.maximum(
                tl.minimum((tl.maximum(kv_end - window, 0) + BLOCK_N - 1) // BLOCK_N,
                           tile_hi), tile_lo)
            acc, l_i, m_i = _attend_kv_tiles(
                acc, l_i, m_i, q, q_pos, tile_lo, tile_bulk, kv_end, k_base, v_base, table,
                offs_d, q_ptr, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs,
                stride_vd, scale_log2, window, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, BLOCK_N, True,
                UPCAST, DOT_PRECISION, CONVERT_KV, SLIDING,
            )
        num_full = (ctx_len + q_lo + 1) // BLOCK_N
        tile_mid = tl.maximum(tl.minimum(num_full, tile_hi), tile_bulk)
        acc, l_i, m_i = _attend_kv_tiles(
            acc, l_i, m_i, q, q_pos, tile_bulk, tile_mid, kv_end, k_base, v_base, table, offs_d,
            q_ptr, stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, scale_log2,
            window, HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, BLOCK_N, False, UPCAST, DOT_PRECISION,
            CONVERT_KV, SLIDING,
        )
    acc, l_i, m_i = _attend_kv_tiles(
        acc, l_i, m_i, q, q_pos, tile_mid, tile_hi, kv_end, k_base, v_base, table, offs_d, q_ptr,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, scale_log2, window,
        HEAD_DIM, HEAD_DIM_P, BLOCK_SIZE, BLOCK_N, True, UPCAST, DOT_PRECISION, CONVERT_KV,
        SLIDING,
    )

    if num_used == 1:  # (SPLIT_BOUND == 1, or a live context one split covers)
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_i[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
            + offs_d[None, :] * stride_od,
            o.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & d_valid[None, :],
        )
    else:
        # Partials laid out [num_splits, part_rows, NUM_HEADS(, HEAD_DIM_P)], fp32.
        part_token = (part_first + offs_m // GROUP_P).to(tl.int64)  # [BLOCK_M]
        row = (split * part_rows + part_token) * NUM_HEADS + head
        tl.store(part_max_ptr + row, m_i, mask=row_valid)
        tl.store(part_sum_ptr + row, l_i, mask=row_valid)
        tl.store(
            part_acc_ptr + row[:, None] * HEAD_DIM_P + offs_d[None, :],
            acc,
            mask=row_valid[:, None],
        )
        if FUSED_MERGE:
            # The last of the tile's num_used programs to finish merges them: one
            # launch instead of two. The barrier makes every thread's partial stores
            # precede the (gpu-scope, acq_rel) arrival; the last arrival's acquire makes
            # all splits' partials visible, read past L1 (.cg). It resets the counter
            # for the next launch or graph replay. Every program of a tile computes the
            # same num_used, and surplus tiles and unused splits returned above, so
            # every counter touched reaches num_used.
            tl.debug_barrier()
            counter = arrivals_ptr + counter_tile * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_used - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                _merge_tile(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, token,
                            part_token, head, row_valid, offs_d, d_valid, part_rows,
                            num_used, stride_ot, stride_oh, stride_od, NUM_HEADS,
                            HEAD_DIM_P, SPLIT_BOUND)


@triton.jit
def _merge_tile(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, token, part_token, head,
                row_valid, offs_d, d_valid, part_rows, num_used, stride_ot, stride_oh,
                stride_od, NUM_HEADS: tl.constexpr, HEAD_DIM_P: tl.constexpr,
                SPLIT_BOUND: tl.constexpr):
    """out = sum_s w_s acc_s / sum_s w_s l_s, w_s = 2^(m_s - max_s m_s), over splits
    s < num_used, for one tile's rows (`token`: their rows of `out`; `part_token`: of the
    partials, `part_rows` each split). Every split's max and sum come in one load (one
    round trip instead of one per split); then one acc load per split."""
    offs_s = tl.arange(0, SPLIT_BOUND)
    rows = (offs_s[:, None] * part_rows + part_token[None, :]) * NUM_HEADS + head[None, :]
    used = (offs_s[:, None] < num_used) & row_valid[None, :]  # [SPLIT_BOUND, BLOCK_M]
    m = tl.load(part_max_ptr + rows, mask=used, other=-1.0e30, cache_modifier=".cg")
    l_s = tl.load(part_sum_ptr + rows, mask=used, other=0.0, cache_modifier=".cg")
    w = tl.math.exp2(m - tl.max(m, axis=0)[None, :])  # unused splits: weight 0
    l_sum = tl.sum(w * l_s, axis=0)
    l_sum = tl.where(l_sum > 0.0, l_sum, 1.0)
    acc = tl.zeros([token.shape[0], HEAD_DIM_P], dtype=tl.float32)
    for s in range(num_used):
        w_s = tl.sum(tl.where(offs_s[:, None] == s, w, 0.0), axis=0)  # row s of w
        row = (s * part_rows + part_token) * NUM_HEADS + head
        part = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_P + offs_d[None, :],
                       mask=row_valid[:, None], other=0.0, cache_modifier=".cg")
        acc += w_s[:, None] * part
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
        + offs_d[None, :] * stride_od,
        (acc / l_sum[:, None]).to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_valid[None, :],
    )


@triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr,
    num_reqs, num_tokens,
    stride_ot, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    # One program per (token, head) merges that head's splits at once:
    # out = sum_s w_s acc_s / sum_s w_s l_s with w_s = 2^(m_s - max_s m_s). Empty splits
    # hold m = -1e30, l = 0, acc = 0, so their weight underflows to 0. (One program per
    # token, looping over heads and splits, was a single CTA at batch 1: measured ~8 us
    # on an H100 for 512 KB of partials.)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if token >= tl.load(query_start_loc_ptr + num_reqs):  # padding row: no partials
        return
    splits = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_DIM_P)
    row = (splits * num_tokens + token) * NUM_HEADS + head  # [NUM_SPLITS]
    m = tl.load(part_max_ptr + row)
    w = tl.math.exp2(m - tl.max(m, axis=0))
    l_sum = tl.sum(w * tl.load(part_sum_ptr + row), axis=0)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_P + offs_d[None, :])  # [S, D_P]
    o = tl.sum(w[:, None] * acc, axis=0)
    o = o / tl.where(l_sum > 0.0, l_sum, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d * stride_od,
        o.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
