"""The backward kernels of the Triton softmax attention (FlashAttention-2's equations), for dense
batches and packed sequences: a preprocess computing delta = rowsum(dO * O); one program per key
block accumulating dK and dV over the query blocks that may see it (and over the query heads
sharing its key head under GQA, so no atomics there); one program per query block
accumulating dQ over the key blocks it may see and, for a float mask that requires grad
(STORE_DS), writing the score gradient dS; for the sinks' gradient (STORE_PDP), also each row's
sum_j P_ij dP_ij from the fp32 P and dP.

ATOMIC_DQ (opt-in: TRANSFORMER_FAST_ATOMIC_DQ=1, as FlashAttention-2's and cuDNN's backward do):
the dK/dV program also forms each tile's dQ = dS K, which it already holds dS and K for, and adds
it atomically to a float32 dQ; the dQ kernel, which recomputes P and dP for every tile, is not
launched: 5 products per tile instead of 7, at the price of atomic traffic and an order of
additions that changes from run to run (never with torch.use_deterministic_algorithms).

Grids: dK/dV (key blocks, key heads, batch [+ 1 packed]), dQ (query blocks, query heads, batch
[+ 1 packed]); the extra column of a packed layout zeroes the gradient rows after the last
sequence. Tiles outside every row's causal/window band are skipped as in the forward: dQ
visits `_key_tiles`, dK/dV `_query_tiles`, each with the band-checked tiles apart.

With soft-capping, dS is taken through softcap * tanh(.): dS_raw = dS * (1 - tanh^2); the dS
written out for a float mask is the gradient of the final scores, before that factor.
"""

import triton
import triton.language as tl

from ._autotune import autotune
from .attention_common import (_dropout_keep, _key_ok, _key_tiles, _load_rows, _masked_count, _masked_tile,
                               _query_tiles, _scores, _sequence, _store_rows)
from .attention_tiles import (DKDV_TILES_FP32, DKDV_TILES_LOWP, DKDV_TUNE_KEY, DQ_TILES_FP32, DQ_TILES_LOWP,
                              DQ_TUNE_KEY, dkdv_configs, dq_configs, pruner)


@triton.jit
def attention_bwd_preprocess_kernel(Out, DOut, Delta, stride_ob, stride_oh, stride_om, stride_dob, stride_doh,
                                    stride_dom, stride_lb, stride_lh, Nq, HEAD_DV: tl.constexpr,
                                    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[lse index of (b, h, i)] = sum_d dO[b, h, i, d] * O[b, h, i, d], rows i < Nq (packed:
    b = 0 and Nq = Tq; lse's row stride is 1; O's strides count rows of HEAD_DV elements)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    m64 = (pid_m * BLOCK_M).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = pid_m * BLOCK_M + rows < Nq
    o = _load_rows(Out + (b * stride_ob + h * stride_oh + m64 * stride_om) * HEAD_DV, rows * stride_om * HEAD_DV,
                   row_ok, offs_dv, HEAD_DV, BLOCK_DV, True)
    do = _load_rows(DOut + b * stride_dob + h * stride_doh + m64 * stride_dom, rows * stride_dom, row_ok, offs_dv,
                    HEAD_DV, BLOCK_DV, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + b * stride_lb + h * stride_lh + m64 + rows, delta, mask=row_ok)


@triton.jit
def attention_bwd_dq_convert_kernel(Src, Dst, n, BLOCK: tl.constexpr):
    """Dst[i] = Src[i] in Dst's dtype for the n elements of two tensors laid out alike (ATOMIC_DQ's
    float32 dQ sum into dQ)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(Dst + offs, tl.load(Src + offs, mask=ok).to(Dst.dtype.element_ty), mask=ok)


@triton.jit
def _at_most_zero(x, MASK_KIND: tl.constexpr):
    """min(s - lse, 0) with a float mask (NaN stays NaN). s - lse <= 0, but on a row whose every
    score is huge and negative (finfo.min or -1e38 on every key) lse absorbs log(l), and its
    rounding through the natural-log store can leave s - lse a huge positive number: P = inf."""
    if MASK_KIND == 2:
        x = tl.where(x > 0.0, 0.0, x)
    return x


@triton.jit
def _zero_rows(base, stride_n, first, count, step_start, step, HEAD: tl.constexpr, BLOCK: tl.constexpr,
               ROWS: tl.constexpr):
    """Zeroes rows first .. first + count - 1 (a packed gradient's rows after its last sequence)
    of width HEAD at stride_n rows of HEAD, ROWS at a time, starting at row step_start and
    stepping by `step`."""
    cols = tl.arange(0, BLOCK)
    rows = tl.arange(0, ROWS)
    for start in range(step_start, count, step):
        _store_rows(base + (tl.cast(first, tl.int64) + start) * stride_n * HEAD, rows * stride_n * HEAD,
                    start + rows < count, cols,
                    tl.zeros([ROWS, BLOCK], dtype=tl.float32).to(base.dtype.element_ty), HEAD, BLOCK)


@triton.jit
def _minus_lse2(s, lse):
    """s - lse * log2(e) (lse in natural-log units) with one rounding: where ALiBi or a float mask
    makes a row's scores large (|s| ~ 100 on rows whose allowed keys all lie far from the
    diagonal), every rounding of s or lse costs P about |s| units of 2^-24, so the product is not
    rounded apart. Explicit: the interpreter does not contract a multiply and an add, and Triton
    3.10 stops doing so on the GPU by default."""
    return tl.fma(lse, -1.4426950408889634, s)


@triton.jit
def _dkdv_tile(dk, dv, k, v, key_ok, start_m, start_n, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
               mask_base, stride_maskm, stride_maskn, n_q, n_k, shift, win_left, win_right, slope2, qk_scale, softcap2,
               seed, drop_offset, drop_stride, dropout_p, dq_base, stride_dqm, scale,
               HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, CHECK: tl.constexpr,
               WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr,
               HAS_DROPOUT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
               DOT_PRECISION: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """dK, dV of the key block at start_n += the contributions of query rows [start_m, start_m +
    BLOCK_M), on transposed (key, query) tiles. Keys out of range or padded are not masked here:
    their rows of dK/dV are zeroed at the store, and key rows never mix in these products. With
    ATOMIC_DQ, also adds the tile's dQ = scale * dS K atomically to the fp32 rows at dq_base
    (padded and out-of-range keys' dS zeroed first: a float mask may hold NaN there)."""
    mi = tl.arange(0, BLOCK_M)
    nj = tl.arange(0, BLOCK_N)[:, None]
    offs_m = start_m + mi
    m64 = tl.cast(start_m, tl.int64)
    row_ok = offs_m < n_q
    q = _load_rows(q_base + m64 * stride_qm, mi * stride_qm, row_ok, tl.arange(0, BLOCK_D), HEAD_D, BLOCK_D, True)
    do = _load_rows(do_base + m64 * stride_dom, mi * stride_dom, row_ok, tl.arange(0, BLOCK_DV), HEAD_DV, BLOCK_DV,
                    True)
    # lse = +inf beyond the sequence's queries (and on rows with no allowed key) makes P = 0 there.
    lse = tl.load(lse_base + m64 + mi, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_base + m64 + mi, mask=row_ok, other=0.0)
    qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    s_t, t_t = _scores(qk_t, offs_m[None, :], start_n + nj, key_ok[:, None], n_q, n_k,
                       mask_base + m64 * stride_maskm + ((mi * stride_maskm)[None, :] + nj * stride_maskn), shift,
                       win_left, win_right, slope2, qk_scale, softcap2, IS_CAUSAL, CHECK, WINDOW_LEFT, WINDOW_RIGHT,
                       MASK_KIND, False, HAS_SOFTCAP, HAS_ALIBI)
    p_t = tl.exp2(_at_most_zero(_minus_lse2(s_t, lse[None, :]), MASK_KIND))
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        keep_t = _dropout_keep(seed, drop_offset + m64 * drop_stride + start_n, mi[None, :], nj, drop_stride,
                               dropout_p)
        inv_keep = 1.0 / (1.0 - dropout_p)
        dv = tl.dot(tl.where(keep_t, p_t * inv_keep, 0.0).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.where(keep_t, dp_t * inv_keep, 0.0)
    else:
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if HAS_SOFTCAP:
        ds_t = ds_t * (1.0 - t_t * t_t)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    if ATOMIC_DQ:
        ds_t = tl.where(key_ok[:, None], ds_t, 0.0)
        dq = tl.dot(tl.trans(ds_t.to(k.dtype)), k, input_precision=DOT_PRECISION) * scale
        offs_d = tl.arange(0, BLOCK_D)
        tl.atomic_add(dq_base + (m64 + mi[:, None]) * stride_dqm * HEAD_D + offs_d[None, :], dq,
                      mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), sem="relaxed")
    return dk, dv


# Sizes, window bounds, the query offset, the seed and the dropout row stride are not specialized.
_NO_SPECIALIZE = ["H", "GROUP", "Nq", "Nk", "n_seqs", "win_left", "win_right", "query_offset", "seed",
                  "drop_stride", "LEN_BUCKET"]


@autotune(dkdv_configs(), DKDV_TUNE_KEY, pruner(DKDV_TILES_LOWP, DKDV_TILES_FP32), reset_to_zero=["DQ"])
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def attention_bwd_dkdv_kernel(
        Q, K, V, DOut, Lse, Delta, DK, DV, DQ, Mask, Pad, Alibi, CuQ, CuK,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom, stride_lb, stride_lh,
        stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn, stride_dqb, stride_dqh, stride_dqm,
        stride_maskb, stride_maskh, stride_maskm, stride_maskn, stride_padb, stride_padn, stride_alb, stride_alh,
        H, GROUP, Nq, Nk, n_seqs, win_left, win_right, query_offset, qk_scale, softcap2, scale, dropout_p, seed,
        drop_stride,
        LEN_BUCKET,
        HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, LAYOUT: tl.constexpr, ATOMIC_DQ: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Dense (LAYOUT 0): Nq, Nk the lengths; packed (1): the packed row counts Tq, Tk and n_seqs = B.
    DK's, DV's and DQ's strides count rows of HEAD_D and HEAD_DV elements. ATOMIC_DQ: DQ is a
    zero-filled fp32 tensor to which every tile adds its dQ (the dQ kernel is then not launched)."""
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    bq = b
    if LAYOUT != 0:
        bq = b * 0
        if b == n_seqs:  # key rows after the last sequence get no gradient
            tail = tl.minimum(tl.maximum(tl.load(CuK + n_seqs), 0), Nk)
            step = tl.num_programs(0) * BLOCK_N
            _zero_rows(DK + hk.to(tl.int64) * stride_dkh * HEAD_D, stride_dkn, tail, Nk - tail, pid_n * BLOCK_N, step,
                       HEAD_D, BLOCK_D, BLOCK_N)
            _zero_rows(DV + hk.to(tl.int64) * stride_dvh * HEAD_DV, stride_dvn, tail, Nk - tail, pid_n * BLOCK_N, step,
                       HEAD_DV, BLOCK_DV, BLOCK_N)
            return
    q_start, n_q, k_start, n_k = _sequence(b, CuQ, CuK, CuK, Nq, Nk, LAYOUT, False)
    start_n = pid_n * BLOCK_N
    if LAYOUT != 0:  # the dense grid has no block past the keys
        if start_n >= n_k:
            return
    b64 = bq.to(tl.int64)
    n64 = tl.cast(k_start + start_n, tl.int64)
    rows = tl.arange(0, BLOCK_N)
    offs_n = start_n + rows
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = _key_ok(offs_n, n_k, Pad + b64 * stride_padb, stride_padn, True, HAS_PAD)
    k = _load_rows(K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + n64 * stride_kn, rows * stride_kn, key_ok,
                   offs_d, HEAD_D, BLOCK_D, True)
    v = _load_rows(V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + n64 * stride_vn, rows * stride_vn, key_ok,
                   offs_dv, HEAD_DV, BLOCK_DV, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    shift = n_k - n_q + query_offset  # query i sits at key position i + shift
    lo, a, bb, hi = _query_tiles(start_n, tl.minimum(start_n + BLOCK_N, n_k) - 1, n_q, shift, win_left, win_right,
                                 BLOCK_M, IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT)
    if HAS_PAD:  # every key of the block padded: skip the loops
        skip = tl.max(key_ok.to(tl.int32), 0) == 0
        lo = tl.where(skip, hi, lo)
        a = tl.where(skip, hi, a)
        bb = tl.where(skip, hi, bb)
    q_row = b64 * stride_qb + tl.cast(q_start, tl.int64) * stride_qm
    do_row = b64 * stride_dob + tl.cast(q_start, tl.int64) * stride_dom
    for g in range(0, GROUP):
        h = hk * GROUP + g
        h64 = h.to(tl.int64)
        q_base = Q + q_row + h64 * stride_qh
        do_base = DOut + do_row + h64 * stride_doh
        dq_base = DQ + (b64 * stride_dqb + h64 * stride_dqh + tl.cast(q_start, tl.int64) * stride_dqm) * HEAD_D
        lse_row0 = b64 * stride_lb + h64 * stride_lh + q_start
        mask_base = Mask + b64 * stride_maskb + h64 * stride_maskh + tl.cast(start_n, tl.int64) * stride_maskn
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(Alibi + b.to(tl.int64) * stride_alb + h * stride_alh) * 1.4426950408889634
        drop_offset = lse_row0 * drop_stride
        if WINDOW_LEFT:  # checked: [lo, a) and [bb, hi)
            for t in tl.range(0, _masked_count(lo, a, bb, hi, BLOCK_M)):
                dk, dv = _dkdv_tile(dk, dv, k, v, key_ok, _masked_tile(t, lo, a, bb, BLOCK_M), start_n, q_base,
                                    do_base, Lse + lse_row0, Delta + lse_row0, stride_qm, stride_dom, mask_base,
                                    stride_maskm, stride_maskn, n_q, n_k, shift, win_left, win_right, slope2, qk_scale,
                                    softcap2, seed, drop_offset, drop_stride, dropout_p, dq_base, stride_dqm, scale,
                                    HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, IS_CAUSAL, True, WINDOW_LEFT,
                                    WINDOW_RIGHT, MASK_KIND, HAS_DROPOUT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION,
                                    ATOMIC_DQ)
        elif IS_CAUSAL or WINDOW_RIGHT:  # checked: [lo, a) ([bb, hi) is empty)
            for start_m in tl.range(lo, a, BLOCK_M):
                dk, dv = _dkdv_tile(dk, dv, k, v, key_ok, start_m, start_n, q_base, do_base, Lse + lse_row0,
                                    Delta + lse_row0, stride_qm, stride_dom, mask_base, stride_maskm, stride_maskn,
                                    n_q, n_k, shift, win_left, win_right, slope2, qk_scale, softcap2, seed, drop_offset,
                                    drop_stride, dropout_p, dq_base, stride_dqm, scale, HEAD_D, HEAD_DV, BLOCK_D,
                                    BLOCK_DV, BLOCK_M, BLOCK_N, IS_CAUSAL, True, WINDOW_LEFT, WINDOW_RIGHT, MASK_KIND,
                                    HAS_DROPOUT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ATOMIC_DQ)
        for start_m in tl.range(a, bb, BLOCK_M):  # inside every key's band
            dk, dv = _dkdv_tile(dk, dv, k, v, key_ok, start_m, start_n, q_base, do_base, Lse + lse_row0,
                                Delta + lse_row0, stride_qm, stride_dom, mask_base, stride_maskm, stride_maskn, n_q,
                                n_k, shift, win_left, win_right, slope2, qk_scale, softcap2, seed, drop_offset,
                                drop_stride, dropout_p, dq_base, stride_dqm, scale, HEAD_D, HEAD_DV, BLOCK_D,
                                BLOCK_DV, BLOCK_M, BLOCK_N, IS_CAUSAL, False, WINDOW_LEFT, WINDOW_RIGHT, MASK_KIND,
                                HAS_DROPOUT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, ATOMIC_DQ)

    # Padded and out-of-range keys get no gradient (and whatever was computed for them is dropped).
    dk = tl.where(key_ok[:, None], dk * scale, 0.0)
    dv = tl.where(key_ok[:, None], dv, 0.0)
    row_ok = offs_n < n_k
    _store_rows(DK + (b64 * stride_dkb + hk.to(tl.int64) * stride_dkh + n64 * stride_dkn) * HEAD_D,
                rows * stride_dkn * HEAD_D, row_ok,
                offs_d, dk.to(DK.dtype.element_ty), HEAD_D, BLOCK_D)
    _store_rows(DV + (b64 * stride_dvb + hk.to(tl.int64) * stride_dvh + n64 * stride_dvn) * HEAD_DV,
                rows * stride_dvn * HEAD_DV, row_ok,
                offs_dv, dv.to(DV.dtype.element_ty), HEAD_DV, BLOCK_DV)


@triton.jit
def _dq_tile(dq, pdp, q, do, lse, delta, start_m, start_n, n_q, k_base, v_base, stride_kn, stride_vn,
             mask_base, stride_maskm, stride_maskn, pad_base, stride_padn, n_k, shift, win_left, win_right, slope2,
             qk_scale, softcap2, seed, drop_offset, drop_stride, dropout_p, ds_base,
             HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
             HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr, CHECK: tl.constexpr, WINDOW_LEFT: tl.constexpr,
             WINDOW_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
             DOT_PRECISION: tl.constexpr, STORE_DS: tl.constexpr, STORE_PDP: tl.constexpr):
    """dQ of the query block at start_m += the contribution of key tile [start_n, start_n +
    BLOCK_N) (CHECK: the tile may hold keys outside a row's band or the sequence). With STORE_DS,
    also writes the tile's dS to the (BLOCK_M, Nk) rows of this head's dS at ds_base (dense); with
    STORE_PDP, pdp += the rows' sum of P * dP over the tile (P = 0 where a key is not allowed, and
    such keys' V loads as 0)."""
    mi = tl.arange(0, BLOCK_M)[:, None]
    qi = start_m + mi
    nj = tl.arange(0, BLOCK_N)
    offs_n = start_n + nj
    n64 = tl.cast(start_n, tl.int64)
    check_keys: tl.constexpr = CHECK or HAS_PAD
    key_ok = _key_ok(offs_n, n_k, pad_base, stride_padn, CHECK, HAS_PAD)
    k = _load_rows(k_base + n64 * stride_kn, nj * stride_kn, key_ok, tl.arange(0, BLOCK_D), HEAD_D, BLOCK_D,
                   check_keys)
    v = _load_rows(v_base + n64 * stride_vn, nj * stride_vn, key_ok, tl.arange(0, BLOCK_DV), HEAD_DV, BLOCK_DV,
                   check_keys)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    mask_ptrs = mask_base + n64 * stride_maskn + (mi * stride_maskm + nj[None, :] * stride_maskn)
    s, t = _scores(qk, qi, offs_n[None, :], key_ok[None, :], n_q, n_k, mask_ptrs, shift, win_left, win_right, slope2,
                   qk_scale, softcap2, IS_CAUSAL, CHECK, WINDOW_LEFT, WINDOW_RIGHT, MASK_KIND, check_keys, HAS_SOFTCAP,
                   HAS_ALIBI)
    p = tl.exp2(_at_most_zero(_minus_lse2(s, lse[:, None]), MASK_KIND))
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, drop_offset + start_n, mi, nj[None, :], drop_stride, dropout_p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    if STORE_PDP:
        pdp += tl.sum(p * dp, 1)
    ds = p * (dp - delta[:, None])
    if STORE_DS:  # 0 where P = 0: padded keys' V loads as 0, so dP is finite there
        tl.store(ds_base + n64 + (mi * n_k + nj[None, :]), ds.to(ds_base.dtype.element_ty),
                 mask=(qi < n_q) & (offs_n[None, :] < n_k))
    if HAS_SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq, pdp


@autotune(dq_configs(), DQ_TUNE_KEY, pruner(DQ_TILES_LOWP, DQ_TILES_FP32))
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def attention_bwd_dq_kernel(
        Q, K, V, DOut, Lse, Delta, DQ, DS, PdP, Mask, Pad, Alibi, CuQ, CuK,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom, stride_lb, stride_lh, stride_dqb, stride_dqh, stride_dqm,
        stride_maskb, stride_maskh, stride_maskm, stride_maskn, stride_padb, stride_padn, stride_alb, stride_alh,
        H, GROUP, Nq, Nk, n_seqs, win_left, win_right, query_offset, qk_scale, softcap2, scale, dropout_p, seed,
        drop_stride,
        LEN_BUCKET,
        HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
        HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, LAYOUT: tl.constexpr, STORE_DS: tl.constexpr,
        STORE_PDP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ of a query block (DQ's strides count rows of HEAD_D elements); with STORE_DS (dense only)
    also dS into DS, (B, H, Nq, Nk) contiguous and zero-filled (the key tiles skipped here have
    dS = 0); with STORE_PDP, sum_j P_ij dP_ij into PdP (float32, laid out as Lse)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    hk = h // GROUP
    h64 = h.to(tl.int64)
    bq = b
    if LAYOUT != 0:
        bq = b * 0
        if b == n_seqs:  # query rows after the last sequence get no gradient
            tail = tl.minimum(tl.maximum(tl.load(CuQ + n_seqs), 0), Nq)
            _zero_rows(DQ + h64 * stride_dqh * HEAD_D, stride_dqm, tail, Nq - tail, pid_m * BLOCK_M,
                       tl.num_programs(0) * BLOCK_M, HEAD_D, BLOCK_D, BLOCK_M)
            return
    q_start, n_q, k_start, n_k = _sequence(b, CuQ, CuK, CuK, Nq, Nk, LAYOUT, False)
    start_m = pid_m * BLOCK_M
    if LAYOUT != 0:  # the dense grid has no block past the queries
        if start_m >= n_q:
            return
    b64 = bq.to(tl.int64)
    m64 = tl.cast(q_start + start_m, tl.int64)
    k_base = K + b64 * stride_kb + hk.to(tl.int64) * stride_kh + tl.cast(k_start, tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + hk.to(tl.int64) * stride_vh + tl.cast(k_start, tl.int64) * stride_vn
    pad_base = Pad + b64 * stride_padb
    rows = tl.arange(0, BLOCK_M)
    row_ok = start_m + rows < n_q
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + b64 * stride_qb + h64 * stride_qh + m64 * stride_qm, rows * stride_qm, row_ok, offs_d, HEAD_D,
                   BLOCK_D, True)
    do = _load_rows(DOut + b64 * stride_dob + h64 * stride_doh + m64 * stride_dom, rows * stride_dom, row_ok,
                    tl.arange(0, BLOCK_DV), HEAD_DV, BLOCK_DV, True)
    lse_row0 = b64 * stride_lb + h64 * stride_lh + m64
    lse = tl.load(Lse + lse_row0 + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + lse_row0 + rows, mask=row_ok, other=0.0)
    mask_base = Mask + b64 * stride_maskb + h64 * stride_maskh + tl.cast(start_m, tl.int64) * stride_maskm
    # dS (dense): this head's (Nq, Nk) block of the contiguous (B, H, Nq, Nk) output
    ds_base = DS + lse_row0 * Nk
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(Alibi + b.to(tl.int64) * stride_alb + h * stride_alh) * 1.4426950408889634
    drop_offset = lse_row0 * drop_stride
    shift = n_k - n_q + query_offset  # query i sits at key position i + shift
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    pdp = tl.zeros([BLOCK_M], dtype=tl.float32)

    lo, a, bb, hi = _key_tiles(pad_base, stride_padn, start_m, tl.minimum(start_m + BLOCK_M, n_q) - 1, n_k, shift,
                               win_left, win_right, BLOCK_N, IS_CAUSAL, WINDOW_LEFT, WINDOW_RIGHT, HAS_PAD)
    for start_n in tl.range(a, bb, BLOCK_N):  # inside every row's band
        dq, pdp = _dq_tile(dq, pdp, q, do, lse, delta, start_m, start_n, n_q, k_base, v_base, stride_kn,
                           stride_vn, mask_base, stride_maskm, stride_maskn, pad_base, stride_padn, n_k, shift,
                           win_left, win_right, slope2, qk_scale, softcap2, seed, drop_offset, drop_stride,
                           dropout_p, ds_base, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, IS_CAUSAL,
                           MASK_KIND, HAS_PAD, HAS_DROPOUT, False, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI,
                           DOT_PRECISION, STORE_DS, STORE_PDP)
    if WINDOW_LEFT:  # checked: [lo, a) and [bb, hi)
        for t in tl.range(0, _masked_count(lo, a, bb, hi, BLOCK_N)):
            dq, pdp = _dq_tile(dq, pdp, q, do, lse, delta, start_m, _masked_tile(t, lo, a, bb, BLOCK_N), n_q,
                               k_base, v_base, stride_kn, stride_vn, mask_base, stride_maskm, stride_maskn, pad_base,
                               stride_padn, n_k, shift, win_left, win_right, slope2, qk_scale, softcap2, seed,
                               drop_offset, drop_stride, dropout_p, ds_base, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV,
                               BLOCK_M, BLOCK_N, IS_CAUSAL, MASK_KIND, HAS_PAD, HAS_DROPOUT, True, WINDOW_LEFT,
                               WINDOW_RIGHT, HAS_SOFTCAP, HAS_ALIBI, DOT_PRECISION, STORE_DS, STORE_PDP)
    else:  # checked: [bb, hi)
        for start_n in tl.range(bb, hi, BLOCK_N):
            dq, pdp = _dq_tile(dq, pdp, q, do, lse, delta, start_m, start_n, n_q, k_base, v_base, stride_kn,
                               stride_vn, mask_base, stride_maskm, stride_maskn, pad_base, stride_padn, n_k, shift,
                               win_left, win_right, slope2, qk_scale, softcap2, seed, drop_offset, drop_stride,
                               dropout_p, ds_base, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, IS_CAUSAL,
                               MASK_KIND, HAS_PAD, HAS_DROPOUT, True, WINDOW_LEFT, WINDOW_RIGHT, HAS_SOFTCAP,
                               HAS_ALIBI, DOT_PRECISION, STORE_DS, STORE_PDP)
    _store_rows(DQ + (b64 * stride_dqb + h64 * stride_dqh + m64 * stride_dqm) * HEAD_D, rows * stride_dqm * HEAD_D,
                row_ok, offs_d,
                (dq * scale).to(DQ.dtype.element_ty), HEAD_D, BLOCK_D)
    if STORE_PDP:
        tl.store(PdP + lse_row0 + rows, pdp, mask=row_ok)
