"""target_gpu_attention: the Triton attention against torch's SDPA on one GPU.

The grid of the GPU performance target: forward and forward+backward, causal and not, bf16 and
fp16, head dims 64 and 128, N = 1k ... 16k. Batch and heads follow the FlashAttention papers'
convention: B * N = 16k tokens and H * D = 2048, so every case does about the same work per
token. Each case:

1. checks our output and gradients against torch's on the same inputs (relative Frobenius
   error; both are compared with a float64 reference on 16 query rows of one head as well);
2. times torch (`F.scaled_dot_product_attention` left to choose its backend, as models call it:
   cuDNN attention on an H100 with torch 2.11; `--sdpa-backend flash` pins FlashAttention-2) and ours
   alternately, `--rounds` times, each with `triton.testing.do_bench` (median, L2 flushed),
   after a warm-up that includes our autotuning;
3. reports the median of the per-round ratios (torch time / our time, > 1 = we are faster) and
   both TFLOP/s, against the bf16/fp16 matrix-product rate measured in the same run (8192^3 on
   random data).

FLOPs are counted as FlashAttention does: 4 B H N^2 D for the forward (half when causal), 2.5x
that for the backward, whatever the kernels actually execute (our backward recomputes the
scores in two kernels, so it executes 7 tile products where FlashAttention-2 executes 5).
`--attention-backend cpp` times the C++ backend's CUDA kernels (the fallback for GPUs without
Triton) instead.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.attention
import torch.nn.functional as F

import transformer_fast as tf


# --sdpa-backend: torch's own choice (None), or one backend pinned
SDPA_BACKENDS = {"default": None, "flash": [torch.nn.attention.SDPBackend.FLASH_ATTENTION],
                 "cudnn": [torch.nn.attention.SDPBackend.CUDNN_ATTENTION],
                 "efficient": [torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]}


def _do_bench(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3


def matmul_rate(dtype, n=8192):
    """FLOP/s of an n^3 matrix product in `dtype` on random data (best of a few medians)."""
    a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
    c = torch.empty(n, n, device="cuda", dtype=dtype)
    seconds = min(_do_bench(lambda: torch.mm(a, b, out=c)) for _ in range(3))
    return 2.0 * n**3 / seconds


def attention_flops(B, H, N, D, causal, passes):
    fwd = 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)
    return fwd if passes == "fwd" else 3.5 * fwd


def _rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _reference_rows(q, k, v, causal, rows):
    """float64 output and dq for a few query rows of head (0, 0); dk, dv are not row-local."""
    q0, k0, v0 = (t[0, 0].double() for t in (q, k, v))
    s = q0[rows] @ k0.T / q0.shape[-1] ** 0.5
    if causal:
        s = s.masked_fill(torch.arange(k0.shape[0], device=s.device)[None, :] > rows[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v0


def check_case(ours, theirs, q, k, v, dout, causal):
    """Relative errors of ours and torch's output against float64 on 16 rows, and of ours against
    torch's output and gradients."""
    qs, ks, vs = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    qt, kt, vt = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = ours(qs, ks, vs)
    ref_out = theirs(qt, kt, vt)
    grads = torch.autograd.grad(out, (qs, ks, vs), dout)
    ref_grads = torch.autograd.grad(ref_out, (qt, kt, vt), dout)
    N = q.shape[2]
    rows = torch.unique(torch.cat([torch.tensor([0, N - 1], device=q.device),
                                   torch.randint(0, N, (14,), device=q.device)]))
    exact = _reference_rows(q, k, v, causal, rows)
    result = {
        "ours_vs_fp64_rows": _rel_err(out[0, 0, rows], exact),
        "torch_vs_fp64_rows": _rel_err(ref_out[0, 0, rows], exact),
        "out_vs_torch": _rel_err(out, ref_out),
        **{f"d{n}_vs_torch": _rel_err(g, rg) for n, g, rg in zip("qkv", grads, ref_grads)},
        "finite": bool(all(torch.isfinite(t).all() for t in (out, *grads))),
    }
    return result


def time_pair(torch_fn, ours_fn, rounds):
    """Median times and the median of the per-round ratios torch / ours (alternating order)."""
    torch_fn(), ours_fn()  # warm-up (our autotuning happens here)
    t_torch, t_ours, ratios = [], [], []
    for r in range(rounds):
        if r % 2:
            a = _do_bench(torch_fn)
            b = _do_bench(ours_fn)
        else:
            b = _do_bench(ours_fn)
            a = _do_bench(torch_fn)
        t_torch.append(a)
        t_ours.append(b)
        ratios.append(a / b)
    return statistics.median(t_torch), statistics.median(t_ours), statistics.median(ratios)


def run_case(dtype, D, N, causal, passes, args):
    B, H = max(1, args.tokens // N), max(1, args.hidden // D)
    q, k, v, dout = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(4))

    def ours(q, k, v):
        return tf.scaled_dot_product_attention(q, k, v, is_causal=causal, backend=args.backend)

    backends = SDPA_BACKENDS[args.sdpa_backend]

    def theirs(q, k, v):
        if backends is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with torch.nn.attention.sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    # once per shape (the check covers the output and all three gradients)
    check = check_case(ours, theirs, q, k, v, dout, causal) if passes == args.passes[0] else None
    if passes == "fwd":
        torch_fn, ours_fn = (lambda: theirs(q, k, v)), (lambda: ours(q, k, v))
    else:
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

        def torch_fn():
            torch.autograd.grad(theirs(qg, kg, vg), (qg, kg, vg), dout)

        def ours_fn():
            torch.autograd.grad(ours(qg, kg, vg), (qg, kg, vg), dout)

    t_torch, t_ours, ratio = time_pair(torch_fn, ours_fn, args.rounds)
    flops = attention_flops(B, H, N, D, causal, passes)
    return dict(dtype=str(dtype).replace("torch.", ""), D=D, N=N, B=B, H=H, causal=causal, passes=passes,
                torch_ms=t_torch * 1e3, ours_ms=t_ours * 1e3, ratio=ratio,
                torch_tflops=flops / t_torch / 1e12, ours_tflops=flops / t_ours / 1e12, check=check)


def markdown(result):
    """The Markdown record of the suite's result."""
    from .report import header_block

    body = result["result"]
    results, rates = body["results"], body["matmul_flops_per_s"]
    lines = header_block(result) + [
             f"Ours: the {body['args']['backend']} backend. Torch: SDPA with "
             f"{_torch_side(body['args'].get('sdpa_backend', 'flash'))}. "
             "Matrix-product rate measured in this run (random data): "
             + ", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in rates.items()) + ".", "",
             "ratio = torch time / our time (median of interleaved do_bench rounds; > 1 = ours faster). "
             "% mm = our TFLOP/s over the matrix-product rate of the dtype.", "",
             "| dtype | D | N | B x H | causal | pass | torch ms | ours ms | ratio | torch TFLOP/s | ours TFLOP/s "
             "| ours % mm | out err vs torch |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        err = f"{r['check']['out_vs_torch']:.1e}" if r["check"] else ""
        lines.append(f"| {r['dtype']} | {r['D']} | {r['N']} | {r['B']} x {r['H']} | {'yes' if r['causal'] else 'no'} "
                     f"| {r['passes']} | {r['torch_ms']:.3f} | {r['ours_ms']:.3f} | {r['ratio']:.2f} "
                     f"| {r['torch_tflops']:.0f} | {r['ours_tflops']:.0f} "
                     f"| {100 * r['ours_tflops'] * 1e12 / rates[r['dtype']]:.0f}% | {err} |")
    return "\n".join(lines) + "\n"


def _torch_side(name):
    return "the backend it chooses" if name == "default" else f"its {name} backend pinned"


def run(args):
    """The grid; returns the suite's result body (written by benchmarks.run)."""
    if not torch.cuda.is_available():
        raise SystemExit("target_gpu_attention needs a CUDA GPU")
    torch.manual_seed(args.seed)
    grid = argparse.Namespace(
        backend=args.attention_backend, rounds=args.gpu_rounds, tokens=16384, hidden=2048,
        dtypes=[args.dtype] if args.dtype else ["bfloat16", "float16"],
        head_dims=[args.head_dim] if args.head_dim != 64 else [64, 128],
        seq_lens=args.seq_lens or [1024, 2048, 4096, 8192, 16384], passes=list(args.passes),
        causal=args.causal, sdpa_backend=args.sdpa_backend)
    if args.smoke:
        grid.tokens, grid.hidden, grid.seq_lens, grid.head_dims, grid.rounds = 256, 64, [128], [32], 1
    dtypes = [getattr(torch, d) for d in grid.dtypes]
    rates = {str(d).replace("torch.", ""): matmul_rate(d, 1024 if args.smoke else 8192) for d in dtypes}
    print("  " + ", ".join(f"{k} mm {v / 1e12:.0f} TFLOP/s" for k, v in rates.items()), flush=True)
    causals = {"both": [False, True], "yes": [True], "no": [False]}[grid.causal]
    results = []
    for dtype in dtypes:
        for D in grid.head_dims:
            for causal in causals:
                for N in grid.seq_lens:
                    for passes in grid.passes:
                        r = run_case(dtype, D, N, causal, passes, grid)
                        results.append(r)
                        chk = r["check"]
                        extra = (f"  err out {chk['out_vs_torch']:.1e} dq {chk['dq_vs_torch']:.1e} "
                                 f"dk {chk['dk_vs_torch']:.1e} dv {chk['dv_vs_torch']:.1e} rows(ours/torch) "
                                 f"{chk['ours_vs_fp64_rows']:.1e}/{chk['torch_vs_fp64_rows']:.1e}"
                                 f"{'' if chk['finite'] else ' NONFINITE'}") if chk else ""
                        print(f"  {r['dtype']:>8} D={D:<3} N={N:<5} causal={int(causal)} {passes:<7} "
                              f"torch {r['torch_ms']:8.3f} ms  ours {r['ours_ms']:8.3f} ms  ratio {r['ratio']:.2f}  "
                              f"ours {r['ours_tflops']:4.0f} TFLOP/s{extra}", flush=True)
    return {"matmul_flops_per_s": rates, "args": vars(grid), "results": results}
