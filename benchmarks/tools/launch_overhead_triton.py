"""Host time per call of the Triton ops' CUDA kernels, launches included, without a GPU.

    python -m benchmarks.tools.launch_overhead_triton [--rounds 7] [--calls 200]
    python -m benchmarks.tools.launch_overhead_triton --check

Runs what the dispatcher runs for each op on a GPU (transformer_fast/_device_kernels.py: the op's
kernel and its Triton launcher) on small CPU tensors, with the kernels compiled for sm_90 and
launched into a recording driver (recording_driver.py): everything a call costs on the host but
the driver's own launch (cuLaunchKernel, a few us). Each call is timed with direct launches
(kernels/_launch.py) and through Triton's `JITFunction.run`, alternating, fastest round of each.
The first call of each op compiles its kernels (seconds; Triton keeps them on disk after).

--check makes every call both ways and compares what reached the launcher: the same compiled
kernel, grid, stream and arguments (new outputs compared by dtype, shape, strides and alignment).
Exits 1 on a difference; tests/test_direct_launch.py runs it."""
import argparse
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # the kernels must be jit functions, not interpreter objects
os.environ.setdefault("TRANSFORMER_FAST_TILE", "0")  # one candidate tile per autotuned kernel: no timing runs

import torch  # noqa: E402

from benchmarks.tools.recording_driver import launches, recording_driver  # noqa: E402


def _calls():
    """(name, op kernel call) for the ops the models call most, as the CUDA key runs them."""
    from transformer_fast import _device_kernels

    kernel = lambda name: _device_kernels.op_kernel(name, "triton", "cuda")  # noqa: E731
    attn_fwd, attn_bwd = kernel("attention_forward"), kernel("attention_backward")
    ln_fwd, ln_bwd = kernel("layer_norm_forward"), kernel("layer_norm_backward")
    lin_fwd = kernel("linear_attention_forward")
    q = torch.randn(1, 2, 64, 64)
    qt = torch.randn(1, 64, 2, 64).transpose(1, 2)  # (B, N, H, D) as models lay it out
    pad = torch.zeros(1, 64, dtype=torch.bool)
    out, lse = attn_fwd(q, q, q, None, None, True, 0.125, 0.0, 0)
    x, r, w, b = torch.randn(64, 256), torch.randn(64, 256), torch.randn(256), torch.randn(256)
    y, h, mean, rstd = ln_fwd(x, r, w, b, 1e-5, False)
    return {
        "attention forward": lambda: attn_fwd(q, q, q, None, None, True, 0.125, 0.0, 0),
        "attention forward, (B, N, H, D), key padding": lambda: attn_fwd(qt, qt, qt, None, pad, False, 0.125, 0.0, 0),
        "attention backward": lambda: attn_bwd(q, q, q, q, out, lse, None, None, True, 0.125, 0.0, 0, False),
        "layer_norm forward, residual": lambda: ln_fwd(x, r, w, b, 1e-5, False),
        "layer_norm backward": lambda: ln_bwd(x, None, h, w, b, mean, rstd, 1e-5, False),
        "rms_norm forward": lambda: ln_fwd(x, None, w, None, 1e-5, True),
        "linear attention forward, causal": lambda: lin_fwd(q, q, q, None, True, 1e-6, None, None, False),
    }


def _set_direct(on):
    from transformer_fast.kernels import _launch

    for launch in _launch.CompiledLaunch.instances:
        launch.direct = on


def _drop_compiled():
    from transformer_fast.kernels import _launch

    for launch in _launch.CompiledLaunch.instances:
        launch.forget()
        getattr(launch.kernel, "device_caches", {}).clear()


def _comparable(arg):
    if isinstance(arg, torch.Tensor):
        return ("tensor", arg.dtype, tuple(arg.shape), arg.stride(), arg.data_ptr() % 16)
    return arg


def check(calls):
    """0 when every call reaches the launcher the same way directly as through Triton's run."""
    failures = 0
    for name, call in calls.items():
        recorded = {}
        for direct in (False, True, True):  # Triton's run; then an entry is made; then direct
            _set_direct(direct)
            launches.clear()
            call()
            recorded[direct] = list(launches)
        theirs, ours = recorded[False], recorded[True]
        same = len(theirs) == len(ours) and all(
            a[0] is b[0] and a[1:4] == b[1:4] and list(map(_comparable, a[4])) == list(map(_comparable, b[4]))
            for a, b in zip(theirs, ours))
        direct = sum(not launch[5] for launch in ours)
        print(f"{name:<50} {len(ours)} launches, {direct} direct: {'same' if same else 'DIFFERENT'}")
        failures += not same or direct != len(ours)
    return failures


def _per_call_us(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(calls, rounds, n):
    print(f"{'op kernel (CUDA key), host us per call':<50} {'Triton run':>11} {'direct':>8} {'saved':>7}")
    for name, call in calls.items():
        best = {False: float("inf"), True: float("inf")}
        for direct in (False, True):  # warm-up: compile, make the entries
            _set_direct(direct)
            for _ in range(3):
                call()
        for _ in range(rounds):
            for direct in (False, True):
                _set_direct(direct)
                best[direct] = min(best[direct], _per_call_us(call, n))
                launches.clear()
        print(f"{name:<50} {best[False]:9.1f} us {best[True]:6.1f} us {best[False] - best[True]:5.1f} us")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with recording_driver():
        try:
            calls = _calls()
            if args.check:
                return 1 if check(calls) else 0
            measure(calls, args.rounds, args.calls)
            return 0
        finally:  # drop the compiled kernels while the driver that loaded them is active
            _drop_compiled()


if __name__ == "__main__":
    sys.exit(main())
