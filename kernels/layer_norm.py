"""LayerNorm / RMSNorm with the residual add fused in: Triton forward and backward kernels.

Kernel-level contract: transformer_fast/layer_norm.py. Rows up to MAX_TILE wide are one tile
(several rows per program when narrow) kept in registers; wider rows loop over tiles of
LOOP_TILE columns, gathering the statistics with Chan's merge of per-tile (mean, M2). Both take
the statistics of h minus the row's first element, so a large common offset costs no precision.
The backward gives each program a contiguous range of rows, accumulates its weight/bias gradient
partial sums in float32 and writes one row of a (programs, N) buffer; one more kernel sums that
buffer's columns into dweight and dbias in their dtypes. Only mean and rstd are saved.
"""
import types

import torch
import triton
import triton.language as tl

from ._grid_math import cdiv, next_power_of_2, sm_count
from ._launch import CompiledLaunch, LaunchPlan, Plans
from ._new_tensors import contiguous, new_output, new_scratch
from ._triton_options import LAUNCH_OPTIONS, interpreting

MAX_TILE = 8192   # widest row kept whole in registers
LOOP_TILE = 4096  # columns per step for wider rows
MIN_TILE = 16     # narrower rows are padded to this many columns
ROW_TILE = 4096   # elements per forward program for narrow rows (BLOCK_M * BLOCK_N)
# The single-tile backward's (elements per step, warps, programs per SM) by padded row width:
# the best of 45 choices on an H100 (bf16, weight and bias; within 2% of each width's best,
# git show e4a4db1:benchmarks/results/cuda-h100-layer-norm-bwd-sweep-2026-11-26.txt). Each program
# walks its rows one step at a time, so the loads in flight per SM set the speed: few warps, each
# thread holding 16-64 elements of a step, ran 1.2-5.0x faster than 8 warps on 2048-element steps.
# Width 1024 takes 2 programs per SM, not the first sweep's 8: in a second sweep 8 ran 1.27-1.78x
# slower at 16K-64K rows, 2 stayed within 6% of the best in both
# (git show e4a4db1:benchmarks/results/cuda-h100-layer-norm-bwd-sweep-2026-11-27.txt).
BWD_TILES = {1024: (4096, 4, 2), 2048: (8192, 4, 2), 4096: (4096, 8, 2), 8192: (8192, 16, 1)}
BWD_NARROW_TILE = (8192, 4, 2)  # rows up to 512 wide


@triton.jit
def layer_norm_fwd_kernel(X, R, W, B, Y, H, Mean, Rstd,
                          stride_x, stride_r, stride_y, stride_h, M, N, eps,
                          HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          IS_RMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          SINGLE_TILE: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    if SINGLE_TILE:
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)
        mask = row_mask[:, None] & (cols[None, :] < N)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h = (x + r).to(H.dtype.element_ty)  # rounded as torch's x + r
            tl.store(H + rows64[:, None] * stride_h + cols[None, :], h, mask=mask)
            x = h.to(tl.float32)
        if IS_RMS:
            xc = x
        else:
            # Statistics of h - (the row's first element), as in the tiled path below: a plain
            # fp32 sum of a row whose mean is far larger than its spread loses the spread's bits.
            shift = tl.load(X + rows64 * stride_x, mask=row_mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r0 = tl.load(R + rows64 * stride_r, mask=row_mask, other=0.0).to(tl.float32)
                shift = (shift + r0).to(H.dtype.element_ty).to(tl.float32)
            x = tl.where(mask, x - shift[:, None], 0.0)
            mean = tl.sum(x, axis=1) / N
            tl.store(Mean + rows, shift + mean, mask=row_mask)
            xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
        tl.store(Rstd + rows, rstd, mask=row_mask)
        y = xc * rstd[:, None]
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
            y = y * w[None, :]
        if HAS_BIAS:
            b = tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)
            y = y + b[None, :]
        tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # One row, in tiles: pass 1 writes h and merges per-tile moments of h - shift (shift =
        # the row's first element, so a large common offset costs no precision), pass 2 writes y.
        row = pid.to(tl.int64)
        shift = 0.0
        if not IS_RMS:
            shift = tl.load(X + row * stride_x).to(tl.float32)
            if HAS_RESIDUAL:
                shift = (shift + tl.load(R + row * stride_r).to(tl.float32)).to(H.dtype.element_ty).to(tl.float32)
        count = 0.0
        mean = 0.0  # of h - shift
        m2 = 0.0
        for start in range(0, N, BLOCK_N):
            c = start + cols
            cmask = c < N
            x = tl.load(X + row * stride_x + c, mask=cmask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(R + row * stride_r + c, mask=cmask, other=0.0).to(tl.float32)
                h = (x + r).to(H.dtype.element_ty)
                tl.store(H + row * stride_h + c, h, mask=cmask)
                x = h.to(tl.float32)
            if IS_RMS:
                m2 += tl.sum(x * x, axis=0)
            else:
                x = tl.where(cmask, x - shift, 0.0)
                n_tile = tl.minimum(N - start, BLOCK_N).to(tl.float32)
                tile_mean = tl.sum(x, axis=0) / n_tile
                d = tl.where(cmask, x - tile_mean, 0.0)
                tile_m2 = tl.sum(d * d, axis=0)
                total = count + n_tile
                delta = tile_mean - mean
                mean += delta * (n_tile / total)
                m2 += tile_m2 + delta * delta * (count * n_tile / total)
                count = total
        rstd = 1.0 / tl.sqrt(m2 / N + eps)
        if not IS_RMS:
            tl.store(Mean + row, shift + mean)
        tl.store(Rstd + row, rstd)
        if HAS_RESIDUAL:
            tl.debug_barrier()  # pass 2 re-reads h, written by other threads of this program
        for start in range(0, N, BLOCK_N):
            c = start + cols
            cmask = c < N
            if HAS_RESIDUAL:
                x = tl.load(H + row * stride_h + c, mask=cmask, other=0.0).to(tl.float32)
            else:
                x = tl.load(X + row * stride_x + c, mask=cmask, other=0.0).to(tl.float32)
            y = ((x - shift) - mean) * rstd
            if HAS_WEIGHT:
                y = y * tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y = y + tl.load(B + c, mask=cmask, other=0.0).to(tl.float32)
            tl.store(Y + row * stride_y + c, y.to(Y.dtype.element_ty), mask=cmask)


@triton.jit
def layer_norm_bwd_kernel(DY, DH, Hin, W, Mean, Rstd, DX, DWPartial, DBPartial,
                          stride_dy, stride_dh, stride_h, stride_dx, M, N, rows_per_program,
                          HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                          IS_RMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          SINGLE_TILE: tl.constexpr):
    """dx = rstd * (g - xhat * mean(g * xhat) - mean(g)) (+ dh), g = dy * weight; the mean(g)
    term is absent for RMSNorm. Program `pid` owns rows [pid * rows_per_program, ...) and row
    `pid` of the partial-sum buffers (zero-initialised, N wide)."""
    pid = tl.program_id(0)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    cols = tl.arange(0, BLOCK_N)
    partial_row = pid.to(tl.int64) * N
    if SINGLE_TILE:
        col_mask = cols < N
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(row_start, row_end, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            row_mask = rows < row_end
            rows64 = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h = tl.load(Hin + rows64[:, None] * stride_h + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
            if IS_RMS:
                xhat = h * rstd[:, None]
            else:
                mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
                xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
            g = dy * w[None, :] if HAS_WEIGHT else dy
            dx = g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None]
            if not IS_RMS:
                dx -= (tl.sum(g, axis=1) / N)[:, None]
            dx *= rstd[:, None]
            if HAS_DH:
                dx += tl.load(DH + rows64[:, None] * stride_dh + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if HAS_WEIGHT:
                dw += tl.sum(dy * xhat, axis=0)
            if HAS_BIAS:
                db += tl.sum(dy, axis=0)
        if HAS_WEIGHT:
            tl.store(DWPartial + partial_row + cols, dw, mask=col_mask)
        if HAS_BIAS:
            tl.store(DBPartial + partial_row + cols, db, mask=col_mask)
    else:
        # One row at a time, in tiles: pass 1 gathers the row sums and adds this row's
        # weight/bias gradient into the program's partial row; pass 2 writes dx.
        for row_i in range(row_start, row_end):
            row = tl.cast(row_i, tl.int64)
            rstd = tl.load(Rstd + row)
            if IS_RMS:
                mean = 0.0
            else:
                mean = tl.load(Mean + row)
            sum_g = 0.0
            sum_gx = 0.0
            for start in range(0, N, BLOCK_N):
                c = start + cols
                cmask = c < N
                dy = tl.load(DY + row * stride_dy + c, mask=cmask, other=0.0).to(tl.float32)
                h = tl.load(Hin + row * stride_h + c, mask=cmask, other=0.0).to(tl.float32)
                xhat = tl.where(cmask, (h - mean) * rstd, 0.0)
                if HAS_WEIGHT:
                    g = dy * tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)
                    dwp = DWPartial + partial_row + c
                    tl.store(dwp, tl.load(dwp, mask=cmask, other=0.0) + dy * xhat, mask=cmask)
                else:
                    g = dy
                if HAS_BIAS:
                    dbp = DBPartial + partial_row + c
                    tl.store(dbp, tl.load(dbp, mask=cmask, other=0.0) + dy, mask=cmask)
                sum_g += tl.sum(g, axis=0)
                sum_gx += tl.sum(g * xhat, axis=0)
            c_gx = sum_gx / N
            c_g = sum_g / N
            for start in range(0, N, BLOCK_N):
                c = start + cols
                cmask = c < N
                dy = tl.load(DY + row * stride_dy + c, mask=cmask, other=0.0).to(tl.float32)
                h = tl.load(Hin + row * stride_h + c, mask=cmask, other=0.0).to(tl.float32)
                xhat = (h - mean) * rstd
                if HAS_WEIGHT:
                    g = dy * tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)
                else:
                    g = dy
                dx = g - xhat * c_gx
                if not IS_RMS:
                    dx -= c_g
                dx *= rstd
                if HAS_DH:
                    dx += tl.load(DH + row * stride_dh + c, mask=cmask, other=0.0).to(tl.float32)
                tl.store(DX + row * stride_dx + c, dx.to(DX.dtype.element_ty), mask=cmask)


@triton.jit
def layer_norm_partial_sums_kernel(DWPartial, DBPartial, DW, DB, programs, N, HAS_WEIGHT: tl.constexpr,
                                   HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """dweight and dbias: the column sums of the backward's (programs, N) float32 partial sums,
    written in their parameters' dtypes (one launch for both, where torch would take a sum and a
    cast for each)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < programs)[:, None] & col_mask[None, :]
        offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        if HAS_WEIGHT:
            dw += tl.sum(tl.load(DWPartial + offsets, mask=mask, other=0.0), axis=0)
        if HAS_BIAS:
            db += tl.sum(tl.load(DBPartial + offsets, mask=mask, other=0.0), axis=0)
    if HAS_WEIGHT:
        tl.store(DW + cols, dw.to(DW.dtype.element_ty), mask=col_mask)
    if HAS_BIAS:
        tl.store(DB + cols, db.to(DB.dtype.element_ty), mask=col_mask)


# ------------------------------------------------------------------------------------------------
# Launchers
# ------------------------------------------------------------------------------------------------
launch_fwd, launch_bwd = CompiledLaunch(layer_norm_fwd_kernel), CompiledLaunch(layer_norm_bwd_kernel)
launch_partial_sums = CompiledLaunch(layer_norm_partial_sums_kernel)
# The partial sums' reduction: columns per program, partial rows per step, warps
SUMS_TILE = (64, 32, 4)


def row_tiles(N, backward=False):
    """(BLOCK_M, BLOCK_N, SINGLE_TILE, num_warps) for rows of width N: a pure function of N, so
    the compile check can list every config."""
    if N > MAX_TILE:
        return 1, LOOP_TILE, False, 8
    block_n = max(MIN_TILE, next_power_of_2(N))
    if backward:
        step, warps, _ = BWD_TILES.get(block_n, BWD_NARROW_TILE)
        return max(1, step // block_n), block_n, True, warps
    block_m = max(1, ROW_TILE // block_n)
    return block_m, block_n, True, max(1, min(8, block_m * block_n // 512))


def backward_programs(block_n, single, device):
    """How many programs the backward of row_tiles' (.., block_n, single, ..) spreads its rows
    over (each writes one partial-sum row)."""
    if interpreting() or device.type != "cuda":
        return 4
    return (BWD_TILES.get(block_n, BWD_NARROW_TILE)[2] if single else 2) * sm_count(device)


def all_row_tiles(backward):
    """row_tiles of every width class (powers of two from MIN_TILE to MAX_TILE, and wider)."""
    widths = [MIN_TILE << i for i in range((MAX_TILE // MIN_TILE).bit_length())] + [MAX_TILE + 1]
    return [row_tiles(n, backward) for n in widths]


def _check_rows(name, t, M, N, dtype, device):
    if t.dim() != 2 or tuple(t.shape) != (M, N):
        raise ValueError(f"layer_norm: {name} must have shape {(M, N)}, got {tuple(t.shape)}")
    if t.dtype != dtype or t.device != device:
        raise TypeError(f"layer_norm: {name} must be {dtype} on {device}, got {t.dtype} on {t.device}")
    if M > 0 and N > 1 and t.stride(1) != 1:  # without rows nothing is read
        raise ValueError(f"layer_norm: {name} must have unit stride along the row, got strides {t.stride()}")


def _check_vector(name, t, N):
    if t is not None and tuple(t.shape) != (N,):
        raise ValueError(f"layer_norm: {name} must have shape {(N,)}, got {tuple(t.shape)}")


def _vector(t, dummy):
    """weight or bias as the kernels read it: N elements at unit stride, in its own dtype (the
    kernels widen it to float32 as they load it: no conversion launched per call); `dummy` for None."""
    if t is None:
        return dummy
    return t if t.is_contiguous() else contiguous(t)


def _forward_plan(x, residual, weight, bias, eps, is_rms):
    """layer_norm_forward's launch for one call signature (kernels/_launch.py), after its checks."""
    if x.dim() != 2:
        raise ValueError(f"layer_norm: x must be 2-D (rows, width), got shape {tuple(x.shape)}")
    M, N = x.shape
    _check_rows("x", x, M, N, x.dtype, x.device)
    if residual is not None:
        _check_rows("residual", residual, M, N, x.dtype, x.device)
    if is_rms and bias is not None:
        raise ValueError("layer_norm: RMSNorm takes no bias")
    _check_vector("weight", weight, N)
    _check_vector("bias", bias, N)
    if M == 0:
        return None
    block_m, block_n, single, warps = row_tiles(N)
    # x stands in for an absent residual and h: never read or written
    r_stride = x.stride(0) if residual is None else residual.stride(0)
    h_stride = x.stride(0) if residual is None else max(N, 1)
    return LaunchPlan((cdiv(M, block_m),), (x.stride(0), r_stride, max(N, 1), h_stride, M, N, float(eps)),
                      dict(HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                           IS_RMS=bool(is_rms), BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_TILE=single, num_warps=warps,
                           **LAUNCH_OPTIONS))


_forward_plans = Plans(_forward_plan)


def layer_norm_forward(x, residual, weight, bias, eps, is_rms):
    plan = _forward_plans.get((x, residual, weight, bias, eps, is_rms))
    M, N = x.shape
    y = new_output((M, N), x.dtype, x.device)
    h = new_output((M, N), x.dtype, x.device) if residual is not None else None
    mean = None if is_rms else new_output((M,), torch.float32, x.device)
    rstd = new_output((M,), torch.float32, x.device)
    if plan is None:
        return y, h, mean, rstd
    dummy = x  # stands in for absent pointers; never read (the matching constexpr flag is off)
    launch_fwd.run(plan, (x, dummy if residual is None else residual, _vector(weight, dummy), _vector(bias, dummy), y,
                          dummy if h is None else h, dummy if mean is None else mean, rstd))
    return y, h, mean, rstd


def _backward_plan(dy, dh, h, weight, bias, mean, rstd, eps, is_rms):
    """layer_norm_backward's launch for one call signature, after its checks, with its partial sums'
    shape and how they are allocated."""
    if h.dim() != 2:
        raise ValueError(f"layer_norm: h must be 2-D (rows, width), got shape {tuple(h.shape)}")
    M, N = h.shape
    _check_rows("h", h, M, N, h.dtype, h.device)
    _check_rows("dy", dy, M, N, h.dtype, h.device)
    if dh is not None:
        _check_rows("dh", dh, M, N, h.dtype, h.device)
    if not is_rms and mean is None:
        raise ValueError("layer_norm: the LayerNorm backward needs mean")
    _check_vector("weight", weight, N)
    _check_vector("bias", bias, N)
    block_m, block_n, single, warps = row_tiles(N, backward=True)
    rows_per_program = cdiv(M, backward_programs(block_n, single, h.device))
    if single:
        rows_per_program = cdiv(rows_per_program, block_m) * block_m
    programs = max(1, cdiv(M, rows_per_program))
    stride_dh = h.stride(0) if dh is None else dh.stride(0)  # h stands in for an absent dh: never read
    launch = LaunchPlan((programs,), (dy.stride(0), stride_dh, h.stride(0), max(N, 1), M, N, rows_per_program),
                        dict(HAS_DH=dh is not None, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                             IS_RMS=bool(is_rms), BLOCK_M=block_m, BLOCK_N=block_n, SINGLE_TILE=single,
                             num_warps=warps, **LAUNCH_OPTIONS))
    block_cols, block_p, sum_warps = SUMS_TILE
    sums = LaunchPlan((cdiv(N, block_cols),), (programs, N),
                      dict(HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_P=block_p,
                           BLOCK_N=block_cols, num_warps=sum_warps, **LAUNCH_OPTIONS))
    # Partial sums: the single-tile kernel writes its whole row; the looped one accumulates into it.
    return types.SimpleNamespace(launch=launch, sums=sums, partial_shape=(programs, N), zero_partials=not single)


_backward_plans = Plans(_backward_plan)


def layer_norm_backward(dy, dh, h, weight, bias, mean, rstd, eps, is_rms):
    plan = _backward_plans.get((dy, dh, h, weight, bias, mean, rstd, eps, is_rms))
    rstd = contiguous(rstd)
    mean = rstd if is_rms else contiguous(mean)
    dx = new_output(h.shape, h.dtype, h.device)
    dw_partial = None if weight is None else new_scratch(plan.partial_shape, torch.float32, h.device,
                                                         zero=plan.zero_partials)
    db_partial = None if bias is None else new_scratch(plan.partial_shape, torch.float32, h.device,
                                                       zero=plan.zero_partials)
    dummy = h
    launch_bwd.run(plan.launch, (dy, dummy if dh is None else dh, h, _vector(weight, dummy), mean, rstd, dx,
                                 dummy if dw_partial is None else dw_partial,
                                 dummy if db_partial is None else db_partial))
    if weight is None and bias is None:
        return dx, None, None
    dweight = None if weight is None else new_output(weight.shape, weight.dtype, weight.device)
    dbias = None if bias is None else new_output(bias.shape, bias.dtype, bias.device)
    launch_partial_sums.run(plan.sums, (dummy if dw_partial is None else dw_partial,
                                        dummy if db_partial is None else db_partial,
                                        dummy if dweight is None else dweight, dummy if dbias is None else dbias))
    return dx, dweight, dbias
