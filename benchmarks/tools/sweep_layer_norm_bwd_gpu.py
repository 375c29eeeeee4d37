"""Device time of the LayerNorm backward's tile choices on a CUDA GPU, against torch's backward.

    python -m benchmarks.tools.sweep_layer_norm_bwd_gpu [--out FILE.json]

The backward (kernels/layer_norm.py) gives each program a contiguous range of rows and sums its
weight/bias gradient into one partial row; how many programs, how many elements each handles
per step, and with how many warps decide how many loads are in flight; one more kernel sums the
partial rows' columns (its tile: SUMS_TILE). This sweeps those three, then the reduction's tile at
the table's choice, over the sweep's shapes (bf16, with weight and bias; 4K-8K rows are the
benchmark sweep's smallest) and prints each shape's choices by time, torch's native backward
beside them. Kernel time only: each timed loop is queued behind
a `torch.cuda._sleep`, so the GPU never waits for the host. Imports the kernels alone (no C++
extension needed); runs in about a minute on an H100.
"""
import argparse
import contextlib
import itertools
import json
import os
import statistics

os.environ.setdefault("TRANSFORMER_FAST_DIRECT_LAUNCH", "0")  # no extension needed; kernel time only

import torch  # noqa: E402

import kernels.layer_norm as ln  # noqa: E402
from kernels._grid_math import sm_count  # noqa: E402

SHAPES = [(4096, 1024), (8192, 1024), (16384, 1024), (65536, 1024), (262144, 1024), (16384, 4096), (8192, 8192)]
STEP_ELEMENTS = [2048, 4096, 8192]
WARPS = [4, 8, 16]
PROGRAMS_PER_SM = [1, 2, 4, 8, 16]
# The partial sums' reduction (ln.SUMS_TILE): columns per program, partial rows per step, warps.
# Its programs are the width's column blocks, each summing every partial row in sequence.
SUMS_TILES = [(64, 32, 4), (32, 64, 4), (16, 128, 4), (32, 128, 4), (16, 256, 8), (128, 16, 4), (64, 64, 8)]


def device_ms(fn, reps=20, rounds=3):
    fn()
    if not torch.cuda.is_available():  # a dry run of the script under TRITON_INTERPRET=1
        return 1.0
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        torch.cuda._sleep(20_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def choice_patch(step, warps, per_sm):
    """The module attributes that make the backward use this step, warps and programs per SM."""
    plain = ln.row_tiles

    def row_tiles(N, backward=False):
        block_m, block_n, single, w = plain(N, backward)
        if backward and single:
            return max(1, step // block_n), block_n, True, warps
        return block_m, block_n, single, w
    return {"row_tiles": row_tiles,
            "backward_programs": lambda block_n, single, device: per_sm * (sm_count(device) if device.type == "cuda"
                                                                            else 4)}


@contextlib.contextmanager
def patched(attrs):
    """kernels.layer_norm with `attrs` set (and its plans, made with the old ones, dropped)."""
    saved = {name: getattr(ln, name) for name in attrs}
    for name, value in attrs.items():
        setattr(ln, name, value)
    ln._backward_plans.clear()
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ln, name, value)
        ln._backward_plans.clear()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--shapes", default=None, help="rows x width list, e.g. 64x32,16x8192 (dry runs)")
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sms = sm_count(dev) if dev.type == "cuda" else 4
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)"
    print(f"{name}: {sms} SMs; torch {torch.__version__}")
    results = []
    for M, N in shapes:
        torch.manual_seed(0)
        x = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        w = torch.randn(N, device=dev, dtype=torch.bfloat16)
        b = torch.randn(N, device=dev, dtype=torch.bfloat16)
        _, t_mean, t_rstd = torch.ops.aten.native_layer_norm(x, [N], w, b, 1e-5)
        mask = [True, True, True]
        t_dx, t_dw, t_db = torch.ops.aten.native_layer_norm_backward(dy, x, [N], t_mean, t_rstd, w, b, mask)
        torch_ms = device_ms(lambda: torch.ops.aten.native_layer_norm_backward(dy, x, [N], t_mean, t_rstd, w, b, mask))
        _, _, mean, rstd = ln.layer_norm_forward(x, None, w, b, 1e-5, False)
        plain = ln.row_tiles(N, backward=True)
        choices = [("current", {})]
        for step, warps, per_sm in itertools.product(STEP_ELEMENTS, WARPS, PROGRAMS_PER_SM):
            if step >= N and plain[2]:  # one row per step is the least; looped rows take no step choice
                choices.append((f"step {step} warps {warps} programs {per_sm}xSM", choice_patch(step, warps, per_sm)))
        # the partial sums' reduction, with the table's tiles
        choices += [(f"sums {c} cols x {r} rows, {w} warps", {"SUMS_TILE": (c, r, w)}) for c, r, w in SUMS_TILES]
        rows = []
        for label, attrs in choices:
            with patched(attrs):
                call = lambda: ln.layer_norm_backward(dy, None, x, w, b, mean, rstd, 1e-5, False)  # noqa: E731
                dx, dw, db = call()
                err = max((dx.float() - t_dx.float()).abs().max().item(),
                          (dw.float() - t_dw.float()).abs().max().item() / max(1.0, M ** 0.5),
                          (db.float() - t_db.float()).abs().max().item() / max(1.0, M ** 0.5))
                ms = device_ms(call)
            rows.append({"choice": label, "ms": ms, "err": err})
        rows.sort(key=lambda r: r["ms"])
        gbytes = 3 * M * N * 2 / 1e6  # dy and h read, dx written; per ms: GB/s
        print(f"\n== {M} x {N} bf16: torch {torch_ms:.4f} ms ({gbytes / torch_ms:.0f} GB/s); "
              f"current tiles {plain}")
        for r in rows[:8] + [r for r in rows[8:] if r["choice"] == "current" or r["choice"].startswith("sums")]:
            print(f"  {r['choice']:<36} {r['ms']:.4f} ms  {gbytes / r['ms']:6.0f} GB/s  "
                  f"torch/ours {torch_ms / r['ms']:.2f}  err {r['err']:.2e}")
        results.append({"M": M, "N": N, "torch_ms": torch_ms, "choices": rows})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": name, "sms": sms, "torch": torch.__version__,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
