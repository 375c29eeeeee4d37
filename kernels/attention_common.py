"""The jit helpers shared by the Triton softmax-attention kernels (kernels/attention_forward.py,
attention_backward.py, attention_decode.py): tile loads and stores, the score function (scale,
soft-capping, ALiBi, masks, causal and window bands), dropout, each sequence's extent in a pack, and
the key or query tiles a block has to visit.

Units: scores are kept in base 2 (log2(e) is folded into every term), so P = exp2(s - m).

Tile ranges. A block's tiles to visit are contiguous, [lo, hi), starting at `lo`, a multiple of
the tile; inside, [a, b) (tile-aligned) holds the tiles every row of the block may use whole:
they run without the causal, window and bounds checks. [lo, a) and [b, hi) run with them; only
with a window's left edge are both non-empty (one loop then walks the two, `_masked_tile`), else
the kernels run one plain loop over the one that is. A split of the keys (Flash-Decoding) takes a
contiguous share of the tiles and the same kinds inside it (`_split_tiles`).
"""

import triton
import triton.language as tl

from ._triton_options import interpreting

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# --------------------------------------------------------------------------------------------
# Loads and stores
# --------------------------------------------------------------------------------------------
@triton.jit
def _load_rows(base, row_offs, row_ok, cols, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """A (len(row_offs), BLOCK_COLS) tile whose row r starts at base + row_offs[r] (unit column
    stride); rows that are not `row_ok` and columns >= N_COLS read as 0. `row_offs` are int32
    offsets from a tile-start pointer `base`, or int64 where rows are gathered (pages, packed
    GQA heads)."""
    ptrs = base + (row_offs[:, None] + cols[None, :])
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
def _store_rows(base, row_offs, row_ok, cols, value, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    ptrs = base + (row_offs[:, None] + cols[None, :])
    if N_COLS == BLOCK_COLS:
        tl.store(ptrs, value, mask=row_ok[:, None])
    else:
        tl.store(ptrs, value, mask=row_ok[:, None] & (cols[None, :] < N_COLS))


@triton.jit
def _pages(kj, Nk, bt_row, page_size, num_pages):
    """(page, row in page) of keys kj of a sequence in a paged cache: row kj % page_size of page
    bt_row[kj // page_size], the page (int64) clamped into the pool of num_pages; keys kj >= Nk
    read page 0 (callers mask them)."""
    page = tl.load(bt_row + kj // page_size, mask=kj < Nk, other=0)
    page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
    return page, kj % page_size


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


# --------------------------------------------------------------------------------------------
# Scores
# --------------------------------------------------------------------------------------------
@triton.jit
def _tanh(x):
    """tanh in fp32 to a few ulps: an odd polynomial below |x| = 0.625 (Cephes' tanhf), else
    1 - 2 / (exp(2|x|) + 1) with the sign restored (no libdevice: the interpreter lacks it)."""
    ax = tl.abs(x)
    z = x * x
    small = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
             - 3.33332819422e-1) * z * x + x
    e = tl.exp2(ax * (-2.0 * 1.4426950408889634))
    large = (1.0 - e) / (1.0 + e)
    large = tl.where(x < 0, -large, large)
    return tl.where(ax < 0.625, small, large)


@triton.jit
def _scores(qk, qi, kj, key_ok, n_q, n_k, mask_ptrs, shift, win_left, win_right, slope2, qk_scale, softcap2,
            IS_CAUSAL: tl.constexpr, CHECK_BAND: tl.constexpr, WINDOW_LEFT: tl.constexpr,
            WINDOW_RIGHT: tl.constexpr, MASK_KIND: tl.constexpr, CHECK_KEYS: tl.constexpr,
            HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """(s, t): the scores of q.k products `qk` in base-2 units, -inf where query qi may not see
    key kj, and with soft-capping t = tanh(qk * qk_scale) (else qk). In the contract's order:
    s = softcap * tanh(scale * qk) (qk_scale = scale / softcap, softcap2 = softcap * log2(e)), or
    scale * qk (qk_scale = scale * log2(e)); minus slope * |qi + shift - kj| (slope2 = slope *
    log2(e)); plus a float mask; then the bool mask, the causal (top-left) and window (bottom
    right, shift = Nk - Nq + query_offset) bands where CHECK_BAND, and padding/bounds (key_ok)
    where CHECK_KEYS. qi, kj and key_ok broadcast to qk: (M, 1) and (1, N) in the forward/dQ
    layout, transposed in dK/dV. mask_ptrs: the mask's elements for the tile, read where qi < n_q
    and kj < n_k."""
    if HAS_SOFTCAP:
        t = _tanh(qk * qk_scale)
        s = t * softcap2
    else:
        t = qk
        s = qk * qk_scale
    if HAS_ALIBI:  # one rounding (fused): |s| reaches slope * the distance, ~100s far from the diagonal
        s = tl.fma(tl.abs(qi + shift - kj).to(tl.float32), -slope2, s)
    if MASK_KIND == 2:  # float mask: added (in natural-log units, hence * log2(e))
        bias = tl.load(mask_ptrs, mask=(qi < n_q) & (kj < n_k), other=0.0).to(tl.float32)
        # finfo.min (the usual "masked" fill) times log2(e) would overflow to -inf: a row of it
        # would become a row with no allowed key (output 0), where torch's softmax is uniform
        bias = tl.where((bias < -2.0e38) & (bias != float("-inf")), -2.0e38, bias)
        s = s + bias * 1.4426950408889634
    if MASK_KIND == 1:  # bool mask, True = allowed
        allowed = tl.load(mask_ptrs, mask=(qi < n_q) & (kj < n_k), other=0)
        s = tl.where(allowed != 0, s, float("-inf"))
    if CHECK_BAND:
        if IS_CAUSAL:
            s = tl.where(kj <= qi, s, float("-inf"))
        if WINDOW_LEFT:
            s = tl.where(kj >= qi + shift - win_left, s, float("-inf"))
        if WINDOW_RIGHT:
            s = tl.where(kj <= qi + shift + win_right, s, float("-inf"))
    if CHECK_KEYS:
        s = tl.where(key_ok, s, float("-inf"))
    return s, t


@triton.jit
def _dropout_keep(seed, tile_offset, mi, nj, row_stride, dropout_p):
    """True where dropout keeps P[i, j]: Philox at offset lse_index(i) * row_stride + j (row_stride
    = Nk dense, max_k packed), its 64 bits split into two 32-bit counters (the stream of
    tl.rand(seed, offset)). tile_offset is the int64 offset of the tile's first element, mi, nj
    the tile-local row and column (32-bit math)."""
    local = (mi * row_stride + nj).to(tl.uint32)
    lo = tile_offset.to(tl.uint32) + local  # wraps: carry into the high word
    hi = (tile_offset >> 32).to(tl.uint32) + (lo < local).to(tl.uint32)
    zero = lo * 0
    r, _, _, _ = tl.philox(seed, lo, hi, zero, zero)
    return tl.uint_to_uniform_float(r) >= dropout_p


# --------------------------------------------------------------------------------------------
# Sequences and tile ranges
# --------------------------------------------------------------------------------------------
@triton.jit
def _sequence(b, CuQ, CuK, SeqUsed, Nq, Nk, LAYOUT: tl.constexpr, HAS_SEQUSED: tl.constexpr):
    """(first query row, query count, first key row, key count) of sequence b. Dense (LAYOUT 0):
    (0, Nq, 0, Nk). Packed (1): from cu_seq_q/cu_seq_k (Nq, Nk: the packed row counts) and
    seqused_k. Paged (2): keys from seqused_k, Nk the cache's capacity per sequence. Offsets and
    lengths are clamped into the tensors, so inconsistent index values cannot reach outside them."""
    if LAYOUT == 0:
        q_start = b * 0
        n_q = Nq + q_start
        k_start = q_start
        n_k = Nk + q_start
    else:
        q_start = tl.minimum(tl.maximum(tl.load(CuQ + b), 0), Nq)
        n_q = tl.minimum(tl.maximum(tl.load(CuQ + b + 1), q_start), Nq) - q_start
        if LAYOUT == 1:
            k_start = tl.minimum(tl.maximum(tl.load(CuK + b), 0), Nk)
            n_k = tl.minimum(tl.maximum(tl.load(CuK + b + 1), k_start), Nk) - k_start
            if HAS_SEQUSED:
                n_k = tl.minimum(n_k, tl.maximum(tl.load(SeqUsed + b), 0))
        else:
            k_start = q_start * 0
            n_k = tl.minimum(tl.maximum(tl.load(SeqUsed + b), 0), Nk)
    return q_start, n_q, k_start, n_k


# Padding rows are scanned in blocks of this many keys (small under the interpreter, so that the
# tests' short sequences take several blocks).
PAD_SCAN_BLOCK = tl.constexpr(16 if interpreting() else 1024)


@triton.jit
def _unpadded_range(pad_base, stride_padn, start, stop):
    """[first, last + 1) of the unpadded keys in [start, stop) of a padding row (bytes, nonzero =
    padded); [start, start) where all of them are padded. (Reducing each block to scalars, rather
    than carrying PAD_SCAN_BLOCK-wide running minima through the loop, spills less: 1280 bytes
    against 3640 in the sm_90 forward with causal + padding + bool mask at head dim 128.)"""
    offs = tl.arange(0, PAD_SCAN_BLOCK)
    first = stop
    hi = start
    for begin in range(start, stop, PAD_SCAN_BLOCK):
        idx = begin + offs
        ok = tl.load(pad_base + idx * stride_padn, mask=idx < stop, other=1) == 0
        first = tl.minimum(first, tl.min(tl.where(ok, idx, stop), 0))
        hi = tl.maximum(hi, tl.max(tl.where(ok, idx + 1, start), 0))
    return tl.minimum(first, hi), hi


@triton.jit
def _aligned(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    """(lo, a, b, hi) tile-aligned from bounds lo <= hi and full_lo, full_hi (any values): tiles
    start at lo rounded down; [a, b) are the whole tiles inside [full_lo, full_hi) (clamped into
    [lo, hi]); a <= b."""
    lo = (lo // BLOCK) * BLOCK
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = tl.maximum(tl.minimum(full_hi, hi), full_lo)
    a = lo + tl.cdiv(full_lo - lo, BLOCK) * BLOCK
    b = tl.maximum(lo + ((full_hi - lo) // BLOCK) * BLOCK, a)
    return lo, a, b, hi


@triton.jit
def _key_tiles(pad_base, stride_padn, q_lo, q_hi, Nk, shift, win_left, win_right, BLOCK_N: tl.constexpr,
               IS_CAUSAL: tl.constexpr, WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
               HAS_PAD: tl.constexpr):
    """(lo, a, b, hi): the key tiles of the query rows q_lo..q_hi (inclusive) of a sequence with Nk
    keys (module doc): keys outside every row's causal and window band, and before the first or
    after the last unpadded key among the rest, are skipped; [a, b) lies inside every row's band.
    Without a left window edge a = lo: the tiles from the first unpadded key's on need no band
    check (padding is checked in every tile when there is any)."""
    hi = Nk
    if IS_CAUSAL:
        hi = tl.minimum(hi, q_hi + 1)
    if WINDOW_RIGHT:
        hi = tl.maximum(tl.minimum(hi, q_hi + shift + win_right + 1), 0)
    full_hi = hi
    if IS_CAUSAL:
        full_hi = tl.minimum(full_hi, q_lo + 1)
    if WINDOW_RIGHT:
        full_hi = tl.minimum(full_hi, q_lo + shift + win_right + 1)
    if WINDOW_LEFT:
        lo = tl.minimum(tl.maximum(q_lo + shift - win_left, 0), Nk)
        hi = tl.maximum(hi, lo)
        if HAS_PAD:  # only the keys this block may see are scanned
            lo, hi = _unpadded_range(pad_base, stride_padn, lo, hi)
            full_hi = tl.minimum(full_hi, hi)
        return _aligned(lo, q_hi + shift - win_left, full_hi, hi, BLOCK_N)
    lo = 0
    if HAS_PAD:
        first, hi = _unpadded_range(pad_base, stride_padn, 0, hi)
        lo = (first // BLOCK_N) * BLOCK_N
        full_hi = tl.minimum(full_hi, hi)
    b = tl.maximum((tl.maximum(full_hi, 0) // BLOCK_N) * BLOCK_N, lo)
    return lo, lo, b, hi


@triton.jit
def _query_tiles(start_n, last_n, Nq, shift, win_left, win_right, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr,
                 WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr):
    """(lo, a, b, hi): the query tiles that may see keys start_n..last_n (inclusive), for dK/dV:
    [a, b) see all of them. Without a left window edge b = hi = Nq: rows past the sequence's
    last query read as zeros with lse = +inf, so need no check. (Bounds that do not depend on
    the block stay literal, as the compiler then sees them.)"""
    if IS_CAUSAL or WINDOW_RIGHT or WINDOW_LEFT:
        lo = start_n * 0
        hi = Nq + lo
        full_lo = lo
        full_hi = hi
        if IS_CAUSAL:  # j <= i
            lo = tl.maximum(lo, start_n)
            full_lo = tl.maximum(full_lo, last_n)
        if WINDOW_RIGHT:  # j <= i + shift + right
            lo = tl.maximum(lo, start_n - shift - win_right)
            full_lo = tl.maximum(full_lo, last_n - shift - win_right)
        if WINDOW_LEFT:  # j >= i + shift - left
            hi = tl.minimum(hi, last_n - shift + win_left + 1)
            full_hi = tl.minimum(full_hi, start_n - shift + win_left + 1)
        lo = tl.minimum(lo, Nq)
        hi = tl.maximum(hi, lo)
        lo, a, b, hi = _aligned(lo, full_lo, full_hi, hi, BLOCK_M)
        if not WINDOW_LEFT:
            b = tl.maximum(Nq, a)
            hi = b
    else:
        lo = 0
        a = 0
        b = Nq
        hi = Nq
    return lo, a, b, hi


@triton.jit
def _split_tiles(lo, a, b, hi, split, num_splits, BLOCK: tl.constexpr):
    """(lo, a, b, hi) of split `split` of `num_splits`, each an equal share of whole tiles of
    [lo, hi) (the last ones may be empty); num_splits = 1 leaves the range as it is."""
    per = tl.cdiv(tl.cdiv(hi - lo, BLOCK), num_splits) * BLOCK
    s_lo = tl.minimum(lo + split * per, hi)
    s_end = tl.minimum(s_lo + per, hi)
    a = tl.minimum(tl.maximum(a, s_lo), s_lo + per)
    b = tl.minimum(tl.maximum(b, a), s_lo + per)
    return s_lo, a, b, s_end


@triton.jit
def _masked_tile(t, lo, a, b, BLOCK: tl.constexpr):
    """The start of the t-th tile of [lo, a) followed by [b, hi)."""
    n_left = (a - lo) // BLOCK
    return lo + t * BLOCK + (t >= n_left).to(tl.int32) * (b - a)


@triton.jit
def _masked_count(lo, a, b, hi, BLOCK: tl.constexpr):
    """How many tiles [lo, a) and [b, hi) hold together."""
    return (a - lo) // BLOCK + tl.cdiv(tl.maximum(hi - b, 0), BLOCK)
