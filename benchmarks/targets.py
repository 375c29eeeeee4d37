"""The CPU target checks: each kernel family against its PyTorch counterpart at the size its
performance target names, as speed ratios (PyTorch time / our time, > 1 = ours is faster).

  target_cpu_attention         the C++ softmax attention against F.scaled_dot_product_attention,
                               fp32 and bf16, B=1 H=8 N=2048 D=64: forward and forward+backward,
                               plain, causal, and a quarter of the keys padded
  target_cpu_layer_norm        the fused residual + LayerNorm against `x + r` then F.layer_norm,
                               4096 x 1024 fp32, and its bandwidth against a copy of the same size
  target_cpu_linear_attention  the C++ causal linear attention against a cumulative-sum PyTorch
                               linear attention and F.sdpa(is_causal=True), B=1 H=8 N=4096 D=64;
                               its peak memory growth with N; where it overtakes F.sdpa

Each implementation is checked against a float64 oracle first (a wrong one is reported and not
timed). Timing: `measure.time_interleaved` (round-robin, so a slow phase of a shared machine
hits all of them); a ratio is the median over rounds of the two times of that round.
"""
from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F

import transformer_fast as tf
from transformer_fast import reference

from . import cases, measure

CPU = torch.device("cpu")
ATTENTION_CASES = ("forward", "forward causal", "forward 1/4 padded", "fwd+bwd", "fwd+bwd causal",
                   "fwd+bwd 1/4 padded")


def _time(fns, args):
    return measure.time_interleaved(fns, CPU, max_repeats=args.repeats, min_repeats=args.min_repeats,
                                    budget_s=args.budget, min_sample_s=args.min_sample_ms / 1e3, keep_samples=True)


def _row_check(ours, theirs, exact, dtype):
    """(ok, our error, bound): our max error against float64 at most 2x PyTorch's plus a floor."""
    err = (ours.double() - exact).abs().max().item()
    bound = 2 * (theirs.double() - exact).abs().max().item() + cases.CHECK_RTOL[dtype] * max(1.0, exact.abs().max().item())
    return err <= bound, err, bound


# --------------------------------------------------------------------------------------------
# Softmax attention
# --------------------------------------------------------------------------------------------
def attention(args):
    B, H, N, D = (1, 2, 64, 16) if args.smoke else (args.batch or 1, args.heads or 8, max(args.seq_lens or [2048]),
                                                    args.head_dim)
    dtypes = [args.dtype] if args.dtype else ["float32", "bfloat16"]
    rows = []
    for name in dtypes:
        dtype = getattr(torch, name)
        g = torch.Generator().manual_seed(args.seed)
        q, k, v, dout = (torch.randn(B, H, N, D, generator=g).to(dtype) for _ in range(4))
        pad = torch.zeros(B, N, dtype=torch.bool)
        pad[:, N - N // 4:] = True
        for case in ATTENTION_CASES:
            causal, padded, backward = "causal" in case, "padded" in case, case.startswith("fwd+bwd")
            ours_kw = {"is_causal": causal, **({"key_padding_mask": pad} if padded else {})}
            torch_kw = {"is_causal": causal, **({"attn_mask": ~pad[:, None, None, :]} if padded else {})}

            def ours(q_, k_, v_, kw=ours_kw):
                return tf.scaled_dot_product_attention(q_, k_, v_, backend="cpp", **kw)

            def theirs(q_, k_, v_, kw=torch_kw):
                return F.scaled_dot_product_attention(q_, k_, v_, **kw)

            check_rows = cases.check_rows(N)
            exact = reference.scaled_dot_product_attention(
                q.double(), k.double(), v.double(), is_causal=causal,
                key_padding_mask=pad if padded else None)[:, :, check_rows]
            with torch.no_grad():
                ok, err, bound = _row_check(ours(q, k, v)[:, :, check_rows], theirs(q, k, v)[:, :, check_rows],
                                            exact, dtype)
            row = {"dtype": name, "shape": f"B={B} H={H} N={N} D={D}", "case": case, "max_error": err,
                   "error_bound": bound}
            if not ok:
                rows.append({**row, "status": "wrong"})
                continue
            fns = {"torch": _pass(theirs, q, k, v, dout, backward), "ours": _pass(ours, q, k, v, dout, backward)}
            times = _time(fns, args)
            rows.append({**row, "status": "ok", "torch_ms": times["torch"]["median_ms"],
                         "ours_ms": times["ours"]["median_ms"], "ratio": measure.paired_ratio(times, "torch", "ours"),
                         "rounds": times["ours"]["samples"]})
            print(f"  {name:<9} {case:<20} torch {rows[-1]['torch_ms']:9.2f} ms  ours {rows[-1]['ours_ms']:9.2f} ms"
                  f"  ratio {rows[-1]['ratio']:.2f}", flush=True)
    return {"rows": rows}


def _pass(fn, q, k, v, dout, backward):
    if not backward:
        def forward():
            with torch.no_grad():
                fn(q, k, v)
        return forward
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def forward_backward():
        torch.autograd.grad(fn(qg, kg, vg), (qg, kg, vg), dout)
    return forward_backward


# --------------------------------------------------------------------------------------------
# Fused residual + LayerNorm
# --------------------------------------------------------------------------------------------
def layer_norm(args):
    M, W = (64, 128) if args.smoke else (4096, 1024)
    g = torch.Generator().manual_seed(args.seed)
    x, r, dy, dh, src = (torch.randn(M, W, generator=g) for _ in range(5))
    w, b = torch.randn(W, generator=g), torch.randn(W, generator=g)
    dst = torch.empty_like(src)
    y, h = tf.layer_norm(x, (W,), w, b, residual=r, backend="cpp")
    exact, _ = reference.layer_norm(x.double(), (W,), w.double(), b.double(), residual=r.double())
    plain = F.layer_norm(x + r, (W,), w, b)
    ok, err, bound = _row_check(y, plain, exact, torch.float32)
    result = {"shape": f"{M} x {W} float32", "max_error": err, "error_bound": bound, "status": "ok" if ok else "wrong"}
    if not ok:
        return result
    xg, rg, wg, bg = (t.clone().requires_grad_() for t in (x, r, w, b))

    def torch_fwd():
        with torch.no_grad():
            F.layer_norm(x + r, (W,), w, b)

    def ours_fwd():
        with torch.no_grad():
            tf.layer_norm(x, (W,), w, b, residual=r, backend="cpp")

    def torch_fwd_bwd():
        hh = xg + rg
        torch.autograd.backward([F.layer_norm(hh, (W,), wg, bg), hh], [dy, dh])

    def ours_fwd_bwd():
        torch.autograd.backward(list(tf.layer_norm(xg, (W,), wg, bg, residual=rg, backend="cpp")), [dy, dh])

    times = _time({"copy": lambda: dst.copy_(src), "torch fwd": torch_fwd, "ours fwd": ours_fwd,
                   "torch fwd+bwd": torch_fwd_bwd, "ours fwd+bwd": ours_fwd_bwd}, args)
    nbytes = M * W * 4
    result.update({name.replace(" ", "_") + "_ms": t["median_ms"] for name, t in times.items()})
    result.update(forward_ratio=measure.paired_ratio(times, "torch fwd", "ours fwd"),
                  forward_backward_ratio=measure.paired_ratio(times, "torch fwd+bwd", "ours fwd+bwd"),
                  copy_gb_per_s=2 * nbytes / times["copy"]["median_ms"] / 1e6,  # read + write
                  forward_gb_per_s=4 * nbytes / times["ours fwd"]["median_ms"] / 1e6)  # x, r in; y, h out
    print(f"  forward {result['forward_ratio']:.2f}x, forward+backward {result['forward_backward_ratio']:.2f}x; "
          f"fused forward {result['forward_gb_per_s']:.1f} GB/s, copy {result['copy_gb_per_s']:.1f} GB/s", flush=True)
    return result


# --------------------------------------------------------------------------------------------
# Linear attention
# --------------------------------------------------------------------------------------------
_RSS_CODE = """
import sys, torch, transformer_fast as tf
n, h, d = map(int, sys.argv[1:])
def hwm():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) / 1024
q, k, v = (torch.randn(1, h, n, d, requires_grad=True) for _ in range(3))
tf.linear_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], is_causal=True, backend='cpp').sum().backward()
before = hwm()
tf.linear_attention(q, k, v, is_causal=True, backend='cpp').backward(torch.ones(1, h, n, d))
print(hwm() - before)
"""


def peak_rss_growth_mib(n, heads, head_dim):
    """Peak RSS of a fresh process over one C++ forward+backward at length n, above its peak before."""
    proc = subprocess.run([sys.executable, "-c", _RSS_CODE, str(n), str(heads), str(head_dim)], capture_output=True,
                          text=True, check=True)
    return float(proc.stdout)


def linear_attention(args):
    B, H, N, D = (1, 2, 64, 16) if args.smoke else (1, 8, 4096, 64)
    g = torch.Generator().manual_seed(args.seed)
    q, k, v, dout = (torch.randn(B, H, N, D, generator=g) for _ in range(4))
    impls = {"ours": lambda q_, k_, v_: tf.linear_attention(q_, k_, v_, is_causal=True, backend="cpp"),
             "cumsum": lambda q_, k_, v_: cases.torch_linear_attention(q_, k_, v_, True),
             "sdpa": lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)}
    rows = cases.check_rows(N)
    exact = reference.linear_attention(q.double(), k.double(), v.double(), is_causal=True)[:, :, rows]
    with torch.no_grad():
        ok, err, bound = _row_check(impls["ours"](q, k, v)[:, :, rows], impls["cumsum"](q, k, v)[:, :, rows], exact,
                                    torch.float32)
    result = {"shape": f"B={B} H={H} N={N} D={D} causal float32", "max_error": err, "error_bound": bound,
              "status": "ok" if ok else "wrong", "passes": {}}
    if not ok:
        return result
    for name, backward in (("forward", False), ("forward+backward", True)):
        times = _time({impl: _pass(fn, q, k, v, dout, backward) for impl, fn in impls.items()}, args)
        result["passes"][name] = {"ours_ms": times["ours"]["median_ms"],
                                  "vs_cumsum": measure.paired_ratio(times, "cumsum", "ours"),
                                  "vs_sdpa": measure.paired_ratio(times, "sdpa", "ours")}
        print(f"  {name:<17} {times['ours']['median_ms']:.2f} ms: {result['passes'][name]['vs_cumsum']:.1f}x "
              f"cumulative-sum PyTorch, {result['passes'][name]['vs_sdpa']:.1f}x F.sdpa", flush=True)
    lengths = (16,) if args.smoke else (4096, 16384, 65536)
    result["peak_rss_growth_mib"] = {str(n): peak_rss_growth_mib(n, H, D) for n in lengths}
    result["crossover_vs_sdpa"] = {}
    for causal in (True, False):
        ratios = {}
        for n in ((16, 32) if args.smoke else (64, 128, 256, 512, 1024, 2048)):
            qs, ks, vs = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
            with torch.no_grad():
                times = _time({"ours": lambda: tf.linear_attention(qs, ks, vs, is_causal=causal, backend="cpp"),
                               "sdpa": lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)}, args)
            ratios[str(n)] = measure.paired_ratio(times, "sdpa", "ours")
        faster = [int(n) for n in ratios if all(ratios[m] > 1 for m in ratios if int(m) >= int(n))]
        result["crossover_vs_sdpa"]["causal" if causal else "non-causal"] = {
            "ratios": ratios, "faster_from": min(faster) if faster else None}
        print(f"  {'causal' if causal else 'non-causal'}: faster than F.sdpa from N = {min(faster) if faster else '-'}",
              flush=True)
    return result


def markdown(result):
    """The Markdown record of a target suite's result."""
    from .report import header_block

    lines = header_block(result)
    body = result["result"]
    if result["suite"] == "target_cpu_attention":
        lines += ["| dtype | shape | case | torch ms | ours ms | torch / ours | check error / bound |",
                  "|---|---|---|---:|---:|---:|---:|"]
        for r in body["rows"]:
            timed = r["status"] == "ok"
            lines.append(f"| {r['dtype']} | {r['shape']} | {r['case']} | {r['torch_ms']:.2f} | {r['ours_ms']:.2f} | "
                         f"{r['ratio']:.2f} | {r['max_error']:.1e} / {r['error_bound']:.1e} |" if timed else
                         f"| {r['dtype']} | {r['shape']} | {r['case']} | | | WRONG | {r['max_error']:.1e} / "
                         f"{r['error_bound']:.1e} |")
    elif result["suite"] == "target_cpu_layer_norm" and body["status"] == "ok":
        lines += [f"LayerNorm with residual, {body['shape']}: forward {body['forward_ratio']:.2f}x, forward+backward "
                  f"{body['forward_backward_ratio']:.2f}x (torch time / ours); fused forward "
                  f"{body['forward_gb_per_s']:.1f} GB/s (4 tensors moved) = "
                  f"{100 * body['forward_gb_per_s'] / body['copy_gb_per_s']:.0f}% of a copy's "
                  f"{body['copy_gb_per_s']:.1f} GB/s (read + write)."]
    elif result["suite"] == "target_cpu_linear_attention" and body["status"] == "ok":
        lines += [f"Linear attention, {body['shape']} (time ratios: theirs / ours):", "",
                  "| pass | ours ms | vs cumulative-sum PyTorch | vs F.sdpa(is_causal=True) |", "|---|---:|---:|---:|"]
        lines += [f"| {p} | {r['ours_ms']:.2f} | {r['vs_cumsum']:.1f}x | {r['vs_sdpa']:.1f}x |"
                  for p, r in body["passes"].items()]
        lines += ["", "Peak RSS growth of one C++ forward+backward: "
                  + ", ".join(f"N={n}: {m:.0f} MiB" for n, m in body["peak_rss_growth_mib"].items()), ""]
        for what, c in body["crossover_vs_sdpa"].items():
            lines.append(f"- {what}: faster than F.sdpa from N = {c['faster_from']} (F.sdpa / ours: "
                         + ", ".join(f"{n}: {r:.2f}" for n, r in c["ratios"].items()) + ")")
    else:
        lines += [f"WRONG: error {body['max_error']:.2e} > bound {body['error_bound']:.2e}; not timed"]
    return "\n".join(lines) + "\n"
