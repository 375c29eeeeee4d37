"""Tile sweep for the Triton attention kernels on one GPU.

    python -m benchmarks.tools.sweep_attention_tiles_gpu [--n 4096] [--head-dims 64 128] [--jobs 12]
        [--kernels fwd dkdv dq]

Times every candidate (BLOCK_M, BLOCK_N, num_warps, num_stages) of the forward, the dK/dV and the
dQ kernel directly (no autotuner), for bf16, causal and not, B * N = 16k tokens, H * D = 2048, and
prints each one's time, registers and spills, and its largest relative difference from the first
candidate's output, dK/dV or dQ (a wrong tile shows up there). The candidates are compiled first in
`--jobs` worker processes (Triton compiles one kernel at a time per process; the workers fill
Triton's on-disk cache, the timing process then loads from it). The bf16/fp16 backward tile
tables in kernels/attention_tiles.py were chosen from its output (docs/attention.md, "Tiles"); the
forward's candidates are its table's and larger tiles that the table leaves out for spills with
masks (with no mask they may not spill).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp

import torch

from transformer_fast._attention_call import AttentionForwardCall

FWD_CANDIDATES = [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (128, 128, 8, 3), (128, 128, 8, 2),
                  (128, 64, 8, 4), (128, 64, 8, 2), (64, 128, 4, 3), (64, 64, 4, 4), (128, 32, 4, 3)]
DKDV_CANDIDATES = [(64, 64, 8, 2), (32, 64, 8, 2), (32, 128, 8, 2), (32, 128, 8, 3), (32, 128, 4, 3),
                   (64, 128, 8, 2), (16, 128, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2)]
DQ_CANDIDATES = [(64, 64, 8, 2), (32, 64, 8, 2), (128, 32, 8, 2), (128, 32, 4, 3), (128, 64, 8, 2),
                 (64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3), (64, 64, 4, 2)]


def _inputs(B, H, N, D, dtype, causal, device="cuda"):
    from transformer_fast.kernels import attention as ka

    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, N, D, device=device, dtype=dtype) for _ in range(4))
    scale = D ** -0.5
    out, lse = ka.attention_forward(AttentionForwardCall(q, k, v, None, None, causal, scale, 0.0, None))
    delta = (out.float() * dout.float()).sum(-1)
    return q, k, v, dout, lse, delta, scale


def _launch_fwd(tile, q, k, v, scale, causal):
    """One launch of the bare JIT forward kernel with an explicit tile, planned as
    kernels/attention.py's attention_forward plans it; returns ((out,), compiled)."""
    from transformer_fast.kernels import attention as ka
    from transformer_fast.kernels.compile_cases import jit_function

    plan = ka._forward_plan(*AttentionForwardCall(q, k, v, None, None, causal, scale, 0.0, None))
    assert plan.splits == 1, "the sweep's shapes run the forward unsplit"
    out, lse = torch.empty_like(q), torch.empty(plan.lse_shape, device=q.device, dtype=torch.float32)
    block_m, block_n, warps, stages = tile
    kwargs = {**plan.forward.kwargs, "BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": warps,
              "num_stages": stages}
    tensors = (q, k, v, out, lse, q, q, q, q, q, q, q, q, out, lse)  # q stands in for what is absent
    compiled = jit_function(ka.attention_fwd_kernel)[plan.forward.grid(kwargs)](*plan.forward.args(tensors, 0),
                                                                               **kwargs)
    return (out,), compiled


def _launch(kernel_name, tile, q, k, v, dout, lse, delta, scale, causal):
    """One launch of the bare JIT kernel with an explicit tile; returns (result tensors, compiled)."""
    import triton

    from transformer_fast.kernels import attention as ka
    from transformer_fast.kernels.compile_cases import jit_function

    if kernel_name == "fwd":
        return _launch_fwd(tile, q, k, v, scale, causal)
    B, H, N, D = q.shape
    a = ka.backward_launch_args(dout, q, k, v, lse, None, None, causal, scale, 0.0, 0)
    block_m, block_n, warps, stages = tile
    tune = dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **ka.LAUNCH_OPTIONS)
    q_s, k_s, v_s, do_s, lse_s = a["strides"]
    mask = pad = alibi = cu_q = cu_k = q  # stand-ins for absent masks, slopes and offsets (never read)
    if kernel_name == "dkdv":
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        fn = jit_function(ka.attention_bwd_dkdv_kernel)
        unit = (H * N, N, 1)  # the gradients' strides, in rows of the head dim
        compiled = fn[(triton.cdiv(N, block_n), H, B)](
            q, k, v, dout, lse, delta, dk, dv, mask, pad, alibi, cu_q, cu_k, *q_s, *k_s, *v_s, *do_s, *lse_s, *unit,
            *unit, *a["mask_strides"], *a["scalars"], **a["meta"], **tune)
        return (dk, dv), compiled
    dq = torch.empty_like(q)
    fn = jit_function(ka.attention_bwd_dq_kernel)
    compiled = fn[(triton.cdiv(N, block_m), H, B)](
        q, k, v, dout, lse, delta, dq, dq, mask, pad, alibi, cu_q, cu_k, *q_s, *k_s, *v_s, *do_s, *lse_s,
        H * N, N, 1, *a["mask_strides"], *a["scalars"], **a["meta"], STORE_DS=False, **tune)
    return (dq,), compiled


CANDIDATES = {"fwd": FWD_CANDIDATES, "dkdv": DKDV_CANDIDATES, "dq": DQ_CANDIDATES}


def _compile_worker(jobs):
    for D, causal, kernel_name, tile in jobs:
        inputs = _inputs(1, 2, 256, D, torch.bfloat16, causal)
        try:
            _launch(kernel_name, tile, *inputs, causal)
        except Exception as exc:  # noqa: BLE001 - reported again (and timed as failed) by the parent
            print(f"compile failed: D={D} causal={causal} {kernel_name} {tile}: {exc}", flush=True)
    torch.cuda.synchronize()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.sweep_attention_tiles_gpu", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--jobs", type=int, default=12)
    p.add_argument("--kernels", nargs="+", default=["dkdv", "dq"], choices=sorted(CANDIDATES))
    args = p.parse_args(argv)
    from triton.testing import do_bench

    plan = [(D, causal, name, tile) for D in args.head_dims for causal in (False, True)
            for name in args.kernels for tile in CANDIDATES[name]]
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.jobs) as pool:
        pool.map(_compile_worker, [plan[i::args.jobs] for i in range(args.jobs)])

    N = args.n
    for D in args.head_dims:
        B, H = max(1, 16384 // N), max(1, 2048 // D)
        for causal in (False, True):
            inputs = _inputs(B, H, N, D, torch.bfloat16, causal)
            for name in args.kernels:
                tiles, first = CANDIDATES[name], None
                for tile in tiles:
                    try:
                        result, compiled = _launch(name, tile, *inputs, causal)
                        ms = do_bench(lambda: _launch(name, tile, *inputs, causal), warmup=10, rep=50,
                                      return_mode="median")
                    except Exception as exc:  # noqa: BLE001
                        print(f"D={D} causal={int(causal)} {name:4} {tile}: failed: {str(exc)[:120]}", flush=True)
                        continue
                    if first is None:
                        first = result
                    diff = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                               for a, b in zip(result, first))
                    print(f"D={D} causal={int(causal)} {name:4} m{tile[0]:<3} n{tile[1]:<3} w{tile[2]} s{tile[3]}: "
                          f"{ms:7.3f} ms  regs {compiled.n_regs:3} spills {compiled.n_spills:4}  "
                          f"diff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
