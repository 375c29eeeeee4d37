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
the last unpadded key of a sequence, are skipped.

fp32 inputs use input_precision="ieee" for tl.dot (exact fp32 products; a GPU's default tf32
would miss the tests' 2x-reference-error policy); fp16/bf16 use tensor cores with fp32
accumulation.
"""

import torch
import triton
import triton.language as tl

from ._utils import (LAUNCH_OPTIONS, autotune_configs, cdiv, forced_tile_index, interpreting, new_output,
                     next_power_of_2)

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


@triton.jit
def _kv_range(KvRange, b, Nk, HAS_PAD: tl.constexpr):
    """[first, last + 1) unpadded key of batch b (the whole sequence without padding)."""
    if HAS_PAD:
        lo = tl.load(KvRange + 2 * b)
        hi = tl.load(KvRange + 2 * b + 1)
    else:
        lo = 0
        hi = Nk
    return lo, hi


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


def _fwd_configs():
    if interpreting():  # small, unequal tiles: the tests' short sequences span several of them
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in _FWD_TILES]


def _all_tiles(*tables):
    return sorted({t for table in tables for ts in table.values() for t in ts})


# (BLOCK_M, BLOCK_N, num_warps, num_stages); which apply to a call is decided by _prune.
# (128, 64, 4 warps) and (128, 128, 8 warps) spill on sm_80/sm_90 and are left out.
_FWD_TILES_LOWP = {  # fp16/bf16, by padded head dim
    64: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    128: [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3)],
    256: [(64, 64, 8, 2), (64, 32, 4, 2)],  # (64, 64, 4 warps) spills here
}
# fp32 (ieee dots on CUDA cores). One tile per head dim, picked with the compile check: the one
# that spills least on sm_80 and sm_90 across plain inputs, causal + padding + bool mask, and
# causal + padding + float mask + dropout. ptxas is erratic here: (32, 32, 4 warps, 2 stages)
# at head dim 256 was given 32 registers and 67-77 KB of spills per thread.
_FWD_TILES_FP32 = {64: [(32, 32, 4, 2)], 128: [(32, 32, 8, 1)], 256: [(16, 16, 4, 1)]}
_FWD_TILES = _all_tiles(_FWD_TILES_LOWP, _FWD_TILES_FP32)


def _head_class(block_d):
    return 64 if block_d <= 64 else block_d


def _tiles_for(args, table_lowp, table_fp32):
    head = _head_class(max(args["BLOCK_D"], args["BLOCK_DV"]))
    table = table_fp32 if args["DOT_PRECISION"] == "ieee" else table_lowp
    return table[head]


def _prune(table_lowp, table_fp32):
    def prune(configs, named_args, **kwargs):
        wanted = _tiles_for({**named_args, **kwargs}, table_lowp, table_fp32)
        forced = forced_tile_index()
        if forced is not None:
            wanted = [wanted[forced % len(wanted)]]
        kept = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                in wanted]
        return kept or configs[:1]
    return prune


# Sizes and the seed are not specialized (a length of 1 would otherwise become a constant).
_NO_SPECIALIZE = ["H", "GROUP", "Nq", "Nk", "seed", "LEN_BUCKET"]
_TUNE_KEY = ["LEN_BUCKET", "BLOCK_D", "BLOCK_DV", "IS_CAUSAL", "MASK_KIND", "HAS_PAD", "HAS_DROPOUT", "DOT_PRECISION"]


@triton.autotune(configs=autotune_configs(_fwd_configs()), key=_TUNE_KEY,
                 prune_configs_by={"early_config_prune": _prune(_FWD_TILES_LOWP, _FWD_TILES_FP32)})
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def attention_fwd_kernel(
        Q, K, V, Out, Lse, Mask, Pad, KvRange,
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
    m64 = tl.cast(start_m, tl.int64)
    rows = tl.arange(0, BLOCK_M)
    row_ok = start_m + rows < Nq
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_rows(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + m64 * stride_qm, rows, stride_qm,
                   row_ok, tl.arange(0, BLOCK_D), HEAD_D, BLOCK_D, True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    # Key tiles: [lo, mid) lie inside the sequence and below the causal diagonal for every row of
    # this block (no bounds or causal checks); [mid, hi) need them; the rest is skipped.
    kv_lo, kv_hi = _kv_range(KvRange, b, Nk, HAS_PAD)
    lo = (kv_lo // BLOCK_N) * BLOCK_N
    hi = kv_hi
    full = kv_hi
    if IS_CAUSAL:
        hi = tl.minimum(hi, start_m + BLOCK_M)
        full = tl.minimum(full, start_m + 1)
    mid = tl.maximum((full // BLOCK_N) * BLOCK_N, lo)
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


def _bwd_configs(tiles):
    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tiles]


# Backward tiles (BLOCK_M, BLOCK_N, num_warps, num_stages). The dK/dV kernel holds a BLOCK_N key
# block (K, V and two fp32 accumulators) and streams BLOCK_M query rows: long key blocks and short
# query tiles. The dQ kernel holds BLOCK_M query rows and streams keys. Chosen on an H100 with
# benchmarks/tools/sweep_attention_tiles_gpu.py (bf16, N=4096; output in benchmarks/results/): the
# three fastest tiles per kernel and head dim that spill little or nothing, causal and not. The
# mask features are part of the autotune key: with them the same tile can spill (compile check).
_DKDV_TILES_LOWP = {
    64: [(16, 128, 4, 3), (32, 64, 4, 3), (32, 128, 8, 3)],
    # (64, 64, 8 warps): half the speed of the others on plain inputs, but with causal + padding +
    # a mask it spills least of them on sm_80 (76 bytes against 150-18000)
    128: [(32, 128, 8, 2), (32, 128, 8, 3), (32, 64, 4, 3), (64, 64, 8, 2)],
    256: [(32, 32, 8, 1), (64, 32, 8, 1)],
}
_DQ_TILES_LOWP = {
    64: [(64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3)],
    128: [(64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2)],
    256: [(32, 32, 8, 1), (64, 32, 8, 1)],
}
_DKDV_TILES_FP32 = {64: [(32, 32, 8, 1)], 128: [(32, 32, 8, 1)], 256: [(16, 32, 8, 1)]}  # chosen as _FWD_TILES_FP32
_DQ_TILES_FP32 = {64: [(32, 32, 8, 1)], 128: [(32, 16, 8, 1)], 256: [(16, 32, 8, 1)]}


@triton.autotune(configs=autotune_configs(_bwd_configs(_all_tiles(_DKDV_TILES_LOWP, _DKDV_TILES_FP32))),
                 key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune(_DKDV_TILES_LOWP, _DKDV_TILES_FP32)})
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def attention_bwd_dkdv_kernel(
        Q, K, V, DOut, Lse, Delta, DK, DV, Mask, Pad, KvRange,
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
    kv_lo, kv_hi = _kv_range(KvRange, b, Nk, HAS_PAD)
    lo = 0
    mid = 0
    if IS_CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, tl.cdiv(Nq, BLOCK_M) * BLOCK_M)
    hi = Nq
    if HAS_PAD:  # every key of the block padded: skip the loops
        skip = (start_n >= kv_hi) | (start_n + BLOCK_N <= kv_lo)
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


@triton.autotune(configs=autotune_configs(_bwd_configs(_all_tiles(_DQ_TILES_LOWP, _DQ_TILES_FP32))),
                 key=_TUNE_KEY + ["STORE_DS"],
                 prune_configs_by={"early_config_prune": _prune(_DQ_TILES_LOWP, _DQ_TILES_FP32)})
@triton.jit(do_not_specialize=_NO_SPECIALIZE)
def attention_bwd_dq_kernel(
        Q, K, V, DOut, Lse, Delta, DQ, DS, Mask, Pad, KvRange,
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

    kv_lo, kv_hi = _kv_range(KvRange, b, Nk, HAS_PAD)  # tiles split as in the forward
    lo = (kv_lo // BLOCK_N) * BLOCK_N
    hi = kv_hi
    full = kv_hi
    if IS_CAUSAL:
        hi = tl.minimum(hi, start_m + BLOCK_M)
        full = tl.minimum(full, start_m + 1)
    mid = tl.maximum((full // BLOCK_N) * BLOCK_N, lo)
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
def _block_dim(d):
    return max(16, next_power_of_2(d))  # tl.dot needs >= 16 along every dim


def _block_dims(d, dv):
    """(BLOCK_D, BLOCK_DV). Where the query/key head dim is not a multiple of 16 and the value
    block would be narrower, the value block is widened to BLOCK_D. On an H100, Triton 3.6
    miscompiled the forward for (D, Dv) = (40, 23) and (24, 11), with wrong outputs and
    out-of-range shared-memory accesses (compute-sanitizer), while (48, 23), (80, 23), (80, 40)
    and ten other pairs with a padded head dim were right without widening (docs/design.md).
    Widening wherever a head dim is padded would cost spills (dK/dV at (80, 40): 14 KB on sm_80).
    The extra value columns are loaded as zeros and never stored."""
    block_d, block_dv = _block_dim(d), _block_dim(dv)
    if d % 16 and block_dv < block_d:
        block_dv = block_d
    return block_d, block_dv


def _len_bucket(nq, nk):
    """The autotune key's length bucket: powers of two of Nq and Nk, capped."""
    return min(next_power_of_2(nq), 16384) * 32768 + min(next_power_of_2(nk), 16384)


def _mask_args(attn_mask, q):
    """(tensor, 4 strides, MASK_KIND): 0 none, 1 bool (read as bytes), 2 float."""
    if attn_mask is None:
        return q, (0, 0, 0, 0), 0
    if attn_mask.dtype == torch.bool:
        return attn_mask.view(torch.uint8), attn_mask.stride(), 1
    return attn_mask, attn_mask.stride(), 2


def _padding_args(key_padding_mask, q):
    """(padding bytes, 2 strides, per-batch [first, last + 1) unpadded key as int32 (B, 2))."""
    if key_padding_mask is None:
        return q, (0, 0), q
    valid = ~key_padding_mask
    nk = valid.shape[1]
    idx = torch.arange(nk, device=valid.device)
    first = torch.where(valid, idx, nk).amin(1)
    last = torch.where(valid, idx + 1, 0).amax(1)
    kv_range = torch.stack([torch.minimum(first, last), last], 1).to(torch.int32).contiguous()
    return key_padding_mask.view(torch.uint8), key_padding_mask.stride(), kv_range


def _common_meta(q, k, v, attn_mask, key_padding_mask, is_causal, dropout_p):
    D, Dv = q.shape[3], v.shape[3]
    if max(D, Dv) > 256:  # the public API checks this; the tile tables stop at 256
        raise ValueError(f"the Triton attention kernels take head dims up to 256, got query {D}, value {Dv}")
    block_d, block_dv = _block_dims(D, Dv)
    return dict(HEAD_D=D, HEAD_DV=Dv, BLOCK_D=block_d, BLOCK_DV=block_dv, IS_CAUSAL=bool(is_causal),
                MASK_KIND=_mask_args(attn_mask, q)[2], HAS_PAD=key_padding_mask is not None,
                HAS_DROPOUT=dropout_p > 0.0, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def attention_forward(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed):
    B, H, Nq, D = q.shape
    Hk, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    out = new_output((B, H, Nq, Dv), q.dtype, q.device)
    lse = new_output((B, H, Nq), torch.float32, q.device)
    mask, mask_strides, _ = _mask_args(attn_mask, q)
    pad, pad_strides, kv_range = _padding_args(key_padding_mask, q)
    meta = _common_meta(q, k, v, attn_mask, key_padding_mask, is_causal, dropout_p)
    grid = lambda META: (cdiv(Nq, META["BLOCK_M"]), H, B)  # noqa: E731
    attention_fwd_kernel[grid](
        q, k, v, out, lse, mask, pad, kv_range,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *mask_strides, *pad_strides,
        H, H // Hk, Nq, Nk, float(scale) * LOG2E, float(dropout_p), int(seed), _len_bucket(Nq, Nk), **meta,
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
            int(seed), _len_bucket(Nq, Nk))


def attention_backward(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed,
                       compute_dmask):
    B, H, Nq, D = q.shape
    Hk, Nk, Dv = k.shape[1], k.shape[2], v.shape[3]
    if Dv > 1 and dout.stride(3) != 1:
        dout = dout.contiguous()
    out, lse = out.contiguous(), lse.contiguous()
    mask, mask_strides, _ = _mask_args(attn_mask, q)
    pad, pad_strides, kv_range = _padding_args(key_padding_mask, q)
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
        q, k, v, dout, lse, delta, dk, dv, mask, pad, kv_range, *args, **meta, **LAUNCH_OPTIONS)
    attention_bwd_dq_kernel[lambda META: (cdiv(Nq, META["BLOCK_M"]), H, B)](
        q, k, v, dout, lse, delta, dq, dq if dmask is None else dmask, mask, pad, kv_range, *args, **meta,
        STORE_DS=compute_dmask, **LAUNCH_OPTIONS)
    return dq, dk, dv, dmask


# --------------------------------------------------------------------------------------------
# GPU compile check
# --------------------------------------------------------------------------------------------
_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def _signature(kernel, pointers, constexprs):
    """Every argument of `kernel`: pointers as given, "constexpr" for meta-parameters, fp32 for
    the float scalars, i64 for the seed and i32 for the other ints."""
    sig = {}
    for name in kernel.arg_names:
        if name in pointers:
            sig[name] = pointers[name]
        elif name in constexprs:
            sig[name] = "constexpr"
        elif name in ("qk_scale", "scale", "dropout_p"):
            sig[name] = "fp32"
        elif name == "seed":
            sig[name] = "i64"
        else:
            sig[name] = "i32"
    return sig


def _jit_function(kernel):
    """The JITFunction under autotune/heuristics wrappers."""
    while not isinstance(kernel, triton.runtime.JITFunction):
        kernel = kernel.fn
    return kernel


def _divisibility(fn, head_d, head_dv):
    """The launch-time specialization of contiguous q/k/v/dO with head dims that are multiples of
    16: every tensor pointer and every q/k/v/dO stride divisible by 16 (vectorized loads)."""
    names = [n for n in fn.arg_names if n in ("Q", "K", "V", "Out", "Lse", "DOut", "Delta", "DQ", "DK", "DV", "DS")]
    if head_d % 16 == 0 and head_dv % 16 == 0:
        names += [n for n in fn.arg_names if n.startswith(("stride_q", "stride_k", "stride_v", "stride_do"))]
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def compile_cases():
    """Every autotune tile of each kernel for each head-dim class (fp16, plain; one head-dim-128
    tile with causal + padding + bool mask), the fp32 tile of each class, dropout, a float
    mask with odd head dims, and the backward preprocess; forward fp16/bf16 cases must use wgmma
    on sm_90."""
    cases = []

    def add(kernel, name, dtype, head_d, head_dv, tile, *, causal=False, mask_kind=0, pad=False, dropout=False,
            store_ds=False, expect_wgmma=False):
        block_m, block_n, warps, stages = tile
        t = "*" + _TYPE[dtype]
        mask_type = {0: t, 1: "*u8", 2: t}[mask_kind]
        pointers = {n: t for n in ("Q", "K", "V", "Out", "DOut", "DQ", "DK", "DV", "DS")}
        pointers.update(Lse="*fp32", Delta="*fp32", Mask=mask_type, Pad="*u8" if pad else t,
                        KvRange="*i32" if pad else t)
        block_d, block_dv = _block_dims(head_d, head_dv)
        constexprs = dict(HEAD_D=head_d, HEAD_DV=head_dv, BLOCK_D=block_d, BLOCK_DV=block_dv, IS_CAUSAL=causal,
                          MASK_KIND=mask_kind, HAS_PAD=pad, HAS_DROPOUT=dropout,
                          DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32", STORE_DS=store_ds,
                          BLOCK_M=block_m, BLOCK_N=block_n)
        fn = _jit_function(kernel)
        constexprs = {k: v for k, v in constexprs.items() if k in fn.arg_names}
        features = "".join(f for f, on in (("c", causal), ("b" if mask_kind == 1 else "f", mask_kind), ("p", pad),
                                             ("r", dropout), ("s", store_ds)) if on) or "plain"
        cases.append(dict(
            name=f"{name}[{_TYPE[dtype]},d{head_d}/{head_dv},{features},m{block_m}n{block_n}w{warps}s{stages}]",
            fn=fn, signature=_signature(fn, pointers, constexprs), constexprs=constexprs,
            attrs=_divisibility(fn, head_d, head_dv), num_warps=warps, num_stages=stages, expect_wgmma=expect_wgmma))

    heads = {64: (64, 64), 128: (128, 128), 256: (256, 256)}
    kernels = ((attention_fwd_kernel, "attention_fwd", _FWD_TILES_LOWP, _FWD_TILES_FP32),
               (attention_bwd_dkdv_kernel, "attention_bwd_dkdv", _DKDV_TILES_LOWP, _DKDV_TILES_FP32),
               (attention_bwd_dq_kernel, "attention_bwd_dq", _DQ_TILES_LOWP, _DQ_TILES_FP32))
    for kernel, name, lowp, fp32 in kernels:
        forward = kernel is attention_fwd_kernel
        for cls, (d, dv) in heads.items():
            for i, tile in enumerate(lowp[cls]):
                # plain, but the first head-dim-128 tile with causal + padding + bool mask (the most work
                # per tile; these compile several times slower, so only one per kernel)
                full = cls == 128 and i == 0
                add(kernel, name, torch.float16, d, dv, tile, causal=full, mask_kind=1 if full else 0, pad=full,
                    expect_wgmma=forward)
        # fp32 (each head-dim class's tile, with causal + padding + bool mask), dropout, and a float
        # mask with odd head dims (padded inside the kernel)
        for cls, (d, dv) in heads.items():
            add(kernel, name, torch.float32, d, dv, fp32[cls][0], causal=True, mask_kind=1, pad=True)
        add(kernel, name, torch.bfloat16, 128, 128, lowp[128][0], causal=True, dropout=True, expect_wgmma=forward)
        add(kernel, name, torch.bfloat16, 80, 40, lowp[128][0], mask_kind=2, expect_wgmma=forward)
        add(kernel, name, torch.float16, 40, 23, lowp[64][0], mask_kind=2, pad=True, expect_wgmma=forward)
    # dS out (a float mask that requires grad): causal + padding + float mask + dropout, as in T5
    # training, for each dtype class
    for dtype, cls in ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 64)):
        tiles = _DQ_TILES_FP32 if dtype == torch.float32 else _DQ_TILES_LOWP
        add(attention_bwd_dq_kernel, "attention_bwd_dq", dtype, cls, cls, tiles[cls][0], causal=True, mask_kind=2,
            pad=True, dropout=True, store_ds=True)
    preprocess = _jit_function(attention_bwd_preprocess_kernel)
    for dtype, dv, block in ((torch.float16, 64, 64), (torch.float32, 256, 32)):
        constexprs = dict(HEAD_DV=dv, BLOCK_DV=dv, BLOCK_M=block)
        t = "*" + _TYPE[dtype]
        cases.append(dict(name=f"attention_bwd_preprocess[{_TYPE[dtype]},dv{dv},m{block}]", fn=preprocess,
                          signature=_signature(preprocess, {"Out": t, "DOut": t, "Delta": "*fp32"}, constexprs),
                          constexprs=constexprs, num_warps=4, num_stages=1, expect_wgmma=False))
    return cases
