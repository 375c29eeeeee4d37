"""Host (Python) time per call of the Triton path, without a GPU.

    python -m benchmarks.tools.host_overhead_triton

Every Triton kernel launch is replaced by a no-op, and the public functions run on small CPU
tensors under TRITON_INTERPRET=1 (one thread). What is left is what a call costs on the host
before and around its launches: argument checks, the dispatch, the launchers' block-size choice,
output allocation and the autograd plumbing. Triton's own launch path comes on top:
`profile_host_gpu.py` measures the whole on a GPU.
Minimum over 7 runs of 100-300 calls each."""
import os

os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated

import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from triton.runtime.jit import KernelInterface  # noqa: E402

import transformer_fast as tf  # noqa: E402
from transformer_fast import _device_kernels  # noqa: E402
from transformer_fast.kernels import _launch  # noqa: E402


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main():
    # launches do nothing: kernel[grid](...) and the autotuned kernels' direct launch
    KernelInterface.__getitem__ = lambda self, grid: (lambda *args, **kwargs: None)
    _launch.TunedLaunch.__call__ = lambda self, key, grid, *args, **kwargs: None
    torch.set_num_threads(1)
    x, r = torch.randn(64, 256), torch.randn(64, 256)
    w, b = torch.randn(256), torch.randn(256)
    xg, wg, bg = (t.clone().requires_grad_() for t in (x, w, b))
    q = torch.randn(1, 2, 64, 64)
    qg = q.clone().requires_grad_()
    no_grad = {
        "layer_norm forward": lambda: tf.layer_norm(x, (256,), w, b, backend="triton"),
        "layer_norm + residual forward": lambda: tf.layer_norm(x, (256,), w, b, residual=r, backend="triton"),
        "attention forward": lambda: tf.scaled_dot_product_attention(q, q, q, backend="triton"),
        "linear attention forward": lambda: tf.linear_attention(q, q, q, backend="triton"),
    }
    with_grad = {
        "layer_norm forward+backward": lambda: tf.layer_norm(xg, (256,), wg, bg, backend="triton").sum().backward(),
        "F.layer_norm forward+backward (with its CPU work)": lambda: F.layer_norm(xg, (256,), wg, bg).sum().backward(),
        "attention forward+backward": lambda: tf.scaled_dot_product_attention(qg, qg, qg, backend="triton")
        .sum().backward(),
    }
    # What the CUDA key runs of ours on a GPU, alone: the op's kernel registered from Python
    # (transformer_fast/_device_kernels.py) and the Triton launcher, as the dispatcher calls them.
    fwd = _device_kernels.op_kernel("attention_forward", "triton", "cuda")
    bwd = _device_kernels.op_kernel("attention_backward", "triton", "cuda")
    out, lse = fwd(q, q, q, None, None, True, 0.125, 0.0, None)
    no_grad["attention_forward op kernel (CUDA key's Python)"] = lambda: fwd(q, q, q, None, None, True, 0.125, 0.0, None)
    no_grad["attention_backward op kernel (CUDA key's Python)"] = lambda: bwd(q, q, q, q, out, lse, None, None, True,
                                                                             0.125, 0.0, None, False)
    with torch.no_grad():
        for name, fn in no_grad.items():
            print(f"{name + ', no_grad':<60} {per_call_us(fn, 300):7.1f} us")
    for name, fn in with_grad.items():
        print(f"{name:<60} {per_call_us(fn, 100):7.1f} us")


if __name__ == "__main__":
    main()
