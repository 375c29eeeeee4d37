"""The low-precision gradient tail of tiny, peaked attention problems (1-4 queries, 2-16 keys,
scales up to 4): our gradients' error against float64 over torch's own error in the same dtype,
and the same for two unfused evaluations of the backward's `delta` (FlashAttention-2's
rowsum(dO * O) from the rounded output, autograd's rowsum(P * dP)), which show where the tail
comes from.

    python -m benchmarks.tools.attention_precision_tail [--cases 300] [--backend cpp] [--out FILE]
"""
from __future__ import annotations

import argparse
import random
import statistics

import torch
import torch.nn.functional as F

import transformer_fast as tf


def max_error(a, b):
    return (a.double() - b.double()).abs().max().item()


def gradients(fn, q, k, v, dout, scale):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, scale=scale)
    return torch.autograd.grad(out, (q, k), dout.to(out.dtype))


def unfused_dq(q, k, v, dout, scale, delta_from_output):
    """dQ from the backward's equations in fp32 with the kernels' roundings: P and dP in fp32, O
    rounded to the input dtype (as the forward stores it)."""
    p = (q.float() @ k.float().transpose(-1, -2) * scale).softmax(-1)
    dp = dout.float() @ v.float().transpose(-1, -2)
    if delta_from_output:
        delta = (dout.float() * (p @ v.float()).to(q.dtype).float()).sum(-1, keepdim=True)
    else:
        delta = (p * dp).sum(-1, keepdim=True)
    return ((p * (dp - delta)) @ k.float() * scale).to(q.dtype)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--backend", default="cpp")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    ratios = {}
    for _ in range(args.cases):
        nq, nk, d = rng.choice([1, 2, 3, 4]), rng.choice([2, 3, 5, 8, 16]), rng.choice([8, 16, 32])
        scale = rng.choice([1.0, 2.0, 4.0])
        dtype = rng.choice([torch.bfloat16, torch.float16])
        q, k, v = (torch.randn(1, 2, n, d).to(dtype) for n in (nq, nk, nk))
        dout = torch.randn(1, 2, nq, d).to(dtype)
        exact = gradients(F.scaled_dot_product_attention, *(t.double() for t in (q, k, v, dout)), scale)
        torch_grads = gradients(F.scaled_dot_product_attention, q, k, v, dout, scale)
        ours = gradients(lambda *a, **kw: tf.scaled_dot_product_attention(*a, backend=args.backend, **kw),
                         q, k, v, dout, scale)
        floor = 1e-3 * torch.finfo(dtype).eps
        name = str(dtype).replace("torch.", "")
        for what, mine, theirs, ref in zip(("dq", "dk"), ours, torch_grads, exact):
            denominator = max(max_error(theirs, ref), floor * ref.abs().max().item(), 1e-12)
            ratios.setdefault((name, what, "ours"), []).append(max_error(mine, ref) / denominator)
            if what == "dq":
                for label, from_output in (("delta = rowsum(dO*O)", True), ("delta = rowsum(P*dP)", False)):
                    err = max_error(unfused_dq(q, k, v, dout, scale, from_output), ref)
                    ratios.setdefault((name, what, label), []).append(err / denominator)
    lines = [f"attention precision tail: {args.cases} random cases, backend {args.backend}, torch {torch.__version__};",
             "error against float64 over torch's own error in the same dtype (median / 99th percentile / max)",
             ""]
    for key in sorted(ratios):
        values = sorted(ratios[key])
        p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
        share = sum(r > 2 for r in values) / len(values)
        lines.append(f"{key[0]:9s} {key[1]} {key[2]:22s} {statistics.median(values):6.2f} / {p99:6.2f} / "
                     f"{values[-1]:6.2f}   over 2x: {100 * share:.1f}%")
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
