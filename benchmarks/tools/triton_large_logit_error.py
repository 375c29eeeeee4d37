"""The Triton attention backward's float32 dV error at large logits, against a float64 reference,
next to torch's float32 error on the same rounded inputs, and float32 emulations of the Triton
kernels' softmax statistics that say where the error comes from. Runs the kernels under
TRITON_INTERPRET=1 (exact tl.dot), so what differs from torch is the kernels' arithmetic.

    python -m benchmarks.tools.triton_large_logit_error [--seeds 8] [--n 17] [--d 40] [--scale 2] [--q-gain 4]

Emulations (everything in float64 except the roundings named; dV = P^T dO):
  lse32:   P = exp(s - lse) with the stored natural-log lse rounded to float32;
  kernels: the kernels' steps each rounded to float32: s2 = q.k * (scale * log2 e), m2, l, the
           stored lse = (m2 + log2 l) * ln 2, then P = exp2(fma(lse, -log2 e, s2)).
"""
import argparse
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import transformer_fast as tf  # noqa: E402

LOG2E, LN2 = 1.0 / math.log(2.0), math.log(2.0)


def f32(t):
    return t.float().double()


def dv_from_p(p, dout):
    return p.transpose(-2, -1) @ dout


def emulated_dv(q, k, dout, scale):
    """(dV with only lse rounded to float32, dV with the kernels' statistics in float32)."""
    s = (q @ k.transpose(-2, -1)) * scale
    lse = torch.logsumexp(s, -1, keepdim=True)
    dv_lse32 = dv_from_p(torch.exp(s - f32(lse)), dout)
    s2 = f32(f32(q @ k.transpose(-2, -1)) * f32(torch.tensor(scale * LOG2E, dtype=torch.float64)))
    m2 = s2.amax(-1, keepdim=True)
    l2 = f32(torch.exp2(s2 - m2).sum(-1, keepdim=True))
    lse_stored = f32(f32(m2 + f32(torch.log2(l2))) * LN2)
    p = f32(torch.exp2(f32(s2 - lse_stored * LOG2E)))  # fma: one rounding
    return dv_lse32, dv_from_p(p, dout)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--n", type=int, default=17)
    parser.add_argument("--d", type=int, default=40)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--scale", type=float, default=2.0)
    parser.add_argument("--q-gain", type=float, default=4.0)
    args = parser.parse_args()
    print(f"B=1 H={args.heads} N={args.n} D={args.d} scale={args.scale} q ~ {args.q_gain} x N(0, 1); "
          "max |dV error| against float64")
    print("seed  max|s|  triton     cpp        torch      plain32    lse32      kernels    triton/torch")
    ratios, to_lse32, torch_errors, triton_errors, cpp_ratios = [], [], [], [], []
    for seed in range(args.seeds):
        g = torch.Generator().manual_seed(seed)
        q = args.q_gain * torch.randn(1, args.heads, args.n, args.d, generator=g)
        k, v, dout = (torch.randn(1, args.heads, args.n, args.d, generator=g) for _ in range(3))
        errors = {}
        v64 = v.double().requires_grad_()
        out64 = F.scaled_dot_product_attention(q.double(), k.double(), v64, scale=args.scale)
        dv64, = torch.autograd.grad(out64, v64, dout.double())
        for name, fn in (("triton", lambda q, k, v: tf.scaled_dot_product_attention(q, k, v, scale=args.scale,
                                                                                    backend="triton")),
                         ("cpp", lambda q, k, v: tf.scaled_dot_product_attention(q, k, v, scale=args.scale,
                                                                                 backend="cpp")),
                         ("torch", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=args.scale)),
                         ("plain32", lambda q, k, v: tf.scaled_dot_product_attention(q, k, v, scale=args.scale,
                                                                                     backend="reference"))):
            vv = v.clone().requires_grad_()
            dv, = torch.autograd.grad(fn(q, k, vv), vv, dout)
            errors[name] = (dv.double() - dv64).abs().max().item()
        for name, dv in zip(("lse32", "kernels"), emulated_dv(q.double(), k.double(), dout.double(), args.scale)):
            errors[name] = (dv - dv64).abs().max().item()
        s_max = (q.double() @ k.double().transpose(-2, -1) * args.scale).abs().max().item()
        ratios.append(errors["triton"] / errors["torch"])
        to_lse32.append(errors["triton"] / errors["lse32"])
        cpp_ratios.append(errors["cpp"] / errors["torch"])
        torch_errors.append(errors["torch"])
        triton_errors.append(errors["triton"])
        print(f"{seed:4d}  {s_max:6.1f}  " + "  ".join(f"{errors[n]:.2e}" for n in
                                                    ("triton", "cpp", "torch", "plain32", "lse32", "kernels"))
              + f"   {ratios[-1]:.1f}x")
    ratios.sort()
    print(f"triton / torch: {ratios[0]:.1f}x to {ratios[-1]:.1f}x over {args.seeds} seeds, median "
          f"{ratios[len(ratios) // 2]:.1f}x, {sum(r > 2 for r in ratios)} above 2x")
    print(f"cpp / torch: {min(cpp_ratios):.1f}x to {max(cpp_ratios):.1f}x")
    print(f"triton / lse32 emulation: {min(to_lse32):.2f}x to {max(to_lse32):.2f}x")
    print(f"worst errors over the seeds: triton {max(triton_errors):.2e}, torch {max(torch_errors):.2e} "
          f"({max(triton_errors) / max(torch_errors):.1f}x)")


if __name__ == "__main__":
    main()
