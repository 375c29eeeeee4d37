"""Linear attention in Triton: the launchers `linear_attention_forward` and
`linear_attention_backward` with the kernel-level contract of transformer_fast/linear_attention.py,
their tile choices (`block_config`) and host-side plans. The kernels, their equations and their
precision are in kernels/linear_attention_kernels.py.

Parallelism: the causal scan runs B*H*(column tiles) programs, each sequential over N/BLOCK_N
chunks (no split over N); the non-causal passes split the rows over programs.
"""

import types

import torch

from ._grid_math import cdiv, next_power_of_2, sm_count
from ._launch import CompiledLaunch, LaunchPlan, Plans
from ._new_tensors import new_output
from ._triton_options import LAUNCH_OPTIONS, interpreting
from .linear_attention_kernels import (APPLY_DKDV, APPLY_DQ, APPLY_OUT, BWD_DK, BWD_DQ, BWD_DV, FWD_OUT,
                                       FWD_STATS, apply_kernel, causal_scan_kernel, state_kernel)

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
