"""The forward kernel of the Triton softmax attention: FlashAttention-2's online softmax over dense
batches, packed sequences and paged key/value caches, with every feature of the contract
(transformer_fast/attention.py), and its Flash-Decoding variant that writes one partial result
per share of the keys (merged by kernels/attention_decode.py).

Grid: (query blocks [x key splits], query heads [key heads with PACK_GQA], batch [+ 1 in packed
layouts]). A program finds its sequence (`_sequence`), returns if its block lies past the
sequence's queries, and streams the key tiles `_key_tiles` leaves it: first those inside every
row's band (no causal/window/bounds checks), then the checked ones. The extra last grid column
of a packed layout writes the rows after the last sequence (out 0; lse as for a row with no key).

PACK_GQA (decoding with grouped-query attention): one program takes the query rows of every
query head of a key head's group, row r being query r // GROUP of head r % GROUP, so each key
tile is read once per key head, not once per query head.
"""

import triton
import triton.language as tl

from ._autotune import autotune
from .attention_common import (_dropout_keep, _key_ok, _key_tiles, _load_rows, _masked_count, _masked_tile, _pages,
                               _scores, _sequence, _split_tiles, _store_rows)
from .attention_tiles import FWD_TILES_FP32, FWD_TILES_LOWP, FWD_TUNE_KEY, fwd_configs, pruner


@triton.jit
def _row_offsets(row_i, row_g, stride_m, stride_h, PACK_GQA: tl.constexpr):
    """Offsets of a block's rows from its first row's pointer: row_i * stride_m, plus row_g *
    stride_h (int64) where the block packs the heads of a group."""
    if PACK_GQA:
        offs = row_i.to(tl.int64) * stride_m + row_g.to(tl.int64) * stride_h
    else:
        offs = row_i * stride_m
    return offs


@triton.jit
def _fwd_tile(acc, l_i, m_i, q, start_n, qi, n_q, k_base, v_base, stride_kb, stride_kn, stride_vb, stride_vn,
              bt_row, page_size, num_pages, mask_base, mask_offs, stride_maskm, stride_maskn, pad_base, stride_padn,
              Nk, shift, win_left, win_right, slope2, qk_scale, softcap2, seed, drop_offset, drop_stride, dropout_p,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
              HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr, CHECK: tl.constexpr, WINDOW_LEFT: tl.constexpr,
              WINDOW_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
              PAGED: tl.constexpr, PACK_GQA: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile [start_n, start_n + BLOCK_N) of the online softmax; CHECK: the tile may hold
    keys outside a row's band or the sequence. qi: the rows' query positions ((BLOCK_M, 1), with
    PACK_GQA) or the first's (the rows follow it). The mask's rows start at mask_base, at
    mask_offs (int64, PACK_GQA) or at stride_maskm."""
    if not PACK_GQA:  # recomputed here rather than held through the loop
        qi = qi + tl.arange(0, BLOCK_M)[:, None]
    nj = tl.arange(0, BLOCK_N)
    offs_n = start_n + nj
    n64 = tl.cast(start_n, tl.int64)
    if PACK_GQA:
        mask_ptrs = mask_base + (mask_offs[:, None] + (offs_n * stride_maskn)[None, :])
    else:  # int32 offsets inside the tile (fewer registers than a column of row pointers)
        mask_ptrs = mask_base + n64 * stride_maskn + (tl.arange(0, BLOCK_M)[:, None] * stride_maskm
                                                      + nj[None, :] * stride_maskn)
    key_ok = _key_ok(offs_n, Nk, pad_base, stride_padn, CHECK, HAS_PAD)
    check_keys: tl.constexpr = CHECK or HAS_PAD
    if PAGED:
        page, in_page = _pages(offs_n, Nk, bt_row, page_size, num_pages)
        k = _load_rows(k_base, page * stride_kb + in_page * stride_kn, key_ok, tl.arange(0, BLOCK_D), HEAD_D,
                       BLOCK_D, check_keys)
    else:
        k = _load_rows(k_base + n64 * stride_kn, nj * stride_kn, key_ok, tl.arange(0, BLOCK_D), HEAD_D, BLOCK_D,
                       check_keys)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s, _ = _scores(qk, qi, offs_n[None, :], key_ok[None, :], n_q, Nk, mask_ptrs, shift, win_left, win_right, slope2,
                   qk_scale, softcap2, IS_CAUSAL, CHECK, WINDOW_LEFT, WINDOW_RIGHT, MASK_KIND, check_keys, HAS_SOFTCAP,
                   HAS_ALIBI)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with no allowed key so far keep m = -inf: subtract 0 instead, so P = exp2(-inf) = 0.
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, drop_offset + start_n, tl.arange(0, BLOCK_M)[:, None], nj[None, :], drop_stride,
                             dropout_p)
        p = tl.where(keep, p, 0.0)
    if PAGED:
        v = _load_rows(v_base, page * stride_vb + in_page * stride_vn, key_ok, tl.arange(0, BLOCK_DV), HEAD_DV,
                       BLOCK_DV, check_keys)
    else:
        v = _load_rows(v_base + n64 * stride_vn, nj * stride_vn, key_ok, tl.arange(0, BLOCK_DV), HEAD_DV, BLOCK_DV,
                       check_keys)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _fwd_store(acc, l_i, m_i, out_base, out_offs, lse_ptrs, part_base, part_offs, lse_part_ptrs, row_ok, sink,
               dropout_p,
               HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_SINKS: tl.constexpr,
               HAS_DROPOUT: tl.constexpr, SPLIT: tl.constexpr):
    """Writes a block's rows: out and lse (natural log; a row with no allowed key gets out 0 and
    lse = its sink (natural log), else +inf), or with SPLIT the partial out (fp32, normalised by this split's
    sum) and the partial lse (base 2, -inf without keys) at part_base + part_offs, lse_part_ptrs."""
    offs_dv = tl.arange(0, BLOCK_DV)
    if SPLIT:
        empty = l_i == 0.0
        inv_l = 1.0 / tl.where(empty, 1.0, l_i)
        if HAS_DROPOUT:
            inv_l = inv_l / (1.0 - dropout_p)
        _store_rows(part_base, part_offs, row_ok, offs_dv, acc * inv_l[:, None], HEAD_DV, BLOCK_DV)
        tl.store(lse_part_ptrs, tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i))), mask=row_ok)
    else:
        if HAS_SINKS:  # the sink (natural log) joins the denominator and the maximum
            sink2 = sink * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink2)
            m_base = tl.where(m_fin == float("-inf"), 0.0, m_fin)
            alpha = tl.exp2(m_i - m_base)
            # a +inf sink takes the whole row: l_i 0 (not inf - inf = NaN), alpha 0, so out 0, lse +inf
            l_i = tl.where(sink2 == float("inf"), 0.0, l_i * alpha + tl.exp2(sink2 - m_base))
            empty = l_i == 0.0
            inv_l = alpha / tl.where(empty, 1.0, l_i)
            lse = tl.where(m_i == float("-inf"), sink,
                           (m_base + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        else:  # rows with no allowed key: l = 0, acc = 0 -> output 0, lse = +inf
            empty = l_i == 0.0
            inv_l = 1.0 / tl.where(empty, 1.0, l_i)
            lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        if HAS_DROPOUT:
            inv_l = inv_l / (1.0 - dropout_p)
        out = acc * inv_l[:, None]
        _store_rows(out_base, out_offs, row_ok, offs_dv, out.to(out_base.dtype.element_ty), HEAD_DV, BLOCK_DV)
        tl.store(lse_ptrs, lse, mask=row_ok)


# Sizes, window bounds, the query offset, the seed and the row strides of dropout are not
# specialized (a value of 1 would otherwise compile another kernel).
_NO_SPECIALIZE = ["H", "GROUP", "Nq", "Nk", "n_seqs", "page_size", "num_pages", "win_left", "win_right",
                  "query_offset", "num_splits", "n_lse", "seed", "drop_stride", "LEN_BUCKET"]


@autotune(fwd_configs(), FWD_TUNE_KEY, pruner(FWD_TILES_LOWP, FWD_TILES_FP32))
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def attention_fwd_kernel(
        Q, K, V, Out, Lse, Mask, Pad, Alibi, Sinks, CuQ, CuK, SeqUsed, BlockTable, OutPart, LsePart,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
        stride_maskb, stride_maskh, stride_maskm, stride_maskn, stride_padb, stride_padn, stride_alb, stride_alh,
        stride_btb,
        H, GROUP, Nq, Nk, n_seqs, page_size, num_pages, win_left, win_right, query_offset, num_splits, n_lse,
        qk_scale, softcap2, dropout_p, seed, drop_stride, LEN_BUCKET,
        HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr, LAYOUT: tl.constexpr,
        HAS_SEQUSED: tl.constexpr, SPLIT: tl.constexpr, PACK_GQA: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Dense (LAYOUT 0): Nq, Nk the lengths. Packed (1) and paged (2): Nq = Tq, Nk = Tk (packed) or
    the keys a sequence's block-table row can hold (paged), n_seqs = B; K/V strides b, h, n are
    the pool's page, head and in-page row strides when paged. Out's strides (b, h, row) count
    rows of HEAD_DV elements (so the compiler knows the rows' alignment), Lse's elements (its row
    stride is 1); n_lse: the number of lse entries (SPLIT: partial results at [split, lse index])."""
    pid0 = tl.program_id(0)
    if SPLIT:
        split = pid0 % num_splits
        pid_m = pid0 // num_splits
    else:
        split = 0
        pid_m = pid0
    head = tl.program_id(1)  # query head, or key head with PACK_GQA
    b = tl.program_id(2)
    if PACK_GQA:
        hk = head
        h0 = hk * GROUP  # the block's rows are heads h0 .. h0 + GROUP - 1
    else:
        hk = head // GROUP
        h0 = head
    bq = b
    if LAYOUT != 0:
        bq = b * 0  # packed tensors have no batch dim (their batch strides are 0 anyway)

    if LAYOUT != 0 and b == n_seqs:
        # Rows after the last sequence: every row with no key.
        tail = tl.minimum(tl.maximum(tl.load(CuQ + n_seqs), 0), Nq)
        rows_per_head = Nq - tail
        n_rows = rows_per_head
        if PACK_GQA:
            n_rows = rows_per_head * GROUP
        step = tl.num_programs(0) // num_splits * BLOCK_M
        for start in range(pid_m * BLOCK_M, n_rows, step):
            r = start + tl.arange(0, BLOCK_M)
            row_ok = r < n_rows
            if PACK_GQA:
                row_i = r // GROUP
                row_g = r % GROUP
                row0 = tail.to(tl.int64)
            else:
                row_i = r - start
                row_g = row_i * 0
                row0 = tail.to(tl.int64) + start
            lse_offs = _row_offsets(row_i, row_g, 1, stride_lh, PACK_GQA)
            lse_row0 = h0.to(tl.int64) * stride_lh + row0
            sink = 0.0
            if HAS_SINKS:
                sink = tl.load(Sinks + h0 + row_g)
            _fwd_store(tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
                       tl.full([BLOCK_M], float("-inf"), dtype=tl.float32),
                       Out + (h0.to(tl.int64) * stride_oh + row0 * stride_om) * HEAD_DV,
                       _row_offsets(row_i, row_g, stride_om, stride_oh, PACK_GQA) * HEAD_DV, Lse + lse_row0 + lse_offs,
                       OutPart + (split.to(tl.int64) * n_lse + lse_row0) * HEAD_DV, lse_offs * HEAD_DV,
                       LsePart + split.to(tl.int64) * n_lse + lse_row0 + lse_offs, row_ok, sink, dropout_p, HEAD_DV,
                       BLOCK_DV, HAS_SINKS, HAS_DROPOUT, SPLIT)
        return
    q_start, n_q, k_start, n_k = _sequence(b, CuQ, CuK, SeqUsed, Nq, Nk, LAYOUT, HAS_SEQUSED)

    start = pid_m * BLOCK_M  # first row of the block (a packed (query, head) row with PACK_GQA)
    rows = tl.arange(0, BLOCK_M)
    if PACK_GQA:
        if start >= n_q * GROUP:
            return
        row_i = (start + rows) // GROUP
        row_g = (start + rows) % GROUP
        row0 = q_start  # the pointers below are those of the sequence's first query of head h0
        q_lo = start // GROUP
        q_hi = tl.minimum((start + BLOCK_M - 1) // GROUP, n_q - 1)
        qi = row_i[:, None]
        row_ok = (row_i < n_q) & (start + rows < n_q * GROUP)
    else:
        if LAYOUT != 0:  # the dense grid has no block past the queries
            if start >= n_q:
                return
        row_i = rows
        row_g = rows * 0
        row0 = q_start + start
        q_lo = start
        q_hi = tl.minimum(start + BLOCK_M, n_q) - 1
        qi = start  # the tiles add the rows
        row_ok = start + rows < n_q
    shift = n_k - n_q + query_offset  # query i sits at key position i + shift

    r64 = tl.cast(row0, tl.int64)
    b64 = bq.to(tl.int64)
    q = _load_rows(Q + b64 * stride_qb + h0.to(tl.int64) * stride_qh + r64 * stride_qm,
                   _row_offsets(row_i, row_g, stride_qm, stride_qh, PACK_GQA), row_ok, tl.arange(0, BLOCK_D), HEAD_D,
                   BLOCK_D, True)
    if LAYOUT == 2:
        k_base = K + hk.to(tl.int64) * stride_kh
        v_base = V + hk.to(tl.int64) * stride_vh
    else:
        k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + tl.cast(k_start, tl.int64) * stride_kn
        v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + tl.cast(k_start, tl.int64) * stride_vn
    bt_row = BlockTable + b.to(tl.int64) * stride_btb
    mask_base = Mask + b64 * stride_maskb + h0.to(tl.int64) * stride_maskh + r64 * stride_maskm
    mask_offs = 0
    if PACK_GQA:
        mask_offs = _row_offsets(row_i, row_g, stride_maskm, stride_maskh, PACK_GQA)
    pad_base = Pad + b64 * stride_padb
    slope2 = 0.0
    if HAS_ALIBI:
        if PACK_GQA:
            slope2 = (tl.load(Alibi + b.to(tl.int64) * stride_alb + (h0 + row_g) * stride_alh)
                      * 1.4426950408889634)[:, None]
        else:
            slope2 = tl.load(Alibi + b.to(tl.int64) * stride_alb + h0 * stride_alh) * 1.4426950408889634
    # lse index of the block's first row (rows follow at stride 1; PACK_GQA: at row_g * stride_lh)
    lse_row0 = b64 * stride_lb + h0.to(tl.int64) * stride_lh + r64
    drop_offset = lse_row0 * drop_stride

    lo, a, bb, hi = _key_tiles(pad_base, stride_padn, q_lo, q_hi, n_k, shift, win_left, win_right, BLOCK_N,
                               IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_PAD)
    if SPLIT:
        lo, a, bb, hi = _split_tiles(lo, a, bb, hi, split, num_splits, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start_n in tl.range(a, bb, BLOCK_N):  # inside every row's band
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, start_n, qi, n_q, k_base, v_base, stride_kb, stride_kn,
                                  stride_vb, stride_vn, bt_row, page_size, num_pages, mask_base, mask_offs,
                                  stride_maskm, stride_maskn, pad_base, stride_padn, n_k, shift, win_left, win_right,
                                  slope2, qk_scale, softcap2, seed, drop_offset, drop_stride, dropout_p, HEAD_D,
                                  HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, IS_CAUSAL, MASK_KIND, HAS_PAD,
                                  HAS_DROPOUT, False, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI, LAYOUT == 2,
                                  PACK_GQA, DOT_PRECISION)
    if WINDOW_LEFT:  # checked: [lo, a) and [bb, hi)
        for t in tl.range(0, _masked_count(lo, a, bb, hi, BLOCK_N)):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, _masked_tile(t, lo, a, bb, BLOCK_N), qi, n_q, k_base,
                                      v_base, stride_kb, stride_kn, stride_vb, stride_vn, bt_row, page_size,
                                      num_pages, mask_base, mask_offs, stride_maskm, stride_maskn, pad_base,
                                      stride_padn, n_k, shift, win_left, win_right, slope2, qk_scale, softcap2, seed,
                                      drop_offset, drop_stride, dropout_p, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M,
                                      BLOCK_N, IS_CAUSAL, MASK_KIND, HAS_PAD, HAS_DROPOUT, True, WINDOW_LEFT,
                                      WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI, LAYOUT == 2, PACK_GQA, DOT_PRECISION)
    else:  # checked: [bb, hi) ([lo, a) is empty)
        for start_n in tl.range(bb, hi, BLOCK_N):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, start_n, qi, n_q, k_base, v_base, stride_kb, stride_kn,
                                      stride_vb, stride_vn, bt_row, page_size, num_pages, mask_base, mask_offs,
                                      stride_maskm, stride_maskn, pad_base, stride_padn, n_k, shift, win_left,
                                      win_right, slope2, qk_scale, softcap2, seed, drop_offset, drop_stride, dropout_p,
                                      HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, IS_CAUSAL, MASK_KIND,
                                      HAS_PAD, HAS_DROPOUT, True, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                                      LAYOUT == 2, PACK_GQA, DOT_PRECISION)
    sink = 0.0
    if HAS_SINKS:
        if PACK_GQA:
            sink = tl.load(Sinks + h0 + row_g)
        else:
            sink = tl.load(Sinks + h0)
    lse_offs = _row_offsets(row_i, row_g, 1, stride_lh, PACK_GQA)
    _fwd_store(acc, l_i, m_i, Out + (b64 * stride_ob + h0.to(tl.int64) * stride_oh + r64 * stride_om) * HEAD_DV,
               _row_offsets(row_i, row_g, stride_om, stride_oh, PACK_GQA) * HEAD_DV, Lse + lse_row0 + lse_offs,
               OutPart + (split.to(tl.int64) * n_lse + lse_row0) * HEAD_DV, lse_offs * HEAD_DV,
               LsePart + split.to(tl.int64) * n_lse + lse_row0 + lse_offs, row_ok, sink, dropout_p, HEAD_DV,
               BLOCK_DV, HAS_SINKS, HAS_DROPOUT, SPLIT)
