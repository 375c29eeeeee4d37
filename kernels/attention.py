"""Softmax attention in Triton: FlashAttention-2 forward and backward.

Forward: one program per (query block, head, batch) streams the key/value tiles with an online
softmax in base 2 (log2(e) is folded into the scale), keeps fp32 statistics and saves each row's
log-sum-exp. Backward: a preprocess kernel computes delta = rowsum(dO * O); one kernel per key
block accumulates dK and dV over the query blocks (and over the query heads sharing that key head
under GQA, so no atomics anywhere), another per query block accumulates dQ over the key blocks
and, for a float mask that requires grad (STORE_DS), also writes the score gradient dS.

Masking: scores of disallowed (causal, padded, attn_mask False or -inf, out of range) pairs are set
to -inf before the row max, and every exponent is taken against a finite base, so P is exactly 0
there; padded and out-of-range key/value rows are loaded as zeros, so whatever they hold (NaN, inf)
never reaches a result. Key tiles above the causal diagonal, and those before the first or after
the last unpadded key of a sequence, are skipped: each forward and dQ program finds that key range
by scanning its sequence's padding row (up to its causal window), so the launchers pass the
padding mask as it is and run no torch op for it.

Tile tables and autotune configs: kernels/attention_tiles.py.

fp32 inputs use input_precision="ieee" for tl.dot (exact fp32 products; a GPU's default tf32
would miss the tests' 2x-reference-error policy); fp16/bf16 use tensor cores with fp32
accumulation.
"""

import torch
import triton
import triton.language as tl

from ._utils import LAUNCH_OPTIONS, autotune, cdiv, interpreting, new_output
from .attention_tiles import (DKDV_TILES_FP32, DKDV_TILES_LOWP, DQ_TILES_FP32, DQ_TILES_LOWP, FWD_TILES_FP32,
                              FWD_TILES_LOWP, TUNE_KEY, block_dims, dkdv_configs, dq_configs, fwd_configs,
                              length_bucket, pruner)

LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------------------------
# Shared tile helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def _load_rows(base, rows, row_stride, row_ok, cols, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """A (len(rows), BLOCK_COLS) tile of a row-major (unit column stride) matrix starting at the
    pointer `base`; rows that are not `row_ok` and columns >= N_COLS read as 0. `rows` are
    tile-local (int32 offsets: the tile's start is in `base`, in int64)."""
    ptrs = base + (rows[:, None] * row_stride + cols[None, :])
    if CHECK_ROWS:
        if N_COLS == BLOCK_COLS:
            tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=row_ok[:, None] & (cols[None, :] < N_COLS), other=0.0)
    else:
        if N_COLS == BLOCK_COLS:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=cols[None, :] < N_COLS, other=0.0)
    return tile


@triton.jit
def _store_rows(base, rows, row_stride, row_ok, cols, value, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    ptrs = base + (rows[:, None] * row_stride + cols[None, :])
    if N_COLS == BLOCK_COLS:
        tl.store(ptrs, value, mask=row_ok[:, None])
    else:
        tl.store(ptrs, value, mask=row_ok[:, None] & (cols[None, :] < N_COLS))


@triton.jit
def _key_ok(offs_n, Nk, pad_base, stride_padn, CHECK_BOUNDS: tl.constexpr, HAS_PAD: tl.constexpr):
    """Keys that exist and are not padded (only meaningful when CHECK_BOUNDS or HAS_PAD)."""
    if HAS_PAD:
        ok = tl.load(pad_base + offs_n * stride_padn, mask=offs_n < Nk, other=1) == 0
    elif CHECK_BOUNDS:
        ok = offs_n < Nk
    else:
        ok = offs_n >= 0
    return ok


@triton.jit
def _mask_scores(s, qi, kj, mi, nj, key_ok, Nq, Nk, mask_tile, stride_maskm, stride_maskn,
                 IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, CHECK_KEYS: tl.constexpr):
    """Scores s (base-2 units) with -inf where query qi may not see key kj. qi, kj (global), mi,
    nj (tile-local: the mask tile starts at the pointer mask_tile) and key_ok broadcast to s:
    (M, 1), (1, N), (1, N) in the forward/dQ layout, transposed in dK/dV."""
    if MASK_KIND == 2:  # float mask: added (in natural-log units, hence * log2(e))
        bias = tl.load(mask_tile + (mi * stride_maskm + nj * stride_maskn), mask=(qi < Nq) & (kj < Nk), other=0.0)
        s = s + bias.to(tl.float32) * 1.4426950408889634
    if MASK_KIND == 1:  # bool mask, True = allowed
        allowed = tl.load(mask_tile + (mi * stride_maskm + nj * stride_maskn), mask=(qi < Nq) & (kj < Nk), other=0)
        s = tl.where(allowed != 0, s, float("-inf"))
    if IS_CAUSAL:
        s = tl.where(kj <= qi, s, float("-inf"))
    if CHECK_KEYS:
        s = tl.where(key_ok, s, float("-inf"))
    return s


@triton.jit
def _dropout_keep(seed, tile_offset, mi, nj, Nk, dropout_p):
    """True where dropout keeps P[i, j]: Philox at offset ((b*H + h)*Nq + i)*Nk + j, its 64 bits
    split into two 32-bit counters (the stream of tl.rand(seed, offset)). tile_offset is the
    int64 offset of the tile's first element, mi, nj the tile-local row and column (32-bit math)."""
    local = (mi * Nk + nj).to(tl.uint32)
    lo = tile_offset.to(tl.uint32) + local  # wraps: carry into the high word
    hi = (tile_offset >> 32).to(tl.uint32) + (lo < local).to(tl.uint32)
    zero = lo * 0
    r, _, _, _ = tl.philox(seed, lo, hi, zero, zero)
    return tl.uint_to_uniform_float(r) >= dropout_p


# Padding rows are scanned in blocks of this many keys (small under the interpreter, so that the
# tests' short sequences take several blocks).
PAD_SCAN_BLOCK = tl.constexpr(16 if interpreting() else 1024)


@triton.jit
def _unpadded_range(pad_base, stride_padn, n_keys):
    """[first, last + 1) of the unpadded keys among the first n_keys of a padding row (bytes,
    nonzero = padded); [0, 0) where all of them are padded. (Reducing each block to scalars, rather
    than carrying PAD_SCAN_BLOCK-wide running minima through the loop, spills less: 1280 bytes
    against 3640 in the sm_90 forward with causal + padding + bool mask at head dim 128.)"""
    offs = tl.arange(0, PAD_SCAN_BLOCK)
    first = n_keys
    hi = n_keys * 0
    for start in range(0, n_keys, PAD_SCAN_BLOCK):
        idx = start + offs
        ok = tl.load(pad_base + idx * stride_padn, mask=idx < n_keys, other=1) == 0
        first = tl.minimum(first, tl.min(tl.where(ok, idx, n_keys), 0))
        hi = tl.maximum(hi, tl.max(tl.where(ok, idx + 1, 0), 0))
    return tl.minimum(first, hi), hi


@triton.jit
def _key_tiles(pad_base, stride_padn, start_m, Nk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr):
    """(lo, mid, hi) for the query block at start_m: key tiles [lo, mid) lie inside the sequence
    and at or below the causal diagonal for every row of the block (no bounds or causal checks);
    [mid, hi) need the checks; keys before lo or from hi on (above the diagonal, before the first
    or after the last unpadded key this block may see) are skipped."""
    hi = Nk
    if IS_CAUSAL:
        hi = tl.minimum(hi, start_m + BLOCK_M)
    lo = 0
    if HAS_PAD:  # only the keys this block may see are scanned
        first, hi = _unpadded_range(pad_base, stride_padn, hi)
        lo = (first // BLOCK_N) * BLOCK_N
    full = hi
    if IS_CAUSAL:
        full = tl.minimum(full, start_m + 1)
    mid = tl.maximum((full // BLOCK_N) * BLOCK_N, lo)
    return lo, mid, hi


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------
@triton.jit
def _fwd_tile(acc, l_i, m_i, q, start_m, start_n, k_base, v_base, stride_kn, stride_vn,
              mask_base, stride_maskm, stride_maskn, pad_base, stride_padn,
              Nq, Nk, qk_scale, seed, bh_offset, dropout_p,
              HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
              HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr, CHECK_BOUNDS: tl.constexpr,
              CHECK_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile [start_n, start_n + BLOCK_N) of the online softmax (CHECK_KEYS = CHECK_BOUNDS
    or HAS_PAD)."""
    mi = tl.arange(0, BLOCK_M)[:, None]
    nj = tl.arange(0, BLOCK_N)
    offs_n = start_n + nj
    n64 = tl.cast(start_n, tl.int64)
    key_ok = _key_ok(offs_n, Nk, pad_base, stride_padn, CHECK_BOUNDS, HAS_PAD)
    k = _load_rows(k_base + n64 * stride_kn, nj, stride_kn, key_ok, tl.arange(0, BLOCK_D), HEAD_D, BLOCK_D,
                   CHECK_KEYS)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = _mask_scores(s, start_m + mi, offs_n[None, :], mi, nj[None, :], key_ok[None, :], Nq, Nk,
                     mask_base + tl.cast(start_m, tl.int64) * stride_maskm + n64 * stride_maskn, stride_maskm,
                     stride_maskn, IS_CAUSAL, MASK_KIND, CHECK_KEYS)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with no allowed key so far keep m = -inf: subtract 0 instead, so P = exp2(-inf) = 0.
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, bh_offset + tl.cast(start_m, tl.int64) * Nk + n64, mi, nj[None, :], Nk, dropout_p)
        p = tl.where(keep, p, 0.0)
    v = _load_rows(v_base + n64 * stride_vn, nj, stride_vn, key_ok, tl.arange(0, BLOCK_DV), HEAD_DV, BLOCK_DV,
                   CHECK_KEYS)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


# Sizes and the seed are not specialized (a length of 1 would otherwise become a constant).
_NO_SPECIALIZE = ["H", "GROUP", "Nq", "Nk", "seed", "LEN_BUCKET"]


@autotune(fwd_configs(), TUNE_KEY, pruner(FWD_TILES_LOWP, FWD_TILES_FP32))
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def attention_fwd_kernel(
        Q, K, V, Out, Lse, Mask, Pad,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_maskb, stride_maskh, stride_maskm, stride_maskn, stride_padb, stride_padn,
        H, GROUP, Nq, Nk, qk_scale, dropout_p, seed, LEN_BUCKET,
        HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    hk = h // GROUP
    bh = b.to(tl.int64) * H + h
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    mask_base = Mask + b.to(tl.int64) * stride_maskb + h.to(tl.int64) * stride_maskh
    pad_base = Pad + b.to(tl.int64) * stride_padb
    bh_offset = bh * Nq * Nk

    start_m = pid_m * BLOCK_M
    lo, mid, hi = _key_tiles(pad_base, stride_padn, start_m, Nk, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_PAD)
    m64 = tl.cast(start_m, tl.int64)
    rows = tl.arange(0, BLOCK_M)
    row_ok = start_m + rows < Nq
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_rows(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + m64 * stride_qm, rows, stride_qm,
                   row_ok, tl.arange(0, BLOCK_D), HEAD_D, BLOCK_D, True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    for start_n in tl.range(lo, mid, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, start_m, start_n, k_base, v_base, stride_kn, stride_vn,
                                  mask_base, stride_maskm, stride_maskn, pad_base, stride_padn,
                                  Nq, Nk, qk_scale, seed, bh_offset, dropout_p,
                                  HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, False, MASK_KIND, HAS_PAD,
                                  HAS_DROPOUT, False, HAS_PAD, DOT_PRECISION)
    for start_n in tl.range(mid, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q, start_m, start_n, k_base, v_base, stride_kn, stride_vn,
                                  mask_base, stride_maskm, stride_maskn, pad_base, stride_padn,
                                  Nq, Nk, qk_scale, seed, bh_offset, dropout_p,
                                  HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, IS_CAUSAL, MASK_KIND,
                                  HAS_PAD, HAS_DROPOUT, True, True, DOT_PRECISION)

    # Rows with no allowed key: l = 0, acc = 0 -> output 0, lse = +inf.
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = acc * inv_l[:, None]
    _store_rows(Out + (bh * Nq + m64) * HEAD_DV, rows, HEAD_DV, row_ok, offs_dv, out.to(Out.dtype.element_ty),
                HEAD_DV, BLOCK_DV)
    lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    tl.store(Lse + bh * Nq + m64 + rows, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------------
@triton.jit
def attention_bwd_preprocess_kernel(Out, DOut, Delta, stride_dob, stride_doh, stride_dom, H, Nq,
                                    HEAD_DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] (O contiguous, as the forward wrote it)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    bh = b.to(tl.int64) * H + h
    m64 = (pid_m * BLOCK_M).to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = pid_m * BLOCK_M + rows < Nq
    o = _load_rows(Out + (bh * Nq + m64) * HEAD_DV, rows, HEAD_DV, row_ok, offs_dv, HEAD_DV, BLOCK_DV, True)
    do = _load_rows(DOut + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + m64 * stride_dom, rows,
                    stride_dom, row_ok, offs_dv, HEAD_DV, BLOCK_DV, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh * Nq + m64 + rows, delta, mask=row_ok)


@triton.jit
def _dkdv_tile(dk, dv, k, v, start_m, start_n, q_base, do_base, lse_base, delta_base, stride_qm, stride_dom,
               mask_base, stride_maskm, stride_maskn, Nq, Nk, qk_scale, seed, bh_offset, dropout_p,
               HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
               HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dK, dV of the key block at start_n += the contributions of query rows [start_m, start_m +
    BLOCK_M), on transposed (key, query) tiles. Keys out of range or padded are not masked here:
    their rows of dK/dV are zeroed at the store, and key rows never mix in these products."""
    mi = tl.arange(0, BLOCK_M)
    nj = tl.arange(0, BLOCK_N)[:, None]
    offs_m = start_m + mi
    m64 = tl.cast(start_m, tl.int64)
    row_ok = offs_m < Nq
    q = _load_rows(q_base + m64 * stride_qm, mi, stride_qm, row_ok, tl.arange(0, BLOCK_D), HEAD_D, BLOCK_D, True)
    do = _load_rows(do_base + m64 * stride_dom, mi, stride_dom, row_ok, tl.arange(0, BLOCK_DV), HEAD_DV, BLOCK_DV,
                    True)
    # lse = +inf beyond Nq (and on rows with no allowed key) makes P = 0 there.
    lse2 = tl.load(lse_base + m64 + mi, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(delta_base + m64 + mi, mask=row_ok, other=0.0)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
    s_t = _mask_scores(s_t, offs_m[None, :], start_n + nj, mi[None, :], nj, row_ok[None, :], Nq, Nk,
                       mask_base + m64 * stride_maskm + tl.cast(start_n, tl.int64) * stride_maskn, stride_maskm,
                       stride_maskn, IS_CAUSAL, MASK_KIND, False)
    p_t = tl.exp2(s_t - lse2[None, :])
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        keep_t = _dropout_keep(seed, bh_offset + m64 * Nk + start_n, mi[None, :], nj, Nk, dropout_p)
        inv_keep = 1.0 / (1.0 - dropout_p)
        dv = tl.dot(tl.where(keep_t, p_t * inv_keep, 0.0).to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.where(keep_t, dp_t * inv_keep, 0.0)
    else:
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@autotune(dkdv_configs(), TUNE_KEY, pruner(DKDV_TILES_LOWP, DKDV_TILES_FP32))
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def attention_bwd_dkdv_kernel(
        Q, K, V, DOut, Lse, Delta, DK, DV, Mask, Pad,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom,
        stride_maskb, stride_maskh, stride_maskm, stride_maskn, stride_padb, stride_padn,
        H, GROUP, Nq, Nk, qk_scale, scale, dropout_p, seed, LEN_BUCKET,
        HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    Hk = H // GROUP
    bhk = b.to(tl.int64) * Hk + hk
    start_n = pid_n * BLOCK_N
    n64 = tl.cast(start_n, tl.int64)
    rows = tl.arange(0, BLOCK_N)
    offs_n = start_n + rows
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    key_ok = _key_ok(offs_n, Nk, Pad + b.to(tl.int64) * stride_padb, stride_padn, True, HAS_PAD)
    k = _load_rows(K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + n64 * stride_kn, rows, stride_kn,
                   key_ok, offs_d, HEAD_D, BLOCK_D, True)
    v = _load_rows(V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + n64 * stride_vn, rows, stride_vn,
                   key_ok, offs_dv, HEAD_DV, BLOCK_DV, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # Query blocks: [lo, mid) straddle the causal diagonal (masked), [mid, Nq) lie below it.
    lo = 0
    mid = 0
    if IS_CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, tl.cdiv(Nq, BLOCK_M) * BLOCK_M)
    hi = Nq
    if HAS_PAD:  # every key of the block padded: skip the loops
        skip = tl.max(key_ok.to(tl.int32), 0) == 0
        lo = tl.where(skip, Nq, lo)
        mid = tl.where(skip, Nq, mid)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b.to(tl.int64) * H + h
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_base = DOut + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        mask_base = Mask + b.to(tl.int64) * stride_maskb + h.to(tl.int64) * stride_maskh
        lse_base = Lse + bh * Nq
        delta_base = Delta + bh * Nq
        bh_offset = bh * Nq * Nk
        for start_m in tl.range(lo, mid, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, v, start_m, start_n, q_base, do_base, lse_base, delta_base,
                                stride_qm, stride_dom, mask_base, stride_maskm, stride_maskn, Nq, Nk, qk_scale,
                                seed, bh_offset, dropout_p, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N,
                                IS_CAUSAL, MASK_KIND, HAS_DROPOUT, DOT_PRECISION)
        for start_m in tl.range(mid, hi, BLOCK_M):
            dk, dv = _dkdv_tile(dk, dv, k, v, start_m, start_n, q_base, do_base, lse_base, delta_base,
                                stride_qm, stride_dom, mask_base, stride_maskm, stride_maskn, Nq, Nk, qk_scale,
                                seed, bh_offset, dropout_p, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N,
                                False, MASK_KIND, HAS_DROPOUT, DOT_PRECISION)

    # Padded and out-of-range keys get no gradient (and whatever was computed for them is dropped).
    dk = tl.where(key_ok[:, None], dk * scale, 0.0)
    dv = tl.where(key_ok[:, None], dv, 0.0)
    row_ok = offs_n < Nk
    _store_rows(DK + (bhk * Nk + n64) * HEAD_D, rows, HEAD_D, row_ok, offs_d, dk.to(DK.dtype.element_ty), HEAD_D,
                BLOCK_D)
    _store_rows(DV + (bhk * Nk + n64) * HEAD_DV, rows, HEAD_DV, row_ok, offs_dv, dv.to(DV.dtype.element_ty),
                HEAD_DV, BLOCK_DV)


@triton.jit
def _dq_tile(dq, q, do, lse2, delta, start_m, start_n, k_base, v_base, stride_kn, stride_vn,
             mask_base, stride_maskm, stride_maskn, pad_base, stride_padn, Nq, Nk, qk_scale, seed, bh_offset,
             dropout_p, ds_base, HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr,
             MASK_KIND: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr, CHECK_BOUNDS: tl.constexpr,
             CHECK_KEYS: tl.constexpr, DOT_PRECISION: tl.constexpr, STORE_DS: tl.constexpr):
    """dQ of the query block at start_m += the contribution of key tile [start_n, start_n +
    BLOCK_N) (CHECK_KEYS = CHECK_BOUNDS or HAS_PAD). With STORE_DS, also writes the tile's dS to
    the (Nq, Nk) row-major block of this head at ds_base."""
    mi = tl.arange(0, BLOCK_M)[:, None]
    nj = tl.arange(0, BLOCK_N)
    offs_n = start_n + nj
    n64 = tl.cast(start_n, tl.int64)
    key_ok = _key_ok(offs_n, Nk, pad_base, stride_padn, CHECK_BOUNDS, HAS_PAD)
    k = _load_rows(k_base + n64 * stride_kn, nj, stride_kn, key_ok, tl.arange(0, BLOCK_D), HEAD_D, BLOCK_D,
                   CHECK_KEYS)
    v = _load_rows(v_base + n64 * stride_vn, nj, stride_vn, key_ok, tl.arange(0, BLOCK_DV), HEAD_DV, BLOCK_DV,
                   CHECK_KEYS)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = _mask_scores(s, start_m + mi, offs_n[None, :], mi, nj[None, :], key_ok[None, :], Nq, Nk,
                     mask_base + tl.cast(start_m, tl.int64) * stride_maskm + n64 * stride_maskn, stride_maskm,
                     stride_maskn, IS_CAUSAL, MASK_KIND, CHECK_KEYS)
    p = tl.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        keep = _dropout_keep(seed, bh_offset + tl.cast(start_m, tl.int64) * Nk + n64, mi, nj[None, :], Nk, dropout_p)
        dp = tl.where(keep, dp * (1.0 / (1.0 - dropout_p)), 0.0)
    ds = (p * (dp - delta[:, None])).to(k.dtype)
    if STORE_DS:  # 0 where P = 0: padded keys' V loads as 0, so dP is finite there
        ds_ptrs = ds_base + (tl.cast(start_m, tl.int64) * Nk + n64) + (mi * Nk + nj[None, :])
        tl.store(ds_ptrs, ds, mask=(start_m + mi < Nq) & (offs_n[None, :] < Nk))
    dq = tl.dot(ds, k, dq, input_precision=DOT_PRECISION)
    return dq


@autotune(dq_configs(), TUNE_KEY + ["STORE_DS"], pruner(DQ_TILES_LOWP, DQ_TILES_FP32))
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def attention_bwd_dq_kernel(
        Q, K, V, DOut, Lse, Delta, DQ, DS, Mask, Pad,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
        stride_dob, stride_doh, stride_dom,
        stride_maskb, stride_maskh, stride_maskm, stride_maskn, stride_padb, stride_padn,
        H, GROUP, Nq, Nk, qk_scale, scale, dropout_p, seed, LEN_BUCKET,
        HEAD_D: tl.constexpr, HEAD_DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
        DOT_PRECISION: tl.constexpr, STORE_DS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ of a query block; with STORE_DS also dS into DS, (B, H, Nq, Nk) contiguous and
    zero-filled (the key tiles skipped here have dS = 0)."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    hk = h // GROUP
    bh = b.to(tl.int64) * H + h
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    mask_base = Mask + b.to(tl.int64) * stride_maskb + h.to(tl.int64) * stride_maskh
    pad_base = Pad + b.to(tl.int64) * stride_padb
    bh_offset = bh * Nq * Nk
    ds_base = DS + bh_offset

    start_m = pid_m * BLOCK_M
    lo, mid, hi = _key_tiles(pad_base, stride_padn, start_m, Nk, BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_PAD)
    m64 = tl.cast(start_m, tl.int64)
    rows = tl.arange(0, BLOCK_M)
    row_ok = start_m + rows < Nq
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + m64 * stride_qm, rows, stride_qm,
                   row_ok, offs_d, HEAD_D, BLOCK_D, True)
    do = _load_rows(DOut + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + m64 * stride_dom, rows,
                    stride_dom, row_ok, tl.arange(0, BLOCK_DV), HEAD_DV, BLOCK_DV, True)
    lse2 = tl.load(Lse + bh * Nq + m64 + rows, mask=row_ok, other=float("inf")) * 1.4426950408889634
    delta = tl.load(Delta + bh * Nq + m64 + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    for start_n in tl.range(lo, mid, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse2, delta, start_m, start_n, k_base, v_base, stride_kn, stride_vn,
                      mask_base, stride_maskm, stride_maskn, pad_base, stride_padn, Nq, Nk, qk_scale, seed,
                      bh_offset, dropout_p, ds_base, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, False,
                      MASK_KIND, HAS_PAD, HAS_DROPOUT, False, HAS_PAD, DOT_PRECISION, STORE_DS)
    for start_n in tl.range(mid, hi, BLOCK_N):
        dq = _dq_tile(dq, q, do, lse2, delta, start_m, start_n, k_base, v_base, stride_kn, stride_vn,
                      mask_base, stride_maskm, stride_maskn, pad_base, stride_padn, Nq, Nk, qk_scale, seed,
                      bh_offset, dropout_p, ds_base, HEAD_D, HEAD_DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N,
                      IS_CAUSAL, MASK_KIND, HAS_PAD, HAS_DROPOUT, True, True, DOT_PRECISION, STORE_DS)
    _store_rows(DQ + (bh * Nq + m64) * HEAD_D, rows, HEAD_D, row_ok, offs_d, (dq * scale).to(DQ.dtype.element_ty),
                HEAD_D, BLOCK_D)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------
def _mask_kind(attn_mask):
    """MASK_KIND: 0 none, 1 bool (read as bytes), 2 float."""
    if attn_mask is None:
        return 0
    return 1 if attn_mask.dtype == torch.bool else 2


def _mask_args(attn_mask, q):
    """(tensor, 4 strides); q stands in for an absent mask (never read)."""
    if attn_mask is None:
        return q, (0, 0, 0, 0)
    if attn_mask.dtype == torch.bool:
        return attn_mask.view(torch.uint8), attn_mask.stride()
    return attn_mask, attn_mask.stride()


def _padding_args(key_padding_mask, q):
    """(padding bytes, 2 strides); q stands in for an absent mask (never read). The kernels find
    each sequence's unpadded key range themselves."""
    if key_padding_mask is None:
        return q, (0, 0)
    return key_padding_mask.view(torch.uint8), key_padding_mask.stride()


def _common_meta(q, k, v, attn_mask, key_padding_mask, is_causal, dropout_p):
    D, Dv = q.shape[3], v.shape[3]
    if max(D, Dv) > 256:  # the public API checks this; the tile tables stop at 256
        raise ValueError(f"the Triton attention kernels take head dims up to 256, got query {D}, value {Dv}")
    block_d, block_dv = block_dims(D, Dv)
    return dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv, IS_CAUSAL=bool(is_causal),
                MASK_KIND=_mask_kind(attn_mask), HAS_PAD=key_padding_mask is not None,
                HAS_DROPOUT=dropout_p > 0.0, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def _check_dense_only(window, softcap, alibi_slopes, cu_seq_q, sinks=None):
    if tuple(window) != (-1, -1) or softcap or alibi_slopes is not None or sinks is not None or cu_seq_q is not None:
        raise NotImplementedError("the Triton attention kernels do not implement windows, softcap, ALiBi, sinks "
                                  "or packed sequences yet")


def attention_forward(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, window=(-1, -1),
                      softcap=0.0, alibi_slopes=None, sinks=None, cu_seq_q=None, cu_seq_k=None, seqused_k=None,
                      block_table=None, max_q=0, max_k=0, num_splits=0):
    _check_dense_only(window, softcap, alibi_slopes, cu_seq_q, sinks)
    B, H, Nq, D = q.shape
    Hk, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    out = new_output((B, H, Nq, Dv), q.dtype, q.device)
    lse = new_output((B, H, Nq), torch.float32, q.device)
    mask, mask_strides = _mask_args(attn_mask, q)
    pad, pad_strides = _padding_args(key_padding_mask, q)
    meta = _common_meta(q, k, v, attn_mask, key_padding_mask, is_causal, dropout_p)
    grid = lambda META: (cdiv(Nq, META["BLOCK_M"]), H, B)  # noqa: E731
    attention_fwd_kernel[grid](
        q, k, v, out, lse, mask, pad,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *mask_strides, *pad_strides,
        H, H // Hk, Nq, Nk, float(scale) * LOG2E, float(dropout_p), int(seed), length_bucket(Nq, Nk), **meta,
        **LAUNCH_OPTIONS)
    return out, lse


def _backward_scalar_args(q, k, v, dout, mask_strides, pad_strides, scale, dropout_p, seed):
    """The strides and scalars of the dK/dV and dQ kernels, in their argument order (after the
    tensors)."""
    H, Nq = q.shape[1], q.shape[2]
    Hk, Nk = k.shape[1], k.shape[2]
    return (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
            *mask_strides, *pad_strides, H, H // Hk, Nq, Nk, float(scale) * LOG2E, float(scale), float(dropout_p),
            int(seed), length_bucket(Nq, Nk))


def attention_backward(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed,
                       compute_dmask, window=(-1, -1), softcap=0.0, alibi_slopes=None, cu_seq_q=None, cu_seq_k=None,
                       max_q=0, max_k=0):
    _check_dense_only(window, softcap, alibi_slopes, cu_seq_q)
    B, H, Nq, D = q.shape
    Hk, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if Dv > 1 and dout.stride(3) != 1:
        dout = dout.contiguous()
    out, lse = out.contiguous(), lse.contiguous()
    mask, mask_strides = _mask_args(attn_mask, q)
    pad, pad_strides = _padding_args(key_padding_mask, q)
    meta = _common_meta(q, k, v, attn_mask, key_padding_mask, is_causal, dropout_p)

    delta = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    pre_block = 64 if meta["BLOCK_DV"] <= 128 else 32
    attention_bwd_preprocess_kernel[(cdiv(Nq, pre_block), H, B)](
        out, dout, delta, dout.stride(0), dout.stride(1), dout.stride(2), H, Nq,
        HEAD_DV=Dv, BLOCK_DV=meta["BLOCK_DV"], BLOCK_M=pre_block, **LAUNCH_OPTIONS)

    dq = new_output((B, H, Nq, D), q.dtype, q.device)
    dk = new_output((B, Hk, Nk, D), k.dtype, k.device)
    dv = new_output((B, Hk, Nk, Dv), v.dtype, v.device)
    # dS: zero-filled, as the dQ kernel skips key tiles past the causal diagonal or all padded
    dmask = torch.zeros((B, H, Nq, Nk), dtype=q.dtype, device=q.device) if compute_dmask else None
    args = _backward_scalar_args(q, k, v, dout, mask_strides, pad_strides, scale, dropout_p, seed)
    attention_bwd_dkdv_kernel[lambda META: (cdiv(Nk, META["BLOCK_N"]), Hk, B)](
        q, k, v, dout, lse, delta, dk, dv, mask, pad, *args, **meta, **LAUNCH_OPTIONS)
    attention_bwd_dq_kernel[lambda META: (cdiv(Nq, META["BLOCK_M"]), H, B)](
        q, k, v, dout, lse, delta, dq, dq if dmask is None else dmask, mask, pad, *args, **meta,
        STORE_DS=compute_dmask, **LAUNCH_OPTIONS)
    return dq, dk, dv, dmask
