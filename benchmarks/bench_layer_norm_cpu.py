"""Fused residual + LayerNorm on CPU against torch's `x + r` then `F.layer_norm`, as ratios.

    python benchmarks/bench_layer_norm_cpu.py [--rows 4096] [--width 1024] [--iters 40] [--rms] [--threads T] [--heap]

Every variant runs once per round, in a rotating order, and the medians over the rounds are
compared (the machine is shared and noisy). The achieved bandwidth of the fused forward (4 tensors
moved: x, r in; h, y out) is reported against `dst.copy_(src)` on same-size buffers measured in
the same rounds. --heap re-executes it with MALLOC_MMAP_MAX_=0 and no heap trimming, so 16 MiB
outputs come from the heap instead of fresh mmaps (by default glibc raises its mmap threshold
after the first free of such a block, which does the same).
"""
import argparse
import os
import statistics
import sys
import time

if "--heap" in sys.argv and os.environ.get("MALLOC_MMAP_MAX_") != "0":
    os.environ.update(MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(1 << 40))
    os.execv(sys.executable, [sys.executable] + sys.argv)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import transformer_fast as tf  # noqa: E402
from transformer_fast import _dispatch  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rms", action="store_true", help="RMSNorm instead of LayerNorm")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--heap", action="store_true", help="MALLOC_MMAP_MAX_=0, no trimming")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    M, N = args.rows, args.width
    torch.manual_seed(0)
    C = _dispatch.cpp_extension()

    x, r, dy, dh = (torch.randn(M, N, dtype=dtype) for _ in range(4))
    w, b = torch.randn(N, dtype=dtype), (None if args.rms else torch.randn(N, dtype=dtype))
    src, dst = torch.randn(M, N, dtype=dtype), torch.empty(M, N, dtype=dtype)
    xg, rg = x.clone().requires_grad_(), r.clone().requires_grad_()
    wg, bg = w.clone().requires_grad_(), (None if b is None else b.clone().requires_grad_())

    def torch_norm(h, weight, bias):
        return F.rms_norm(h, (N,), weight, 1e-6) if args.rms else F.layer_norm(h, (N,), weight, bias)

    def fused(xx, rr, weight, bias):
        if args.rms:
            return tf.rms_norm(xx, (N,), weight, 1e-6, residual=rr, backend="cpp")
        return tf.layer_norm(xx, (N,), weight, bias, residual=rr, backend="cpp")

    def run_torch_fwd():
        with torch.no_grad():
            h = x + r
            return torch_norm(h, w, b), h

    def run_fused_fwd():
        with torch.no_grad():
            return fused(x, r, w, b)

    def run_kernel_fwd():
        return C.layer_norm_forward(x, r, w, b, 1e-6 if args.rms else 1e-5, args.rms)

    def run_torch_fwd_bwd():
        h = xg + rg
        y = torch_norm(h, wg, bg)
        torch.autograd.backward([y, h], [dy, dh])

    def run_fused_fwd_bwd():
        y, h = fused(xg, rg, wg, bg)
        torch.autograd.backward([y, h], [dy, dh])

    def run_copy():
        dst.copy_(src)

    variants = {"copy": run_copy, "torch fwd": run_torch_fwd, "fused fwd": run_fused_fwd,
                "fused kernel fwd": run_kernel_fwd, "torch fwd+bwd": run_torch_fwd_bwd,
                "fused fwd+bwd": run_fused_fwd_bwd}
    names = list(variants)
    times = {n: [] for n in names}
    for i in range(args.iters + 5):
        for n in names[i % len(names):] + names[:i % len(names)]:
            for p in (xg, rg, wg, bg):
                if p is not None:
                    p.grad = None
            t = time.perf_counter()
            variants[n]()
            elapsed = time.perf_counter() - t
            if i >= 5:
                times[n].append(elapsed)
    med = {n: statistics.median(v) for n, v in times.items()}
    nbytes = M * N * x.element_size()
    kind = "RMSNorm" if args.rms else "LayerNorm"
    print(f"{kind} {args.dtype} {M}x{N}, {torch.get_num_threads()} threads, {args.iters} interleaved rounds, medians")
    for n in names:
        print(f"  {n:<18} {med[n] * 1e3:8.3f} ms")
    copy_gbs = 2 * nbytes / med["copy"] / 1e9
    fused_gbs = 4 * nbytes / med["fused fwd"] / 1e9
    kernel_gbs = 4 * nbytes / med["fused kernel fwd"] / 1e9
    print(f"  copy bandwidth            {copy_gbs:6.1f} GB/s")
    print(f"  fused forward             {fused_gbs:6.1f} GB/s = {fused_gbs / copy_gbs:5.1%} of copy "
          f"(kernel alone {kernel_gbs:.1f} GB/s = {kernel_gbs / copy_gbs:.1%})")
    print(f"  speed-up forward          {med['torch fwd'] / med['fused fwd']:5.2f}x  (ideal 5/4 = 1.25x)")
    print(f"  speed-up forward+backward {med['torch fwd+bwd'] / med['fused fwd+bwd']:5.2f}x")


if __name__ == "__main__":
    main()
