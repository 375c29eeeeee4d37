"""The `host` suite: what one call of each public function costs on the host, on tensors so small
that the arithmetic is negligible, against the PyTorch counterpart doing the same work.

One thread (`torch.set_num_threads(1)`), so that no OpenMP barrier is timed. For each function:
the forward without autograd (under `torch.no_grad`) and forward+backward (`torch.autograd.grad`
of every output for a fixed upstream gradient). Targets: the forward costs at most torch's time
+ 2 us, forward+backward at most 1.1x torch's.

Every pair is checked first: ours and torch's output (and gradients) against float64 plain math,
ours within 2x torch's error plus a floor (`cases.CHECK_RTOL`). Timing: `measure.time_interleaved`
with many calls per sample (a sample lasts `--min-sample-ms`, at most 1000 calls); per round the
difference and the ratio of the two medians-of-a-sample are paired, and the median over rounds is
reported.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

import transformer_fast as tf
from transformer_fast import reference

from . import cases, measure

CPU = torch.device("cpu")
FORWARD_EXTRA_US = 2.0  # forward without grad: at most torch + 2 us
BACKWARD_RATIO = 1.1  # forward+backward: at most 1.1x torch


def _torch_linear_attention_step(q, k, v):
    """One causal linear-attention step from a zero state in plain PyTorch: phi(x) = elu(x) + 1,
    S = phi(k)^T v, z = phi(k), out = phi(q) S / (phi(q) . z + eps)."""
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    S = phi_k[..., :, None] * v[..., None, :]
    z = phi_k
    return torch.einsum("bhd,bhde->bhe", phi_q, S) / ((phi_q * z).sum(-1, keepdim=True) + 1e-6)


def _exact_linear_attention_step(q, k, v):
    return reference.linear_attention(q[:, :, None], k[:, :, None], v[:, :, None], is_causal=True)[:, :, 0]


def make_cases():
    """[(name, inputs, ours, torch, exact)]: each callable takes the inputs and returns a tensor or a
    tuple of tensors; `exact` is the float64 oracle."""
    g = torch.Generator().manual_seed(0)
    B, H, N, D = 1, 2, 8, 16
    M, W = 8, 64
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[:, N - N // 4:] = True
    x, r = torch.randn(M, W, generator=g), torch.randn(M, W, generator=g)
    w, b = torch.randn(W, generator=g), torch.randn(W, generator=g)
    qs, ks, vs = (torch.randn(B, H, D, generator=g) for _ in range(3))
    shape = f"B={B} H={H} N={N} D={D}"
    out = [
        ("scaled_dot_product_attention", shape, (q, k, v),
         lambda q_, k_, v_: tf.scaled_dot_product_attention(q_, k_, v_),
         lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_),
         lambda q_, k_, v_: reference.scaled_dot_product_attention(q_, k_, v_)),
        ("scaled_dot_product_attention causal", shape, (q, k, v),
         lambda q_, k_, v_: tf.scaled_dot_product_attention(q_, k_, v_, is_causal=True),
         lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, is_causal=True),
         lambda q_, k_, v_: reference.scaled_dot_product_attention(q_, k_, v_, is_causal=True)),
        ("scaled_dot_product_attention key_padding_mask", shape + ", 1/4 of keys padded", (q, k, v),
         lambda q_, k_, v_: tf.scaled_dot_product_attention(q_, k_, v_, key_padding_mask=pad),
         lambda q_, k_, v_: F.scaled_dot_product_attention(q_, k_, v_, attn_mask=~pad[:, None, None, :]),
         lambda q_, k_, v_: reference.scaled_dot_product_attention(q_, k_, v_, key_padding_mask=pad)),
        ("layer_norm", f"{M} x {W}", (x, w, b),
         lambda x_, w_, b_: tf.layer_norm(x_, (W,), w_, b_),
         lambda x_, w_, b_: F.layer_norm(x_, (W,), w_, b_),
         lambda x_, w_, b_: reference.layer_norm(x_, (W,), w_, b_)),
        ("layer_norm residual", f"{M} x {W}, against x + r then F.layer_norm", (x, r, w, b),
         lambda x_, r_, w_, b_: tf.layer_norm(x_, (W,), w_, b_, residual=r_),
         _torch_residual_layer_norm(W),
         lambda x_, r_, w_, b_: reference.layer_norm(x_, (W,), w_, b_, residual=r_)),
        ("rms_norm", f"{M} x {W}", (x, w),
         lambda x_, w_: tf.rms_norm(x_, (W,), w_, eps=1e-6),
         lambda x_, w_: F.rms_norm(x_, (W,), w_, eps=1e-6),
         lambda x_, w_: reference.rms_norm(x_, (W,), w_, eps=1e-6)),
        ("linear_attention", shape, (q, k, v),
         lambda q_, k_, v_: tf.linear_attention(q_, k_, v_),
         lambda q_, k_, v_: cases.torch_linear_attention(q_, k_, v_, False),
         lambda q_, k_, v_: reference.linear_attention(q_, k_, v_)),
        ("linear_attention causal", shape, (q, k, v),
         lambda q_, k_, v_: tf.linear_attention(q_, k_, v_, is_causal=True),
         lambda q_, k_, v_: cases.torch_linear_attention(q_, k_, v_, True),
         lambda q_, k_, v_: reference.linear_attention(q_, k_, v_, is_causal=True)),
        ("linear_attention_step", f"B={B} H={H} D={D}, from a zero state", (qs, ks, vs),
         lambda q_, k_, v_: tf.linear_attention_step(q_, k_, v_)[0],
         _torch_linear_attention_step, _exact_linear_attention_step),
    ]
    return out


def _torch_residual_layer_norm(width):
    def fn(x, r, w, b):
        h = x + r
        return F.layer_norm(h, (width,), w, b), h
    return fn


def _tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _grads(fn, inputs, upstream):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = _tuple(fn(*leaves))
    return outs, torch.autograd.grad(outs, leaves, upstream[:len(outs)])


def check(ours, theirs, exact, inputs):
    """(ok, max error, bound, note): outputs and gradients of ours against float64, at most 2x
    torch's error in float32 plus a floor."""
    g = torch.Generator().manual_seed(1)
    outs = _tuple(exact(*(t.double() for t in inputs)))
    upstream = [torch.randn(o.shape, generator=g) for o in outs]
    exact_out, exact_grad = _grads(exact, [t.double() for t in inputs], [u.double() for u in upstream])
    worst = (0.0, 0.0, 1.0, "")
    our_tensors = [t for part in _grads(ours, inputs, upstream) for t in part]
    torch_tensors = [t for part in _grads(theirs, inputs, upstream) for t in part]
    for i, (mine, plain, ref) in enumerate(zip(our_tensors, torch_tensors, list(exact_out) + list(exact_grad))):
        err = (mine.double() - ref).abs().max().item()
        bound = 2 * (plain.double() - ref).abs().max().item() + cases.CHECK_RTOL[torch.float32] * max(
            1.0, ref.abs().max().item())
        what = f"output {i}" if i < len(exact_out) else f"grad {i - len(exact_out)}"
        if not err <= bound:
            return False, err, bound, f"{what}: error {err:.3g} > bound {bound:.3g}"
        if err / bound >= worst[0]:
            worst = (err / bound, err, bound, what)
    return True, worst[1], worst[2], "outputs and gradients vs float64"


def _forward(fn, inputs):
    def call():
        with torch.no_grad():
            fn(*inputs)
    return call


def _forward_backward(fn, inputs, upstream):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]

    def call():
        outs = _tuple(fn(*leaves))
        torch.autograd.grad(outs, leaves, upstream[:len(outs)])
    return call


def _per_call_s(fn, calls=200):
    """The mean time of a call after a warm-up: sizes the samples (one first call, slowed by
    first-use costs, would make them too short)."""
    for _ in range(20):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def run(args):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args):
    rows = []
    min_sample_s = (args.min_sample_ms if args.smoke else max(args.min_sample_ms, 20.0)) / 1e3
    for name, shape, inputs, ours, theirs, exact in make_cases():
        ok, err, bound, note = check(ours, theirs, exact, inputs)
        upstream = [torch.randn_like(o) for o in _tuple(theirs(*inputs))]
        for pass_ in ("forward", "fwd+bwd"):
            row = {"function": name, "shape": shape, "pass": pass_, "max_error": err, "error_bound": bound,
                   "check": note}
            if not ok:
                rows.append({**row, "status": "wrong"})
                continue
            make = _forward if pass_ == "forward" else lambda f, i: _forward_backward(f, i, upstream)
            fns = {"torch": make(theirs, inputs), "ours": make(ours, inputs)}
            times = measure.time_interleaved(fns, CPU, first_call_s={k: _per_call_s(fn) for k, fn in fns.items()},
                                             max_repeats=args.repeats, min_repeats=args.min_repeats,
                                             budget_s=args.budget, min_sample_s=min_sample_s, keep_samples=True)
            t_us, o_us = times["torch"]["median_ms"] * 1e3, times["ours"]["median_ms"] * 1e3
            extra = statistics.median(o - t for o, t in zip(times["ours"]["samples_ms"], times["torch"]["samples_ms"]))
            ratio = measure.paired_ratio(times, "torch", "ours")
            met = extra * 1e3 <= FORWARD_EXTRA_US if pass_ == "forward" else 1 / ratio <= BACKWARD_RATIO
            rows.append({**row, "status": "ok", "torch_us": t_us, "ours_us": o_us, "extra_us": extra * 1e3,
                         "ratio": ratio, "target": (f"ours <= torch + {FORWARD_EXTRA_US:g} us" if pass_ == "forward"
                                                    else f"ours <= {BACKWARD_RATIO:g} x torch"), "met": met,
                         "rounds": times["ours"]["samples"], "calls_per_sample": times["ours"]["calls_per_sample"]})
            r = rows[-1]
            print(f"  {name:<47} {pass_:<8} torch {t_us:8.1f} us  ours {o_us:8.1f} us  +{r['extra_us']:6.1f} us  "
                  f"ours/torch {1 / ratio:5.2f}  {'met' if met else 'MISSED'}", flush=True)
    return {"threads": 1, "rows": rows,
            "targets": {"forward_extra_us": FORWARD_EXTRA_US, "forward_backward_ratio": BACKWARD_RATIO}}


def markdown(result):
    from .report import header_block

    lines = header_block(result)
    body = result["result"]
    lines += [f"Host cost per call, one thread, float32. Targets: forward without grad at most torch + "
              f"{FORWARD_EXTRA_US:g} us; forward+backward at most {BACKWARD_RATIO:g}x torch. `extra` and "
              f"`ours / torch` are medians over interleaved rounds of the paired figures.", "",
              "| function | shape | pass | torch us | ours us | extra us | ours / torch | target "
              "| check error / bound |",
              "|---|---|---|---:|---:|---:|---:|---|---:|"]
    for r in body["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['function']} | {r['shape']} | {r['pass']} | | | | WRONG | {r['check']} | "
                         f"{r['max_error']:.1e} / {r['error_bound']:.1e} |")
            continue
        lines.append(f"| {r['function']} | {r['shape']} | {r['pass']} | {r['torch_us']:.1f} | {r['ours_us']:.1f} | "
                     f"{r['extra_us']:+.1f} | {1 / r['ratio']:.2f} | {'met' if r['met'] else '**missed**'} | "
                     f"{r['max_error']:.1e} / {r['error_bound']:.1e} |")
    met = [r for r in body["rows"] if r.get("met")]
    lines += ["", f"{len(met)} of {len(body['rows'])} rows meet their target."]
    return "\n".join(lines) + "\n"
