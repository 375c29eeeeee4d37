"""Where packing K and V once per call pays off in the C++ attention: the packed tile products
(bf16/fp16: PyTorch's brgemm, AMX where the CPU has it; fp32: register tiles) against MKL's, per
shape, forward or forward+backward. The threshold they decide by (`packing_pays_off` in
csrc/cpu/attention_tiles.h) is moved per call with TRANSFORMER_FAST_PACK_MIN_ROWS, so both paths run
in one process, interleaved (`measure.time_interleaved`: the median of rounds).

    python -m benchmarks.tools.sweep_cpu_packing [--threads 1] [--dtypes bfloat16 float32] [--passes fwd fwd+bwd]
"""
from __future__ import annotations

import argparse
import os

import torch

import transformer_fast as tf

from .. import measure
from ..run import _reexec_with_malloc_settings

# (query rows, keys, batch): causal where Nq == Nk; 12 heads of 64
SHAPES = [(16, 128, 4), (32, 128, 4), (64, 64, 4), (64, 128, 4), (96, 96, 4), (128, 128, 4), (128, 512, 1),
          (192, 192, 4), (256, 256, 4), (512, 512, 1), (32, 2048, 1)]
PATHS = {"packed": "1", "mkl": "1000000000"}  # TRANSFORMER_FAST_PACK_MIN_ROWS


def _on_path(fn, min_rows):
    def call():
        os.environ["TRANSFORMER_FAST_PACK_MIN_ROWS"] = min_rows
        fn()
    return call


def _call(nq, nk, batch, dtype, backward):
    q = torch.randn(batch, 12, nq, 64, dtype=dtype, requires_grad=backward)
    k, v = (torch.randn(batch, 12, nk, 64, dtype=dtype, requires_grad=backward) for _ in range(2))
    causal = nq == nk
    if backward:
        dout = torch.randn(batch, 12, nq, 64, dtype=dtype)
        return lambda: tf.scaled_dot_product_attention(q, k, v, is_causal=causal, backend="cpp").backward(dout)

    def forward():
        with torch.no_grad():
            tf.scaled_dot_product_attention(q, k, v, is_causal=causal, backend="cpp")
    return forward


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    ap.add_argument("--passes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    _reexec_with_malloc_settings()  # as the benchmarks: glibc trimming the packed blocks' memory adds page faults
    torch.set_num_threads(args.threads)
    saved = os.environ.get("TRANSFORMER_FAST_PACK_MIN_ROWS")
    print(f"torch {torch.__version__}, {args.threads} thread(s); heads 12, head dim 64; causal where Nq == Nk")
    print(f"{'dtype':9s} {'pass':8s} {'Nq':>5s} {'Nk':>5s} {'B':>2s} {'packed us':>10s} {'MKL us':>10s} {'packed/MKL':>10s}")
    try:
        for dtype_name in args.dtypes:
            for passes in args.passes:
                for nq, nk, batch in SHAPES:
                    fn = _call(nq, nk, batch, getattr(torch, dtype_name), passes == "fwd+bwd")
                    times = measure.time_interleaved({path: _on_path(fn, rows) for path, rows in PATHS.items()},
                                                     torch.device("cpu"), min_repeats=args.rounds,
                                                     max_repeats=args.rounds)
                    packed, mkl = (times[path]["median_ms"] * 1e3 for path in PATHS)
                    print(f"{dtype_name:9s} {passes:8s} {nq:5d} {nk:5d} {batch:2d} {packed:10.0f} {mkl:10.0f} "
                          f"{packed / mkl:10.2f}", flush=True)
    finally:
        if saved is None:
            os.environ.pop("TRANSFORMER_FAST_PACK_MIN_ROWS", None)
        else:
            os.environ["TRANSFORMER_FAST_PACK_MIN_ROWS"] = saved


if __name__ == "__main__":
    main()
