"""The Triton kernels of linear attention (Katharopoulos et al. 2020) with phi(x) = elu(x) + 1;
their launchers, tile choices and host-side plans are in kernels/linear_attention.py.

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
(dV's T is dS0, dK's t is dz0), and where the forward one ends the final state. All four causal
products have the form y_i = sum_{j in W(i)} (a_i . b_j + alpha_i beta_j) c_j (see the MODE table
in the kernel).
The column dimension (c's) is tiled so the state fits registers; the contracted dimension (a,
b) is always whole, so the normaliser (contracted over D) and g (contracted over Dv) are exact
in every tile: the forward tiles over Dv, dQ and dK over D, dV over Dv. g needs the whole
dO . out, so the backward first runs the forward scan in "stats" mode, writing den and the
per-Dv-tile partial dots dO . out (summed by the consumers).

Precision: the states and every accumulation are fp32, and the carried states (T, t, z) are
summed with a compensation term (Kahan: `_add_compensated`): added to in fp32 once per chunk, a
state's rounding would grow with the sequence (its final z 2.7-6x the error of torch's summation
at 2k-8k keys), where the compensated sum's stays that of one rounding. tl.dot operands are fp32
(phi and the 1/den scaling are applied in fp32; fp16 states would overflow at long lengths). The
dot precision follows the input dtype (`_precision` in kernels/linear_attention.py): ieee for
fp32 (a GPU would otherwise use tf32 and miss the 2x-reference-error policy), tf32x3 for fp16
(tf32 truncation misses it too), tf32 for bf16. ieee dots run on FMA units and need whole operand
rows per thread, so they get their own small blocks (and still spill at head dim 256).
"""

import triton
import triton.language as tl

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
