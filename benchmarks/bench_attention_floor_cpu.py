"""How close the C++ CPU attention is to the cost of its own tile products.

    python benchmarks/bench_attention_floor_cpu.py [--threads 2] [--repeats 15] [--n 2048] [--causal]

Times, interleaved in one process (fp32, B=1, H=8, D=64 by default):
  torch   F.scaled_dot_product_attention, forward + backward
  ours    transformer_fast.scaled_dot_product_attention(backend="cpp"), forward + backward
  floor   only the matrix products of ours: the same tiles as csrc/attention.cpp's forward_blocks
          and backward_blocks (forward 256 x 512, backward 128 x 512, causal 128 x 128), the
          same products (cpu_blas.h: the scores against K^T and V^T packed once per call, where
          the kernels pack them, else MKL in the backward's units; the others in registers),
          threads and MKL settings, with the softmax, masks and conversions left out (a small
          C++ extension built here from csrc/cpu_blas.h).

`floor` is what ours would cost if everything but the products were free: a ratio
torch / ours above torch / floor is impossible with these products."""
import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

import transformer_fast as tf
from transformer_fast import _build_config

_FLOOR_SOURCE = r"""
#include "cpu_blas.h"
#include <ATen/Parallel.h>
#include <vector>

namespace cpu_blas = transformer_fast::cpu_blas;
using cpu_blas::gemm;

// (BH, N, D) rows -> per (bh, block of `block` rows) the block's transpose in cpu_blas's packed
// form, as attention.cpp's pack_blocks(t, block, true).
std::vector<float> pack_transposed(const float* X, int64_t BH, int64_t N, int64_t D, int64_t block) {
  const int64_t nb = (N + block - 1) / block, size = cpu_blas::packed_size<float>(D, block);
  std::vector<float> packed(BH * nb * size);
  at::parallel_for(0, BH * nb, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t j0 = (t % nb) * block, rows = std::min(block, N - j0);
      cpu_blas::pack_b_transposed(X + ((t / nb) * N + j0) * D, D, rows, D, packed.data() + t * size);
    }
  });
  return packed;
}

// S (bm x bn, ld ldS) = scale * A B^T over D: against B's block packed at b_packed, or (where that
// is null) B's rows at b_rows through MKL in units_m x units_n, as attention.cpp's score_tile.
void score_product(int64_t bm, int64_t bn, int64_t D, float scale, const float* A, const float* b_packed,
                   int64_t units_m, int64_t units_n, const float* b_rows, float* S, int64_t ldS) {
  if (b_packed != nullptr) {
    cpu_blas::packed_gemm(bm, bn, D, A, D, b_packed, false, S, ldS);
    return;
  }
  for (int64_t r = 0; r < bm; r += units_m) {
    for (int64_t c = 0; c < bn; c += units_n) {
      gemm(false, true, std::min(units_m, bm - r), std::min(units_n, bn - c), D, scale, A + r * D, D, b_rows + c * D,
           D, 0.f, S + r * ldS + c, ldS);
    }
  }
}

// The products of attention_fwd_kernel and attention_bwd_kernel (csrc/attention.cpp) for
// contiguous fp32 (B, H, N, D) inputs, nothing else. Causal: the tiles the kernels skip are skipped.
void products(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor dout, bool causal) {
  const int64_t BH = q.size(0) * q.size(1), N = q.size(2), D = q.size(3);
  const float* Q = q.data_ptr<float>(); const float* K = k.data_ptr<float>();
  const float* V = v.data_ptr<float>(); const float* dO = dout.data_ptr<float>();
  // Forward tiles FM x FN; unpacked, the scores in the backward's BM x BN units (attention.cpp's score_tile).
  const int64_t FM = std::min<int64_t>(256, N), FN = std::min<int64_t>(512, N);
  const int64_t BM = std::min<int64_t>(128, N), BN = std::min<int64_t>(causal ? 128 : 512, N);
  const bool packed = cpu_blas::packed_products_available<float>() && D % 2 == 0 && N >= 256;
  const std::vector<float> kt_fwd = packed ? pack_transposed(K, BH, N, D, FN) : std::vector<float>();
  at::parallel_for(0, BH * ((N + FM - 1) / FM), 1, [&](int64_t begin, int64_t end) {
    const transformer_fast::cpu_blas::SerialGuard serial;
    std::vector<float> S(FM * FN), acc(FM * D);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / ((N + FM - 1) / FM), i0 = (t % ((N + FM - 1) / FM)) * FM, bm = std::min(FM, N - i0);
      const int64_t key_end = causal ? std::min(N, i0 + bm) : N;
      for (int64_t j0 = 0; j0 < key_end; j0 += FN) {
        const int64_t bn = std::min(FN, N - j0);
        const int64_t n = bh * ((N + FN - 1) / FN) + j0 / FN;
        score_product(bm, bn, D, 0.125f, Q + (bh * N + i0) * D,
                      packed ? kt_fwd.data() + n * cpu_blas::packed_size<float>(D, FN) : nullptr, BM, BN,
                      K + (bh * N + j0) * D, S.data(), FN);
        gemm(false, false, bm, D, bn, 1e-3f, S.data(), FN, V + (bh * N + j0) * D, D, 1.f, acc.data(), D);
      }
    }
  });
  const int64_t nk = (N + BN - 1) / BN;
  const std::vector<float> kt = packed ? pack_transposed(K, BH, N, D, BN) : std::vector<float>();
  const std::vector<float> vt = packed ? pack_transposed(V, BH, N, D, BN) : std::vector<float>();
  at::parallel_for(0, BH * nk, 1, [&](int64_t begin, int64_t end) {
    const transformer_fast::cpu_blas::SerialGuard serial;
    std::vector<float> S(BM * BN), dP(BM * BN), dk(BN * D), dv(BN * D), dq(N * D);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bh = t / nk, j0 = (t % nk) * BN, bn = std::min(BN, N - j0);
      for (int64_t i0 = causal ? (j0 / BM) * BM : 0; i0 < N; i0 += BM) {
        const int64_t bm = std::min(BM, N - i0);
        const float* qt = Q + (bh * N + i0) * D; const float* dot = dO + (bh * N + i0) * D;
        const int64_t block = cpu_blas::packed_size<float>(D, BN);
        score_product(bm, bn, D, 0.125f, qt, packed ? kt.data() + t * block : nullptr, BM, BN,
                      K + (bh * N + j0) * D, S.data(), BN);
        score_product(bm, bn, D, 1.f, dot, packed ? vt.data() + t * block : nullptr, BM, BN,
                      V + (bh * N + j0) * D, dP.data(), BN);
        gemm(true, false, bn, D, bm, 1e-3f, S.data(), BN, dot, D, 1.f, dv.data(), D);
        gemm(true, false, bn, D, bm, 1e-3f, dP.data(), BN, qt, D, 1.f, dk.data(), D);
        gemm(false, false, bm, D, bn, 1e-3f, dP.data(), BN, K + (bh * N + j0) * D, D, 1.f, dq.data() + i0 * D, D);
      }
    }
  });
}
"""


def _load_floor():
    csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
    # The package's own flags: without -fopenmp, at::parallel_for would run on one thread.
    return load_inline("transformer_fast_attention_floor", _FLOOR_SOURCE, functions=["products"],
                       extra_include_paths=[csrc], extra_cflags=_build_config.extra_cflags(),
                       extra_ldflags=_build_config.extra_ldflags() + ["-ldl"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    floor_ext = _load_floor()
    B, H, N, D = 1, args.heads, args.n, 64
    q, k, v, dout = (torch.randn(B, H, N, D) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def fwd_bwd(fn):
        def run():
            qg.grad = kg.grad = vg.grad = None
            fn(qg, kg, vg, is_causal=args.causal).backward(dout)
        return run

    fns = {
        "torch": fwd_bwd(F.scaled_dot_product_attention),
        "ours": fwd_bwd(lambda *a, **kw: tf.scaled_dot_product_attention(*a, backend="cpp", **kw)),
        "floor": lambda: floor_ext.products(q, k, v, dout, args.causal),
    }
    for fn in fns.values():
        fn()
        fn()
    times = {name: [] for name in fns}
    for i in range(args.repeats):
        order = list(fns) if i % 2 else list(fns)[::-1]
        for name in order:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}

    def ratio(a, b):  # median of the per-round ratios: robust to the VM's slow phases
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    flops = 14 * B * H * N * N * D * (0.5 if args.causal else 1.0)
    print(f"fp32 B={B} H={H} N={N} D={D}{' causal' if args.causal else ''}, {args.threads} threads, "
          f"{args.repeats} interleaved rounds, medians")
    for name, t in med.items():
        print(f"  {name:<6} {t * 1e3:8.1f} ms  {flops / t / 1e9:6.1f} GFLOP/s (14 N^2 D products)")
    print(f"  torch / ours  = {ratio('torch', 'ours'):.2f}")
    print(f"  torch / floor = {ratio('torch', 'floor'):.2f}  (the most any kernel built on these products can reach)")
    print(f"  ours / floor  = {ratio('ours', 'floor'):.2f}  (what the softmax, masks and bookkeeping add)")


if __name__ == "__main__":
    main()
