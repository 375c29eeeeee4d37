"""Where the GPU time of one attention forward+backward goes: ours against torch's SDPA, by kernel.

    python -m benchmarks.tools.profile_attention_gpu [--head-dims 64 128] [--seq-len 4096] [--causal both]
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        python -m benchmarks.tools.profile_attention_gpu --ncu --head-dims 64

For each case (bf16, B*N = 16k tokens, H*D = 2048, as target_gpu_attention), one forward+backward
of ours and of torch's SDPA (left to choose its backend: `--sdpa-backend` pins one) runs under
torch.profiler after a warm-up (our autotuning included), and the device time of every kernel it
launched is printed, per call: which kernels torch's backend runs, and which of ours costs what
against them. With `--ncu`, no profiler runs: one warmed-up forward+backward of each is bracketed
by cudaProfilerStart/Stop, so that Nsight Compute started with `--profile-from-start off` measures
those kernels alone (throughput against the peaks, occupancy, registers).
"""
import argparse
import collections

import torch
import torch.nn.functional as F

import transformer_fast as tf

from ..target_gpu import SDPA_BACKENDS


def _case(D, N, causal, sdpa_backend, dtype=torch.bfloat16):
    B, H = max(1, 16384 // N), max(1, 2048 // D)
    q, k, v, dout = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    backends = SDPA_BACKENDS[sdpa_backend]

    def theirs():
        if backends is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            with torch.nn.attention.sdpa_kernel(backends):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(out, (q, k, v), dout)

    def ours():
        torch.autograd.grad(tf.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), dout)

    return f"B={B} H={H} N={N} D={D} causal={int(causal)}", {"torch": theirs, "ours": ours}


def _kernel_times(fn, calls):
    """{kernel name: device microseconds per call}, from torch.profiler's CUDA activity."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.time_range.elapsed_us() / calls
    return times


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.tools.profile_attention_gpu",
                                description=__doc__.split("\n")[0])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
    p.add_argument("--sdpa-backend", default="default", choices=sorted(SDPA_BACKENDS))
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--ncu", action="store_true", help="bracket one call of each for Nsight Compute; no profiler")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_attention_gpu needs a CUDA GPU")
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    for D in args.head_dims:
        for causal in causals:
            name, fns = _case(D, args.seq_len, causal, args.sdpa_backend)
            for fn in fns.values():
                for _ in range(3):  # compile, autotune, allocator
                    fn()
            torch.cuda.synchronize()
            if args.ncu:
                for impl, fn in fns.items():
                    print(f"ncu range: {name} {impl}", flush=True)
                    torch.cuda.profiler.start()
                    fn()
                    torch.cuda.synchronize()
                    torch.cuda.profiler.stop()
                continue
            print(f"\n== {name}, bf16, forward+backward: device time per call by kernel", flush=True)
            for impl, fn in fns.items():
                times = _kernel_times(fn, args.calls)
                total = sum(times.values())
                print(f"  {impl}: {total / 1e3:.3f} ms in {len(times)} kernels", flush=True)
                for kernel, us in times.most_common(8):
                    print(f"    {us / 1e3:8.3f} ms {100 * us / total:5.1f}%  {kernel[:110]}", flush=True)


if __name__ == "__main__":
    main()
