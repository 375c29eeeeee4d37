"""Triton kernels for linear attention (Katharopoulos et al. 2020) with phi(x) = elu(x) + 1.

Notation: Q' = phi(Q), K' = phi(K) with padded keys set to 0, G = dO / den (row-wise),
g_i = -(dO_i . out_i) / den_i. The gradients (checked against _plain_torch):

    dQ'_i = sum_{j in W(i)} (G_i . v_j + g_i) K'_j        dQ = dQ' * elu'(Q)
    dK'_j = sum_{i : j in W(i)} (v_j . G_i + g_i) Q'_i    dK = dK' * elu'(K), 0 on padded keys
    dV_j  = sum_{i : j in W(i)} (Q'_i . K'_j) G_i

with W(i) all keys (non-causal) or j <= i (causal).

Non-causal: ``state_kernel`` sums a state T = sum_j X'_j^T Y_j (D x Dv) and t = sum_j X'_j u_j
(D) over a split of the rows, for (K, V) in the forward and (Q, G) in the backward; the splits'
partial states are reduced with one torch sum (no atomics), to which the initial state (forward)
or the final state's gradient (backward) is added. ``apply_kernel`` then multiplies
each block of rows by the state, looping over Dv tiles so that the normaliser phi(q).z is
computed once per row; in the backward it also accumulates dO S^T (-> dQ) or V R^T (-> dK).

Causal: ``causal_scan_kernel``, the chunked form. One program per (batch*head, column tile)
walks the sequence in chunks of BLOCK_N rows (forwards, or backwards for dK/dV), carrying the
state T (BLOCK_A x BLOCK_C, fp32) in registers; inside a chunk the masked a b^T product, across
chunks a T, so all the work is tl.dot. A carried state is where the scans start: the forward
scans (out, stats, dQ) from the initial state (S0, z0), the reverse ones (dK, dV) from the final
state's gradient (dS_F, dz_F); where the reverse scans end is the initial state's gradient
(dV's T is dS0, dK's t is dz0), and where the forward one ends the final state. All four causal products have the form
y_i = sum_{j in W(i)} (a_i . b_j + alpha_i beta_j) c_j (see the MODE table in the kernel).
The column dimension (c's) is tiled so the state fits registers; the contracted dimension (a,
b) is always whole, so the normaliser (contracted over D) and g (contracted over Dv) are exact
in every tile: the forward tiles over Dv, dQ and dK over D, dV over Dv. g needs the whole
dO . out, so the backward first runs the forward scan in "stats" mode, writing den and the
per-Dv-tile partial dots dO . out (summed by the consumers).

Precision: the states and every accumulation are fp32, and the carried states (T, t, z) are
summed with a compensation term (Kahan: `_add_compensated`): added to in fp32 once per chunk, a
state's rounding would grow with the sequence (its final z 2.7-6x the error of torch's summation
at 2k-8k keys), where the compensated sum's stays that of one rounding. tl.dot operands are fp32
(phi and the 1/den scaling are applied in fp32; fp16 states would overflow at long lengths). The dot precision
follows the input dtype (`_precision`): ieee for fp32 (a GPU would otherwise use tf32 and miss the
2x-reference-error policy), tf32x3 for fp16 (tf32 truncation misses it too), tf32 for bf16. ieee
dots run on FMA units and need whole operand rows per thread, so they get their own small blocks
(and still spill at head dim 256).

Parallelism: the causal scan runs B*H*(column tiles) programs, each sequential over N/BLOCK_N
chunks (no split over N); the non-causal passes split the rows over programs.
"""

import types

import torch
import triton
import triton.language as tl

from ._launch import CompiledLaunch, LaunchPlan, Plans
from ._utils import LAUNCH_OPTIONS, cdiv, interpreting, new_output, next_power_of_2, sm_count

# Causal scan modes.
FWD_OUT, FWD_STATS, BWD_DQ, BWD_DK, BWD_DV = (tl.constexpr(m) for m in range(5))
# Non-causal apply modes.
APPLY_OUT, APPLY_DQ, APPLY_DKDV = (tl.constexpr(m) for m in range(3))


@triton.jit
def _phi(x):
    return tl.where(x > 0, x + 1.0, tl.exp(x))


@triton.jit
def _dphi(x):
    return tl.where(x > 0, 1.0, tl.exp(x))


@triton.jit
def _load_tile(ptr, rows, cols, stride_n, row_ok, col_ok):
    """fp32 tile ptr[rows, cols]; out-of-range or masked-off elements read as 0 (never NaN)."""
    return tl.load(ptr + rows[:, None] * stride_n + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _load_phi_tile(ptr, rows, cols, stride_n, row_ok, col_ok):
    """phi of the tile, 0 outside it (phi(0) = 1 would otherwise leak padding into the sums)."""
    x = _load_tile(ptr, rows, cols, stride_n, row_ok, col_ok)
    return tl.where(row_ok[:, None] & col_ok[None, :], _phi(x), 0.0)


@triton.jit
def _add_compensated(total, comp, x):
    """total + x with Kahan's compensation: comp carries what the fp32 total's roundings lost."""
    y = x - comp
    t = total + y
    return t, (t - total) - y


@triton.jit
def _key_ok(KPM, smn, rows, row_ok, HAS_MASK: tl.constexpr):
    if HAS_MASK:
        return row_ok & (tl.load(KPM + rows * smn, mask=row_ok, other=1) == 0)
    return row_ok


@triton.jit
def _g_of_rows(DEN, P, rows, row_ok, n_ptiles, p_tile_stride):
    """den and g = -(dO . out) / den from the stats pass (P holds per-Dv-tile partial dO . out)."""
    den = tl.load(DEN + rows, mask=row_ok, other=1.0)
    p = tl.zeros_like(den)
    for t in range(0, n_ptiles):
        p += tl.load(P + t * p_tile_stride + rows, mask=row_ok, other=0.0)
    return den, -p / den


@triton.jit
def causal_scan_kernel(
    Q, K, V, DO, KPM, DEN, P, OUT, ST, SZ, FS, FZ,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn, smb, smn,
    stb, sth, sta, stc, szb, szh, szd,
    H, N, D, DV, n_ptiles, eps,
    MODE: tl.constexpr, HAS_MASK: tl.constexpr, HAS_STATE: tl.constexpr, STORE_STATE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr,
):
    """MODE   a (contracted)  b             c (column tile)  alpha  beta   scan      writes
       FWD_*  Q'   [D]        K'            V   [Dv tile]    -      -      forwards  out, or den + P
       BWD_DQ G    [Dv]       V             K'  [D tile]     g      1      forwards  dQ
       BWD_DK V    [Dv]       G             Q'  [D tile]     1      g      backwards dK
       BWD_DV K'   [D]        Q'            G   [Dv tile]    -      -      backwards dV
    y_i = sum_{j in chunk, causal} (a_i . b_j + alpha_i beta_j) c_j + a_i T + alpha_i t, then
    T += b^T c and t += beta^T c. OUT is (B, H, N, width of c) contiguous; DEN (B*H, N) and
    P (tiles, B*H, N) fp32.
    HAS_STATE: T starts from ST[b, h] read as (a, c) through the strides (sta, stc) (S0 in the
    forward modes, dS_F in the reverse ones; the launcher gives the transposed strides where a is
    Dv), t from SZ[b, h, c] (z in the forward modes from SZ[b, h, a]). STORE_STATE: FWD_OUT writes
    T, z (the final state) to FS (B*H, D, DV) and FZ (B*H, D), BWD_DV its T (dS0) to FS and BWD_DK
    its t (dz0) to FZ, all fp32."""
    REVERSE: tl.constexpr = MODE == BWD_DK or MODE == BWD_DV
    HAS_ALPHA: tl.constexpr = MODE == BWD_DQ or MODE == BWD_DK
    A_IS_D: tl.constexpr = MODE == FWD_OUT or MODE == FWD_STATS or MODE == BWD_DV
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    Q += b * sqb + h * sqh
    K += b * skb + h * skh
    V += b * svb + h * svh
    DO += b * sdb + h * sdh
    KPM += b * smb
    DEN += pid_bh * N
    P += pid_bh * N
    if A_IS_D:
        NA = D
        NC = DV
    else:
        NA = DV
        NC = D
    OUT += pid_bh * N * NC
    a_cols = tl.arange(0, BLOCK_A)
    a_ok = a_cols < NA
    c_cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c_cols < NC
    T = tl.zeros((BLOCK_A, BLOCK_C), dtype=tl.float32)
    t = tl.zeros((BLOCK_C,), dtype=tl.float32)
    z = tl.zeros((BLOCK_A,), dtype=tl.float32)  # forward only: sum of K', for the normaliser
    T_comp = tl.zeros((BLOCK_A, BLOCK_C), dtype=tl.float32)  # the compensation terms of T, t, z
    t_comp = tl.zeros((BLOCK_C,), dtype=tl.float32)
    z_comp = tl.zeros((BLOCK_A,), dtype=tl.float32)
    if HAS_STATE:
        ST += b * stb + h * sth
        SZ += b * szb + h * szh
        T = tl.load(ST + a_cols[:, None] * sta + c_cols[None, :] * stc, mask=a_ok[:, None] & c_ok[None, :],
                    other=0.0).to(tl.float32)
        if MODE == FWD_OUT or MODE == FWD_STATS:
            z = tl.load(SZ + a_cols * szd, mask=a_ok, other=0.0).to(tl.float32)
        elif HAS_ALPHA:
            t = tl.load(SZ + c_cols * szd, mask=c_ok, other=0.0).to(tl.float32)
    n_chunks = tl.cdiv(N, BLOCK_N)
    for it in range(0, n_chunks):
        if REVERSE:
            start = (n_chunks - 1 - it) * BLOCK_N
        else:
            start = it * BLOCK_N
        rows = start + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        key_ok = _key_ok(KPM, smn, rows, row_ok, HAS_MASK)
        if MODE == FWD_OUT or MODE == FWD_STATS:
            a = _load_phi_tile(Q, rows, a_cols, sqn, row_ok, a_ok)
            bb = _load_phi_tile(K, rows, a_cols, skn, key_ok, a_ok)
            c = _load_tile(V, rows, c_cols, svn, key_ok, c_ok)
        elif MODE == BWD_DQ:
            den, g = _g_of_rows(DEN, P, rows, row_ok, n_ptiles, N * tl.num_programs(0))
            a = _load_tile(DO, rows, a_cols, sdn, row_ok, a_ok) / den[:, None]
            bb = _load_tile(V, rows, a_cols, svn, key_ok, a_ok)
            c = _load_phi_tile(K, rows, c_cols, skn, key_ok, c_ok)
            alpha = g
            beta = tl.where(key_ok, 1.0, 0.0)
        elif MODE == BWD_DK:
            den, g = _g_of_rows(DEN, P, rows, row_ok, n_ptiles, N * tl.num_programs(0))
            a = _load_tile(V, rows, a_cols, svn, key_ok, a_ok)
            bb = _load_tile(DO, rows, a_cols, sdn, row_ok, a_ok) / den[:, None]
            c = _load_phi_tile(Q, rows, c_cols, sqn, row_ok, c_ok)
            alpha = tl.where(key_ok, 1.0, 0.0)
            beta = g
        else:  # BWD_DV
            den = tl.load(DEN + rows, mask=row_ok, other=1.0)
            a = _load_phi_tile(K, rows, a_cols, skn, key_ok, a_ok)
            bb = _load_phi_tile(Q, rows, a_cols, sqn, row_ok, a_ok)
            c = _load_tile(DO, rows, c_cols, sdn, row_ok, c_ok) / den[:, None]
        w = tl.dot(a, tl.trans(bb), input_precision=PRECISION)
        if HAS_ALPHA:
            w += alpha[:, None] * beta[None, :]
        offs = tl.arange(0, BLOCK_N)
        if REVERSE:
            w = tl.where(offs[:, None] <= offs[None, :], w, 0.0)
        else:
            w = tl.where(offs[:, None] >= offs[None, :], w, 0.0)
        y = tl.dot(w, c, input_precision=PRECISION) + tl.dot(a, T, input_precision=PRECISION)
        if HAS_ALPHA:
            y += alpha[:, None] * t[None, :]
            t, t_comp = _add_compensated(t, t_comp, tl.sum(beta[:, None] * c, axis=0))
        T, T_comp = _add_compensated(T, T_comp, tl.dot(tl.trans(bb), c, input_precision=PRECISION))
        out_ptrs = OUT + rows[:, None] * NC + c_cols[None, :]
        out_mask = row_ok[:, None] & c_ok[None, :]
        if MODE == FWD_OUT or MODE == FWD_STATS:
            den = tl.sum(w, axis=1) + tl.sum(a * z[None, :], axis=1) + eps
            z, z_comp = _add_compensated(z, z_comp, tl.sum(bb, axis=0))
            out = y / den[:, None]
            if MODE == FWD_OUT:
                tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=out_mask)
            else:
                dout = _load_tile(DO, rows, c_cols, sdn, row_ok, c_ok)
                tl.store(P + pid_c * N * tl.num_programs(0) + rows, tl.sum(dout * out, axis=1), mask=row_ok)
                if pid_c == 0:
                    tl.store(DEN + rows, den, mask=row_ok)
        elif MODE == BWD_DQ:
            q = _load_tile(Q, rows, c_cols, sqn, row_ok, c_ok)
            tl.store(out_ptrs, (y * _dphi(q)).to(OUT.dtype.element_ty), mask=out_mask)
        elif MODE == BWD_DK:
            k = _load_tile(K, rows, c_cols, skn, key_ok, c_ok)
            dk = tl.where(key_ok[:, None], y * _dphi(k), 0.0)
            tl.store(out_ptrs, dk.to(OUT.dtype.element_ty), mask=out_mask)
        else:
            tl.store(out_ptrs, tl.where(key_ok[:, None], y, 0.0).to(OUT.dtype.element_ty), mask=out_mask)
    if STORE_STATE:
        if MODE == FWD_OUT or MODE == BWD_DV:  # T is (D, DV tile): the final state, or dS0
            tl.store(FS + pid_bh * D * DV + a_cols[:, None] * DV + c_cols[None, :], T,
                     mask=a_ok[:, None] & c_ok[None, :])
        if MODE == FWD_OUT:
            if pid_c == 0:
                tl.store(FZ + pid_bh * D + a_cols, z, mask=a_ok)
        elif MODE == BWD_DK:  # t is the D tile of dz0
            tl.store(FZ + pid_bh * D + c_cols, t, mask=c_ok)


@triton.jit
def state_kernel(
    X, Y, KPM, DEN, G, WS_T, WS_t,
    sxb, sxh, sxn, syb, syh, syn, smb, smn,
    H, N, D, DV, chunks_per_split,
    BACKWARD: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr,
):
    """Partial states over one split of the rows: T = sum X'^T Y, t = sum X' u. Forward: X = K
    (padded keys dropped), Y = V, u = 1. Backward: X = Q, Y = G = dO / den, u = g.
    WS_T is (B*H, splits, D, DV) and WS_t (B*H, splits, D), fp32."""
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_c = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // H
    h = pid_bh % H
    X += b * sxb + h * sxh
    Y += b * syb + h * syh
    KPM += b * smb
    DEN += pid_bh * N
    G += pid_bh * N
    a_cols = tl.arange(0, BLOCK_A)
    a_ok = a_cols < D
    c_cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c_cols < DV
    T = tl.zeros((BLOCK_A, BLOCK_C), dtype=tl.float32)
    t = tl.zeros((BLOCK_A,), dtype=tl.float32)
    T_comp = tl.zeros((BLOCK_A, BLOCK_C), dtype=tl.float32)
    t_comp = tl.zeros((BLOCK_A,), dtype=tl.float32)
    for it in range(0, chunks_per_split):
        rows = (pid_s * chunks_per_split + it) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = _key_ok(KPM, smn, rows, rows < N, HAS_MASK)
        x = _load_phi_tile(X, rows, a_cols, sxn, row_ok, a_ok)
        y = _load_tile(Y, rows, c_cols, syn, row_ok, c_ok)
        if BACKWARD:
            y = y / tl.load(DEN + rows, mask=row_ok, other=1.0)[:, None]
            t, t_comp = _add_compensated(t, t_comp, tl.sum(x * tl.load(G + rows, mask=row_ok, other=0.0)[:, None],
                                                           axis=0))
        else:
            t, t_comp = _add_compensated(t, t_comp, tl.sum(x, axis=0))
        T, T_comp = _add_compensated(T, T_comp, tl.dot(tl.trans(x), y, input_precision=PRECISION))
    split = pid_bh * tl.num_programs(2) + pid_s
    tl.store(WS_T + split * D * DV + a_cols[:, None] * DV + c_cols[None, :], T, mask=a_ok[:, None] & c_ok[None, :])
    if pid_c == 0:
        tl.store(WS_t + split * D + a_cols, t, mask=a_ok)


@triton.jit
def apply_kernel(
    X, Y, KPM, S, Z, OUT, OUT2, DEN, G,
    sxb, sxh, sxn, syb, syh, syn, smb, smn,
    H, N, D, DV, eps,
    MODE: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr,
):
    """One block of rows times the full state S (B*H, D, DV), Z (B*H, D), looping over DV tiles:
    APPLY_OUT:  X = Q:       OUT = Q' S / (Q' . z + eps)
    APPLY_DQ:   X = Q, Y=dO: OUT = dQ, and DEN, G (= den, g) for the key-side state
    APPLY_DKDV: X = K, Y=V, S = R, Z = r: OUT = dV = K' R, OUT2 = dK = (V R^T + r) * elu'(K).
    OUT/OUT2 are contiguous (B, H, N, .)."""
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    X += b * sxb + h * sxh
    Y += b * syb + h * syh
    KPM += b * smb
    S += pid_bh * D * DV
    Z += pid_bh * D
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    if MODE == APPLY_DKDV:
        row_ok = _key_ok(KPM, smn, rows, row_ok, HAS_MASK)
    a_cols = tl.arange(0, BLOCK_A)
    a_ok = a_cols < D
    x = _load_phi_tile(X, rows, a_cols, sxn, row_ok, a_ok)
    z = tl.load(Z + a_cols, mask=a_ok, other=0.0)
    den = tl.sum(x * z[None, :], axis=1) + eps
    acc = tl.zeros((BLOCK_M, BLOCK_A), dtype=tl.float32)
    p = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for c0 in range(0, DV, BLOCK_C):
        c_cols = c0 + tl.arange(0, BLOCK_C)
        c_ok = c_cols < DV
        s = tl.load(S + a_cols[:, None] * DV + c_cols[None, :], mask=a_ok[:, None] & c_ok[None, :], other=0.0)
        y = tl.dot(x, s, input_precision=PRECISION)
        out_ptrs = OUT + pid_bh * N * DV + rows[:, None] * DV + c_cols[None, :]
        out_mask = (rows < N)[:, None] & c_ok[None, :]
        if MODE == APPLY_OUT:
            tl.store(out_ptrs, (y / den[:, None]).to(OUT.dtype.element_ty), mask=out_mask)
        else:
            other = _load_tile(Y, rows, c_cols, syn, row_ok, c_ok)
            if MODE == APPLY_DQ:
                p += tl.sum(other * y, axis=1)
            else:
                tl.store(out_ptrs, y.to(OUT.dtype.element_ty), mask=out_mask)
            acc += tl.dot(other, tl.trans(s), input_precision=PRECISION)
    if MODE != APPLY_OUT:
        xin = _load_tile(X, rows, a_cols, sxn, row_ok, a_ok)
        out2_ptrs = OUT2 + pid_bh * N * D + rows[:, None] * D + a_cols[None, :]
        out2_mask = (rows < N)[:, None] & a_ok[None, :]
        if MODE == APPLY_DQ:
            g = -p / (den * den)  # dO . out = (dO . num) / den
            dq = (acc / den[:, None] + g[:, None] * z[None, :]) * _dphi(xin)
            tl.store(out2_ptrs, dq.to(OUT2.dtype.element_ty), mask=out2_mask)
            tl.store(DEN + pid_bh * N + rows, den, mask=row_ok)
            tl.store(G + pid_bh * N + rows, g, mask=row_ok)
        else:
            dk = tl.where(row_ok[:, None], (acc + z[None, :]) * _dphi(xin), 0.0)
            tl.store(out2_ptrs, dk.to(OUT2.dtype.element_ty), mask=out2_mask)


# ------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------
# The largest fp32 state tile (BLOCK_A x BLOCK_C) one program keeps in registers; the column
# dimension is tiled to stay under it (tests lower it to exercise the tiling on small dims).
STATE_TILE_ELEMENTS = 4096
MAX_BLOCK_C = 64


launch_scan, launch_state, launch_apply = (CompiledLaunch(kernel)
                                         for kernel in (causal_scan_kernel, state_kernel, apply_kernel))


def block_config(na, nc, dtype):
    """(block sizes, num_warps, tl.dot precision) for a contracted width `na` (held whole) and a
    column width `nc` (tiled): the chunk shrinks as the contracted width grows, so that the
    scan's fp32 tiles (a, b: BLOCK_N x BLOCK_A; w: BLOCK_N^2; c, y: BLOCK_N x BLOCK_C; T) fit the
    registers. ieee dots run on FMA units with each thread holding whole rows of the operands:
    they get the smallest tiles; tf32x3 dots hold each operand twice (high and low parts): half
    the chunk and narrower columns."""
    block_a = max(16, next_power_of_2(na))
    precision = _precision(dtype, block_a)
    if precision == "ieee":
        block_c = max(16, min(next_power_of_2(nc), 32 if block_a <= 32 else 16))
        return dict(BLOCK_N=16, BLOCK_A=block_a, BLOCK_C=block_c), 4 if block_a <= 64 else 8, precision
    block_c = max(16, min(next_power_of_2(nc), MAX_BLOCK_C, STATE_TILE_ELEMENTS // block_a))
    block_n = 64 if block_a <= 32 else (32 if block_a <= 128 else 16)
    if precision == "tf32x3":
        block_c = min(block_c, 32)
        block_n = max(16, block_n // 2)
    elements = 2 * block_n * block_a + block_n * block_n + 2 * block_n * block_c + block_a * block_c
    num_warps = 4 if elements <= 8192 else 8
    return dict(BLOCK_N=block_n, BLOCK_A=block_a, BLOCK_C=block_c), num_warps, precision


def _precision(dtype, block_a):
    """The dots take fp32 operands (phi and the scalings are applied in fp32; the states must stay
    fp32). fp32 inputs: exact ieee dots. bf16: tf32, whose truncation to a 10-bit mantissa is far
    below bf16's own rounding. fp16: tf32's truncation error (up to 2^-10 per operand) exceeds
    twice fp16's rounding error (2^-11) on a GPU (seen on an H100: 4 ulps where the fp16
    reference makes 1), so tf32x3 (fp32-accurate products from three tf32 ones); at head dims of
    256 that spills kilobytes per thread, so ieee there."""
    if dtype == torch.float32 or (dtype == torch.float16 and block_a >= 256):
        return "ieee"
    return "tf32x3" if dtype == torch.float16 else "tf32"


def _mask_strides(key_padding_mask):
    """(stride_b, stride_n, HAS_MASK) of the bool padding mask, True = padded."""
    if key_padding_mask is None:
        return 0, 0, False
    return key_padding_mask.stride(0), key_padding_mask.stride(1), True


def _mask_bytes(key_padding_mask, dummy):
    """The padding mask as the kernels read it (bytes); `dummy` for none (never read)."""
    return dummy if key_padding_mask is None else key_padding_mask.view(torch.uint8)


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def _scan_plan(mode, q, k, v, dout, key_padding_mask, n_ptiles, eps, state=None, store=False):
    """(LaunchPlan of causal_scan_kernel, its column tiles). `state`: the (S, z) pair the scan
    starts from (see the kernel), or None; `store`: whether it writes a final (FS, FZ)."""
    B, H, N, D = q.shape
    Dv = v.shape[3]
    forward_layout = mode in (FWD_OUT, FWD_STATS, BWD_DV)  # a is D (else Dv: the state is read transposed)
    na, nc = (D, Dv) if forward_layout else (Dv, D)
    blocks, num_warps, precision = block_config(na, nc, q.dtype)
    grid = (B * H, cdiv(nc, blocks["BLOCK_C"]))
    smb, smn, has_mask = _mask_strides(key_padding_mask)
    if state is not None:
        S, z = state
        sta, stc = (S.stride(2), S.stride(3)) if forward_layout else (S.stride(3), S.stride(2))
        state_args = (S.stride(0), S.stride(1), sta, stc, z.stride(0), z.stride(1), z.stride(2))
    else:
        state_args = (0,) * 7
    plan = LaunchPlan(grid, (*_strides(q), *_strides(k), *_strides(v), *_strides(dout), smb, smn, *state_args,
                             H, N, D, Dv, n_ptiles, eps),
                      dict(MODE=mode.value, HAS_MASK=has_mask, HAS_STATE=state is not None, STORE_STATE=store,
                           PRECISION=precision, **blocks, num_warps=num_warps, num_stages=2, **LAUNCH_OPTIONS))
    return plan, grid[1]


def _scan(plan, q, k, v, dout, key_padding_mask, den, p, out, state=None, final=(None, None)):
    """Launches a _scan_plan with the call's tensors (den stands in for absent ones)."""
    S, z = (den, den) if state is None else state
    fs, fz = (den if t is None else t for t in final)
    launch_scan.run(plan, (q, k, v, dout, _mask_bytes(key_padding_mask, q), den, p, out, S, z, fs, fz))


def _num_splits(n, block_n, programs, device):
    """Splits of the rows for the state pass: enough programs to fill the GPU (2 per SM)."""
    if interpreting() or device.type != "cuda":
        target = 2 * programs  # two splits, so the tests cover the reduction (and the launch check's CPU tensors)
    else:
        target = 2 * sm_count(device)
    return max(1, min(cdiv(n, block_n), cdiv(target, programs)))


def _state_plan(x, y, key_padding_mask, backward):
    """state_kernel's LaunchPlan for (x, y) (`launch`) and its splits of the rows (`splits`), or
    None without rows."""
    B, H, N, D = x.shape
    Dv = y.shape[3]
    if N == 0:
        return None
    blocks, num_warps, precision = block_config(D, Dv, x.dtype)
    c_tiles = cdiv(Dv, blocks["BLOCK_C"])
    splits = _num_splits(N, blocks["BLOCK_N"], B * H * c_tiles, x.device)
    chunks_per_split = cdiv(cdiv(N, blocks["BLOCK_N"]), splits)
    splits = cdiv(cdiv(N, blocks["BLOCK_N"]), chunks_per_split)
    smb, smn, has_mask = _mask_strides(key_padding_mask)
    launch = LaunchPlan((B * H, c_tiles, splits),
                        (*_strides(x), *_strides(y), smb, smn, H, N, D, Dv, chunks_per_split),
                        dict(BACKWARD=backward, HAS_MASK=has_mask, PRECISION=precision, **blocks,
                             num_warps=num_warps, num_stages=2, **LAUNCH_OPTIONS))
    return types.SimpleNamespace(launch=launch, splits=splits)


def _state(plan, x, y, key_padding_mask, den, g):
    """(S, z): S = sum X'^T Y (B*H, D, Dv), z = sum X' u (B*H, D), fp32; backward if den is given."""
    B, H, N, D = x.shape
    Dv = y.shape[3]
    if plan is None:
        return (torch.zeros(B * H, D, Dv, dtype=torch.float32, device=x.device),
                torch.zeros(B * H, D, dtype=torch.float32, device=x.device))
    ws_s = torch.empty(B * H, plan.splits, D, Dv, dtype=torch.float32, device=x.device)
    ws_z = torch.empty(B * H, plan.splits, D, dtype=torch.float32, device=x.device)
    backward = den is not None
    launch_state.run(plan.launch, (x, y, _mask_bytes(key_padding_mask, x), den if backward else ws_z,
                                   g if backward else ws_z, ws_s, ws_z))
    if plan.splits == 1:
        return ws_s[:, 0], ws_z[:, 0]
    return ws_s.sum(1), ws_z.sum(1)


def _apply_plan(mode, x, y, key_padding_mask, Dv, eps):
    """apply_kernel's LaunchPlan, or None without rows."""
    B, H, N, D = x.shape
    if N == 0:
        return None
    blocks, num_warps, precision = block_config(D, Dv, x.dtype)
    block_m = blocks.pop("BLOCK_N")
    smb, smn, has_mask = _mask_strides(key_padding_mask)
    return LaunchPlan((B * H, cdiv(N, block_m)), (*_strides(x), *_strides(y), smb, smn, H, N, D, Dv, eps),
                      dict(MODE=mode.value, HAS_MASK=has_mask, PRECISION=precision, BLOCK_M=block_m, **blocks,
                           num_warps=num_warps, num_stages=2, **LAUNCH_OPTIONS))


def _apply(plan, x, y, key_padding_mask, s, z, out, out2, den, g):
    if plan is not None:
        launch_apply.run(plan, (x, y, _mask_bytes(key_padding_mask, x), s, z, out, out2, den, g))


def _plus(total, state, B, H):
    """total (B*H, ...) fp32 plus a state tensor (B, H, ...), or total where there is none."""
    return total if state is None else total + state.reshape(B * H, *state.shape[2:])


def _reverse_state(q, Dv, grad_final_S, grad_final_z):
    """Where the causal backward's reverse scans start: the final state's gradient, a zero for a
    missing half, or None without one."""
    if grad_final_S is None and grad_final_z is None:
        return None
    B, H, _, D = q.shape
    return (grad_final_S if grad_final_S is not None else q.new_zeros(B, H, D, Dv, dtype=torch.float32),
            grad_final_z if grad_final_z is not None else q.new_zeros(B, H, D, dtype=torch.float32))


def _forward_plan(q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, output_final_state):
    """linear_attention_forward's launches for one call signature (kernels/_launch.py)."""
    initial = None if initial_S is None else (initial_S, initial_z)
    if is_causal:
        return types.SimpleNamespace(scan=_scan_plan(FWD_OUT, q, k, v, q, key_padding_mask, 0, eps, initial,
                                                     bool(output_final_state))[0])
    return types.SimpleNamespace(state=_state_plan(k, v, key_padding_mask, False),
                                 apply=_apply_plan(APPLY_OUT, q, q, None, v.shape[3], eps))


def _backward_plan(dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, grad_final_S,
                   grad_final_z):
    """linear_attention_backward's launches for one call signature: `dout` as the launches read it."""
    Dv = v.shape[3]
    dout_copy = Dv > 1 and dout.stride(-1) != 1
    if dout_copy:
        dout = dout.contiguous()
    if is_causal:
        initial = None if initial_S is None else (initial_S, initial_z)
        reverse = _reverse_state(q, Dv, grad_final_S, grad_final_z)
        _, n_ptiles = _scan_plan(FWD_STATS, q, k, v, dout, key_padding_mask, 0, eps, initial)
        scan = lambda mode, state, store: _scan_plan(mode, q, k, v, dout, key_padding_mask, n_ptiles, eps,  # noqa
                                                     state, store)[0]
        return types.SimpleNamespace(
            dout_copy=dout_copy, n_ptiles=n_ptiles, stats=scan(FWD_STATS, initial, False),
            dq=scan(BWD_DQ, initial, False), dk=scan(BWD_DK, reverse, initial is not None),
            dv=scan(BWD_DV, reverse, initial is not None))
    return types.SimpleNamespace(
        dout_copy=dout_copy, state=_state_plan(k, v, key_padding_mask, False),
        apply_dq=_apply_plan(APPLY_DQ, q, dout, None, Dv, eps), reverse_state=_state_plan(q, dout, None, True),
        apply_dkdv=_apply_plan(APPLY_DKDV, k, v, key_padding_mask, Dv, eps))


_forward_plans, _backward_plans = Plans(_forward_plan), Plans(_backward_plan)


def linear_attention_forward(q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, output_final_state):
    plan = _forward_plans.get((q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, output_final_state))
    B, H, Nq, D = q.shape
    Dv = v.shape[3]
    out = new_output((B, H, Nq, Dv), q.dtype, q.device)
    if is_causal:
        initial = None if initial_S is None else (initial_S, initial_z)
        final = ((new_output((B, H, D, Dv), torch.float32, q.device), new_output((B, H, D), torch.float32, q.device))
                 if output_final_state else (None, None))
        dummy = torch.empty(1, dtype=torch.float32, device=q.device)
        _scan(plan.scan, q, k, v, q, key_padding_mask, dummy, dummy, out, initial, final)
        return (out, *final)
    s, z = _state(plan.state, k, v, key_padding_mask, None, None)
    s, z = _plus(s, initial_S, B, H), _plus(z, initial_z, B, H)
    _apply(plan.apply, q, q, None, s, z, out, out, z, z)
    if not output_final_state:
        return out, None, None
    return out, s.view(B, H, D, Dv), z.view(B, H, D)


def linear_attention_backward(dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, grad_final_S,
                              grad_final_z):
    plan = _backward_plans.get((dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z, grad_final_S,
                                grad_final_z))
    if plan.dout_copy:
        dout = dout.contiguous()
    B, H, Nq, D = q.shape
    Dv = v.shape[3]
    dq = new_output(tuple(q.shape), q.dtype, q.device)
    dk = new_output(tuple(k.shape), k.dtype, k.device)
    dv = new_output(tuple(v.shape), v.dtype, v.device)
    den = torch.empty(B * H, Nq, dtype=torch.float32, device=q.device)
    has_initial = initial_S is not None
    if is_causal:
        initial = (initial_S, initial_z) if has_initial else None
        reverse = _reverse_state(q, Dv, grad_final_S, grad_final_z)
        dS0 = new_output((B, H, D, Dv), torch.float32, q.device) if has_initial else None
        dz0 = new_output((B, H, D), torch.float32, q.device) if has_initial else None
        p = torch.empty(plan.n_ptiles, B * H, Nq, dtype=torch.float32, device=q.device)
        _scan(plan.stats, q, k, v, dout, key_padding_mask, den, p, den, initial)
        _scan(plan.dq, q, k, v, dout, key_padding_mask, den, p, dq, initial)
        _scan(plan.dk, q, k, v, dout, key_padding_mask, den, p, dk, reverse, (None, dz0))
        _scan(plan.dv, q, k, v, dout, key_padding_mask, den, p, dv, reverse, (dS0, None))
        return dq, dk, dv, dS0, dz0
    g = torch.empty(B * H, Nq, dtype=torch.float32, device=q.device)
    s, z = _state(plan.state, k, v, key_padding_mask, None, None)
    s, z = _plus(s, initial_S, B, H), _plus(z, initial_z, B, H)
    _apply(plan.apply_dq, q, dout, None, s, z, dq, dq, den, g)
    r_state, r = _state(plan.reverse_state, q, dout, None, den, g)
    r_state, r = _plus(r_state, grad_final_S, B, H), _plus(r, grad_final_z, B, H)
    _apply(plan.apply_dkdv, k, v, key_padding_mask, r_state, r, dv, dk, den, g)
    if not has_initial:
        return dq, dk, dv, None, None
    return dq, dk, dv, r_state.view(B, H, D, Dv), r.view(B, H, D)
