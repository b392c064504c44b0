"""The Triton kernels of the GPU path: a KV-store kernel and one paged attention kernel (with, for
decode steps too small to fill the GPU, a split-KV pair beside it).

Imported only through :func:`bm.runtime.triton.kernels` (which decides compiled vs interpreted first):
``triton.jit`` fixes that choice when this module is imported.

KV layout per layer, as everywhere in bm: ``[2, kv_heads, num_blocks, tokens_per_block, head_dim]``
(an int8 cache's rows 4 bytes wider, for their scales: :mod:`bm.runtime.triton.kv_rows`, which writes
and widens a quantized cache's rows for these kernels).
The attention kernel serves every query of a packed batch in one launch per layer: decode rows (one
query each), whole prompts and chunks after a cached prefix alike. One program handles ``BLOCK_Q``
consecutive queries of one sequence times the ``GROUP`` query heads sharing one KV head (so grouped
query attention reads each key tile once for the whole group), and walks that sequence's keys tile by
tile through the block table, in place: no gather, no mask tensor. Which sequence a program serves is
found by a binary search over ``cu_seqlens`` (every sequence owns ``cdiv(q_len, BLOCK_Q)`` programs
after ``cu_seqlens[s] // BLOCK_Q + s`` of them), so the grid depends only on the number of tokens and
sequences: a CUDA graph replays it unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl

from bm.runtime.triton.dots import DOT_FAST, DOT_IEEE, DOT_UPCAST  # noqa: F401 (the launchers' names)
from bm.runtime.triton.dots import dot as _dot
from bm.runtime.triton.kv_rows import store_rows, widen


@triton.jit
def store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_stride_h,
    k_stride_t,
    v_stride_h,
    v_stride_t,
    c_stride_h,
    c_stride_b,
    c_stride_t,
    k_scale,
    v_scale,
    TOKENS_PER_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Write one token's key and value (one KV head) at its slot, as the cache stores rows
    (:mod:`bm.runtime.triton.kv_rows`; ``k_scale``/``v_scale``: an fp8 layer's); a negative slot is a
    padding row. Keys and values have strides of their own: values split from a stacked q/k/v product
    step by its width."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD_DIM
    one = tl.arange(0, 1)  # the token's one row, as the row store takes rows
    k_src = head * k_stride_h + token * k_stride_t + offs_d
    v_src = head * v_stride_h + token * v_stride_t + offs_d
    row = head * c_stride_h + (slot // TOKENS_PER_BLOCK) * c_stride_b
    row += (slot % TOKENS_PER_BLOCK) * c_stride_t + one
    key = tl.load(key_ptr + k_src[None, :], mask=d_ok[None, :])
    value = tl.load(value_ptr + v_src[None, :], mask=d_ok[None, :])
    store_rows(k_cache_ptr, row, key, one >= 0, d_ok, k_scale, HEAD_DIM, HEAD_PAD, KV_QUANT)
    store_rows(v_cache_ptr, row, value, one >= 0, d_ok, v_scale, HEAD_DIM, HEAD_PAD, KV_QUANT)


@triton.jit
def _find_sequence(cu_q_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose programs include ``q_block``: the last s with cu_q[s] // BLOCK_Q + s <= q_block."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_q_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# A run's batches differ in their sequence count and block-table width, and Triton would compile one
# variant per class of each (1, a multiple of 16, neither: up to nine prompt variants, about 0.5 s each,
# met mid-run by the first steps of a new mix; gpu_check's first run on an H100 paid 1.8 s of them after
# warm-up). Neither feeds vectorized addressing, so they are left unspecialized: one variant per tile.
@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, start, bound, query_pos, slope, scale, softcap, window, sink_tokens, table_row_ptr,
    k_cache_ptr, v_cache_ptr, c_head, c_stride_b, c_stride_t, offs_d, d_ok, k_scale, v_scale,
    BLOCK_N: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr, USE_WINDOW: tl.constexpr, DOT: tl.constexpr, HEAD_DIM: tl.constexpr,
    KV_QUANT: tl.constexpr,
):  # fmt: skip
    """One tile of keys ``start...`` (those below ``bound``) read through the sequence's block table and
    folded into the online softmax of ``q``'s rows (running max ``m_i``, sum ``l_i``, output ``acc``),
    the one tile step of both attention kernels. ``query_pos``: each row's position, as a column (one
    per row) or a single value (a decode row's query heads). A quantized cache's keys and values are
    widened to ``q``'s dtype in registers (:func:`bm.runtime.triton.kv_rows.widen`)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    blk = tl.load(table_row_ptr + offs_n // TOKENS_PER_BLOCK, mask=offs_n < bound, other=-1)
    n_ok = (offs_n < bound) & (blk >= 0)  # a block outside every window may be gone (-1)
    slot = c_head + blk.to(tl.int64) * c_stride_b + (offs_n % TOKENS_PER_BLOCK) * c_stride_t
    k = tl.load(k_cache_ptr + slot[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    k = widen(k, k_cache_ptr + slot[None, :] + HEAD_DIM, k_scale, n_ok[None, :], q.dtype, KV_QUANT)
    s = _dot(q, k, DOT) * scale
    if USE_SOFTCAP:
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)  # softcap * tanh(s / softcap)
    if USE_ALIBI:
        s += slope[:, None] * (offs_n[None, :] - query_pos).to(tl.float32)
    allowed = n_ok[None, :] & (offs_n[None, :] <= query_pos)
    if USE_WINDOW:
        allowed &= (offs_n[None, :] > query_pos - window) | (offs_n[None, :] < sink_tokens)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + slot[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    v = widen(v, v_cache_ptr + slot[:, None] + HEAD_DIM, v_scale, n_ok[:, None], q.dtype, KV_QUANT)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_seqs", "bt_stride"])
def paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    cu_q_ptr,
    sinks_ptr,
    alibi_ptr,
    scale,
    softcap,
    window,
    sink_tokens,
    k_scale,
    v_scale,
    num_seqs,
    bt_stride,
    q_stride_h,
    q_stride_t,
    o_stride_t,
    o_stride_h,
    c_stride_h,
    c_stride_b,
    c_stride_t,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_sequence(cu_q_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    local = (q_block - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if local >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len  # keys cached before this forward's queries

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    row = local + offs_m // GROUP  # query index within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (row < q_len)
    d_ok = offs_d < HEAD_DIM
    token = (q_start + row).to(tl.int64)
    q = tl.load(
        q_ptr + head[:, None].to(tl.int64) * q_stride_h + token[:, None] * q_stride_t + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    query_pos = context + row

    if USE_SINKS:  # a learned logit per head in the softmax's denominator: start the sum with it
        m_i = tl.load(sinks_ptr + head, mask=row_ok, other=-1.0e30).to(tl.float32)
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32)

    kv_end = context + tl.minimum(local + BLOCK_Q, q_len)
    kv_start = 0
    if USE_WINDOW:  # keys before the first query's window are skipped, unless sink tokens stay attended
        lowest = tl.maximum(0, context + local - window + 1) // BLOCK_N * BLOCK_N
        kv_start = tl.where(sink_tokens == 0, lowest, 0)
    c_head = kv_head.to(tl.int64) * c_stride_h
    for start in range(kv_start, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start, kv_end, query_pos[:, None], slope, scale, softcap, window,
            sink_tokens, block_table_ptr + seq * bt_stride, k_cache_ptr, v_cache_ptr, c_head, c_stride_b,
            c_stride_t, offs_d, d_ok, k_scale, v_scale, BLOCK_N, TOKENS_PER_BLOCK, USE_SOFTCAP, USE_ALIBI,
            USE_WINDOW, DOT, HEAD_DIM, KV_QUANT,
        )  # fmt: skip

    acc = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # padding rows: no keys, nothing stored
    dst = out_ptr + token[:, None] * o_stride_t + head[:, None].to(tl.int64) * o_stride_h + offs_d[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# Split-KV (flash-decoding) attention for decode-only batches, in two launches. The kernel above gives
# a decode step one program per (sequence, KV head): with few sequences or few KV heads (SmolLM2's 3)
# too few to keep every SM reading keys. Pass 1 cuts each sequence's key tiles into splits, one program
# per (sequence, KV head, split), each writing its unnormalised accumulator and its running max and sum
# to scratch; pass 2 merges a sequence's splits per query head with the log-sum-exp rescaling.
#
# How a sequence's tiles are split depends only on its own length, the split count and the tile size
# (``max(cdiv(tiles, num_splits), MIN_TILES)`` tiles per split): a CUDA graph captured with
# one split count serves every later context, the splits a short sequence cannot fill exit at once
# (pass 2 recomputes how many had work and reads only those), and a sequence that fits one split gets
# the single-pass kernel's very bits (the same tiles in the same order, merged with a weight of 1;
# except with sink logits, which the single-pass kernel folds in first and pass 2 last).


@triton.jit
def _decode_tiles(seq_len, window, sink_tokens, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr):
    """The key tiles a decode row (at position ``seq_len - 1``) reads, as one virtual range
    ``[0, n_tiles)``: tile ``i`` starts at ``i * BLOCK_N``, plus ``shift`` once ``i >= sink_tiles``.

    Without a window every tile up to the row. With one, the tiles holding the sink tokens, then those
    from the window's first tile on: the masked tiles between them are not walked at all (the single-pass
    kernel walks them and adds exact zeros)."""
    sink_tiles = seq_len * 0  # int32 zeros, typed as the windowed branch's values
    shift = seq_len * 0
    if USE_WINDOW:
        lowest = tl.maximum(0, seq_len - window) // BLOCK_N * BLOCK_N
        sink_tiles = (tl.minimum(sink_tokens, seq_len) + BLOCK_N - 1) // BLOCK_N
        shift = tl.maximum(lowest - sink_tiles * BLOCK_N, 0)
    n_tiles = (seq_len - shift + BLOCK_N - 1) // BLOCK_N
    return n_tiles, sink_tiles, shift


# The split count is a plain argument (not a constexpr): each decode bucket may choose another, and
# none of them should compile a variant of its own.
@triton.jit(do_not_specialize=["num_splits", "bt_stride"])
def split_kv_decode_kernel(
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    alibi_ptr,
    scale,
    softcap,
    window,
    sink_tokens,
    k_scale,
    v_scale,
    num_splits,
    bt_stride,
    q_stride_h,
    q_stride_t,
    c_stride_h,
    c_stride_b,
    c_stride_t,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_TILES: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_ALIBI: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Pass 1: one split of one decode row's keys for the ``GROUP`` query heads of one KV head.

    Row ``seq`` of the batch is sequence ``seq``'s one query (a decode-only batch). Writes, per query
    head, ``acc`` (sum of exp(score - max) * value), ``max`` and ``sum`` at
    ``[(seq * heads + head) * num_splits + split]``; a split with no tiles writes nothing."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    n_tiles, sink_tiles, shift = _decode_tiles(seq_len, window, sink_tokens, BLOCK_N, USE_WINDOW)
    per_split = tl.maximum((n_tiles + num_splits - 1) // num_splits, MIN_TILES)
    first = split * per_split
    if first >= n_tiles:
        return
    last = tl.minimum(first + per_split, n_tiles)
    query_pos = seq_len - 1

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    head = kv_head * GROUP + offs_m
    row_ok = offs_m < GROUP
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + head[:, None].to(tl.int64) * q_stride_h + seq.to(tl.int64) * q_stride_t + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if USE_ALIBI:
        slope = tl.load(alibi_ptr + head, mask=row_ok, other=0.0).to(tl.float32)

    c_head = kv_head.to(tl.int64) * c_stride_h
    for tile in range(first, last):
        start = tile * BLOCK_N + tl.where(tile >= sink_tiles, shift, 0)
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, start, seq_len, query_pos, slope, scale, softcap, window, sink_tokens,
            block_table_ptr + seq * bt_stride, k_cache_ptr, v_cache_ptr, c_head, c_stride_b, c_stride_t,
            offs_d, d_ok, k_scale, v_scale, BLOCK_N, TOKENS_PER_BLOCK, USE_SOFTCAP, USE_ALIBI, USE_WINDOW,
            DOT, HEAD_DIM, KV_QUANT,
        )  # fmt: skip

    part = ((seq * GROUP * tl.num_programs(1) + head) * num_splits + split).to(tl.int64)
    tl.store(part_max_ptr + part, m_i, mask=row_ok)
    tl.store(part_sum_ptr + part, l_i, mask=row_ok)
    tl.store(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :]
    )


@triton.jit(do_not_specialize=["num_splits"])
def split_kv_combine_kernel(
    out_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    seq_lens_ptr,
    sinks_ptr,
    window,
    sink_tokens,
    num_splits,
    o_stride_t,
    o_stride_h,
    BLOCK_N: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    MIN_TILES: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    """Pass 2: one query head of one decode row, its splits merged: each split's partial is weighted by
    ``exp(max_split - max_all)``, and the sum of weighted sums divides. gpt-oss's sink logit joins here,
    once, as one more term of the denominator (and of the max)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    n_tiles, _sink_tiles, _shift = _decode_tiles(seq_len, window, sink_tokens, BLOCK_N, USE_WINDOW)
    per_split = tl.maximum((n_tiles + num_splits - 1) // num_splits, MIN_TILES)
    used = (n_tiles + per_split - 1) // per_split  # the splits pass 1 wrote

    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_ok = offs_s < used
    d_ok = offs_d < HEAD_DIM
    part = ((seq * tl.num_programs(1) + head) * num_splits).to(tl.int64) + offs_s
    m_s = tl.load(part_max_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_sum_ptr + part, mask=s_ok, other=0.0)
    acc_s = tl.load(
        part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_all = tl.max(m_s, 0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
    w = tl.where(s_ok, tl.exp(m_s - m_all), 0.0)
    total = tl.sum(w * l_s, 0)
    if USE_SINKS:
        total += tl.exp(sink - m_all)
    acc = tl.sum(w[:, None] * acc_s, 0) / total
    dst = out_ptr + seq.to(tl.int64) * o_stride_t + head.to(tl.int64) * o_stride_h + offs_d
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=d_ok)
