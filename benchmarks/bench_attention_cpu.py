"""The C++ CPU attention against torch.nn.functional.scaled_dot_product_attention, as speed ratios
(torch time / our time, > 1 = we are faster) from interleaved runs in one process.

    python benchmarks/bench_attention_cpu.py [--threads 2] [--repeats 15] [--n 2048] [--dtype float32]

The machine may be shared, so each case alternates torch and ours `repeats` times after a warm-up
and reports the median of the per-pair ratios along with the median times."""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import transformer_fast as tf


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def compare(torch_fn, ours_fn, repeats, warmup=2):
    for _ in range(warmup):
        torch_fn()
        ours_fn()
    t_torch, t_ours, ratios = [], [], []
    for i in range(repeats):
        if i % 2:  # alternate which goes first
            a, b = _timed(torch_fn), _timed(ours_fn)
        else:
            b, a = _timed(ours_fn), _timed(torch_fn)
        t_torch.append(a)
        t_ours.append(b)
        ratios.append(a / b)
    return statistics.median(t_torch), statistics.median(t_ours), statistics.median(ratios)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    B, H, N, D = args.batch, args.heads, args.n, args.head_dim
    q, k, v = (torch.randn(B, H, N, D, dtype=dtype) for _ in range(3))
    dout = torch.randn(B, H, N, D, dtype=dtype)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[:, N - N // 4:] = True  # a quarter of the keys padded
    torch_pad_mask = ~pad[:, None, None, :]  # torch needs it as a bool attn_mask (True = attend)

    def fwd(fn, **kw):
        def run():
            with torch.no_grad():
                fn(q, k, v, **kw)
        return run

    def fwd_bwd(fn, **kw):
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def run():
            qg.grad = kg.grad = vg.grad = None
            fn(qg, kg, vg, **kw).backward(dout)
        return run

    ours = lambda q, k, v, **kw: tf.scaled_dot_product_attention(q, k, v, backend="cpp", **kw)  # noqa: E731
    cases = [
        ("forward", fwd(F.scaled_dot_product_attention), fwd(ours)),
        ("forward causal", fwd(F.scaled_dot_product_attention, is_causal=True), fwd(ours, is_causal=True)),
        ("forward 1/4 padded", fwd(F.scaled_dot_product_attention, attn_mask=torch_pad_mask),
         fwd(ours, key_padding_mask=pad)),
        ("fwd+bwd", fwd_bwd(F.scaled_dot_product_attention), fwd_bwd(ours)),
        ("fwd+bwd causal", fwd_bwd(F.scaled_dot_product_attention, is_causal=True), fwd_bwd(ours, is_causal=True)),
        ("fwd+bwd 1/4 padded", fwd_bwd(F.scaled_dot_product_attention, attn_mask=torch_pad_mask),
         fwd_bwd(ours, key_padding_mask=pad)),
    ]
    print(f"{args.dtype} B={B} H={H} N={N} D={D}, {args.threads} threads, {args.repeats} interleaved pairs")
    print(f"{'case':<22}{'torch ms':>10}{'ours ms':>10}{'ratio':>8}")
    for name, torch_fn, ours_fn in cases:
        if args.only and args.only not in name:
            continue
        t_torch, t_ours, ratio = compare(torch_fn, ours_fn, args.repeats)
        print(f"{name:<22}{t_torch * 1e3:>10.1f}{t_ours * 1e3:>10.1f}{ratio:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
