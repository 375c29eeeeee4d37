"""CPU speed of the C++ linear attention as ratios against PyTorch, measured in one process,
interleaved, medians of repeated runs (the machine may be shared: absolute times mean little).

    python benchmarks/bench_linear_attention_cpu.py              # wall clock, torch's thread count
    python benchmarks/bench_linear_attention_cpu.py --cpu-time   # process CPU time, one thread

Reports, for fp32 B=1 H=8 D=64 N=4096 causal: C++ vs a cumulative-sum PyTorch implementation
(which materialises N x D x Dv) and vs F.scaled_dot_product_attention(is_causal=True), forward and
forward+backward; the peak-memory growth of the C++ forward+backward with N; and the sequence
length from which linear attention beats torch's softmax attention (causal and not).
"""
import argparse
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import transformer_fast as tf


def cumsum_linear_attention(q, k, v, eps=1e-6):
    phi_q, phi_k = F.elu(q) + 1, F.elu(k) + 1
    S = (phi_k[..., :, None] * v[..., None, :]).cumsum(2)  # (B, H, N, D, Dv)
    z = phi_k.cumsum(2)
    return torch.einsum("bhnd,bhnde->bhne", phi_q, S) / ((phi_q * z).sum(-1, keepdim=True) + eps)


def interleaved_medians(fns, repeats, clock):
    for f in fns.values():
        f()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = clock()
            f()
            times[name].append(clock() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def forward_backward(fn, q, k, v, dout):
    def run():
        q_, k_, v_ = (t.detach().requires_grad_() for t in (q, k, v))
        torch.autograd.grad(fn(q_, k_, v_), (q_, k_, v_), dout)
    return run


def peak_rss_growth_mib(n):
    """Peak RSS of a fresh process running one C++ forward+backward at length n, minus its peak before."""
    code = f"""
import torch, transformer_fast as tf
def hwm():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]) / 1024
q, k, v = (torch.randn(1, 8, {n}, 64, requires_grad=True) for _ in range(3))
tf.linear_attention(q[:, :, :8], k[:, :, :8], v[:, :, :8], is_causal=True, backend='cpp').sum().backward()
before = hwm()
tf.linear_attention(q, k, v, is_causal=True, backend='cpp').backward(torch.ones(1, 8, {n}, 64))
print(hwm() - before)
"""
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu-time", action="store_true", help="time.process_time with one thread")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    clock = time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.process_time
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, clock {clock.__name__}")
    torch.manual_seed(0)

    B, H, N, D = 1, 8, 4096, 64
    q, k, v, dout = (torch.randn(B, H, N, D) for _ in range(4))
    ours = lambda q, k, v: tf.linear_attention(q, k, v, is_causal=True, backend="cpp")  # noqa: E731
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    fwd = interleaved_medians({"ours": lambda: ours(q, k, v), "cumsum": lambda: cumsum_linear_attention(q, k, v),
                               "sdpa": lambda: sdpa(q, k, v)}, args.repeats, clock)
    fb = interleaved_medians({"ours": forward_backward(ours, q, k, v, dout),
                              "cumsum": forward_backward(cumsum_linear_attention, q, k, v, dout),
                              "sdpa": forward_backward(sdpa, q, k, v, dout)}, max(3, args.repeats // 3), clock)
    for what, m in (("forward", fwd), ("forward+backward", fb)):
        print(f"{what:17s} B={B} H={H} N={N} D={D} causal fp32: ours {m['ours']:.1f} ms, "
              f"cumsum {m['cumsum']:.1f} ms ({m['cumsum'] / m['ours']:.1f}x), "
              f"sdpa {m['sdpa']:.1f} ms ({m['sdpa'] / m['ours']:.1f}x)")

    for n in (4096, 16384, 65536):
        print(f"peak RSS growth of a C++ forward+backward, H=8 D=64 N={n}: {peak_rss_growth_mib(n):.0f} MiB")

    for causal in (True, False):
        crossover = None
        for n in (64, 128, 256, 512, 1024, 2048):
            q, k, v = (torch.randn(B, H, n, D) for _ in range(3))
            m = interleaved_medians({"ours": lambda: tf.linear_attention(q, k, v, is_causal=causal, backend="cpp"),
                                     "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)},
                                    args.repeats * 3, clock)
            print(f"  {'causal' if causal else 'full  '} N={n:5d}: sdpa / ours = {m['sdpa'] / m['ours']:.2f}")
            if crossover is None and m["sdpa"] > m["ours"]:
                crossover = n
        print(f"{'causal' if causal else 'non-causal'}: linear attention (C++) is faster than F.sdpa from N = {crossover}")


if __name__ == "__main__":
    main()
