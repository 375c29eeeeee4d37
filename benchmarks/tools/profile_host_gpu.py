"""Where the host time of small GPU calls goes: host and device time per call, then cProfile.

    python -m benchmarks.tools.profile_host_gpu [--calls 200] [--top 25]

In the H100 sweep (benchmarks/results/cuda-h100-2026-11-23-0505.md) a LayerNorm forward over
4096 x 1024 took 0.15 ms and a forward+backward about 1 ms (attention over 4 x 16 x 1024 x 64:
0.94 ms) where torch took 0.02-0.26 ms: far more than the kernels need, measured on a machine that
was not quiet. For each such case this prints the host time per call (calls queued without
synchronizing) and the time per call including the device, for ours and torch's (medians of five
interleaved rounds), then the functions where our calls spend it. The "tiny" shapes are the host
suite's: there the device work is negligible, and the issue's GPU target (host time per call at
most torch's + 5 us) applies.
"""
import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import transformer_fast as tf


def _cases(shapes):
    """{name: (ours, torch's)}: LayerNorm, RMSNorm and attention calls, forward without grad and
    forward+backward, for each of `shapes` ("tiny": the host suite's sizes, where the device work is
    negligible and the time per call is the host's; "large": the sizes of the sweep's rows)."""
    dev, dt = "cuda", torch.bfloat16
    sizes = {"tiny": ((8, 64), (1, 2, 8, 16)), "large": ((4096, 1024), (4, 16, 1024, 64))}
    cases = {}
    for shape in shapes:
        (rows, width), qkv_shape = sizes[shape]
        x = torch.randn(rows, width, device=dev, dtype=dt, requires_grad=True)
        w = (1 + 0.1 * torch.randn(width, device=dev, dtype=dt)).requires_grad_()
        b = (0.1 * torch.randn(width, device=dev, dtype=dt)).requires_grad_()
        dy = torch.randn_like(x)
        q, k, v = (torch.randn(qkv_shape, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        xd, wd, bd, qd, kd, vd = (t.detach() for t in (x, w, b, q, k, v))
        n = (width,)
        cases.update({
            f"{shape} layer_norm fwd": (lambda: tf.layer_norm(xd, n, wd, bd), lambda: F.layer_norm(xd, n, wd, bd)),
            f"{shape} layer_norm fwd+bwd": (
                lambda: torch.autograd.grad(tf.layer_norm(x, n, w, b), (x, w, b), dy),
                lambda: torch.autograd.grad(F.layer_norm(x, n, w, b), (x, w, b), dy)),
            f"{shape} rms_norm fwd": (lambda: tf.rms_norm(xd, n, wd), lambda: F.rms_norm(xd, n, wd)),
            f"{shape} attention fwd": (lambda: tf.scaled_dot_product_attention(qd, kd, vd),
                                       lambda: F.scaled_dot_product_attention(qd, kd, vd)),
            f"{shape} attention causal fwd": (
                lambda: tf.scaled_dot_product_attention(qd, kd, vd, is_causal=True),
                lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)),
            f"{shape} attention fwd+bwd": (
                lambda: torch.autograd.grad(tf.scaled_dot_product_attention(q, k, v), (q, k, v), do),
                lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), do)),
        })
    return cases


def _per_call(fn, calls):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls, (time.perf_counter() - start) / calls


def _print_native_calls():
    """Per op, the recipes native calls hold and the calls made from one (all 0 where they are off)."""
    from transformer_fast import _build, _native_calls

    stats = {op: _build.extension().native_calls_stats(f"transformer_fast::{op}") for op in _native_calls.OPS}
    print("native calls (recipes, calls replayed): " + ", ".join(f"{op} {r}" for op, r in stats.items()))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.profile_host_gpu", description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--shapes", nargs="+", default=["tiny", "large"], choices=["tiny", "large"])
    p.add_argument("--no-cprofile", action="store_true", help="the per-call table only")
    p.add_argument("--torch-profile", nargs="*", default=[], metavar="CASE",
                   help="cases as named in the table (spaces may be written as _) to profile with "
                        "torch.profiler by op, 50 calls each")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_host_gpu needs a CUDA GPU")
    cases = _cases(args.shapes)
    print("launches: " + ", ".join(f"{k}={os.environ.get(k, 'unset')}" for k in
                                   ("TRANSFORMER_FAST_DIRECT_LAUNCH", "TRANSFORMER_FAST_NATIVE_LAUNCH")))
    for name, (ours, theirs) in cases.items():
        for fn in (ours, theirs):
            for _ in range(20):  # compile, autotune, allocator warm-up
                fn()
        rounds = [(_per_call(ours, args.calls), _per_call(theirs, args.calls)) for _ in range(5)]  # interleaved
        (oh, ot), (th, tt) = (tuple(statistics.median(r[i][j] for r in rounds) for j in range(2)) for i in range(2))
        print(f"{name:<30} ours host {oh * 1e6:7.1f} us, with device {ot * 1e6:7.1f} us | "
              f"torch host {th * 1e6:7.1f} us, with device {tt * 1e6:7.1f} us | "
              f"host ours - torch {(oh - th) * 1e6:+6.1f} us", flush=True)
    _print_native_calls()
    if args.torch_profile:  # host time by torch op (the autograd engine's device thread included)
        from torch.profiler import ProfilerActivity, profile

        for name in args.torch_profile:
            ours = next(fns[0] for case, fns in cases.items() if case.replace(" ", "_") == name.replace(" ", "_"))
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(50):
                    ours()
                torch.cuda.synchronize()
            print(f"\n== {name}: ours, 50 calls, torch.profiler by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.no_cprofile:
        return
    for name, (ours, _theirs) in cases.items():  # warmed up above
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            ours()
        torch.cuda.synchronize()
        profile.disable()
        print(f"\n== {name}: ours, {args.calls} calls, by own time")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
