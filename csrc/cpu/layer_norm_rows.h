// The per-row LayerNorm / RMSNorm kernels of layer_norm.cpp: the forward of one row (h = x +
// residual, its statistics, y) and the backward of one row (dx, and the row's share of dweight /
// dbias), vectorised with at::vec for any Vec::size(). layer_norm.cpp holds the tensor-level
// checks, the parallel loops over rows and the ops.
#pragma once

#include "cpu/cpu_capability.h"  // first: selects at::vec's ISA

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>

namespace transformer_fast {
namespace cpu_norm {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
constexpr int64_t kStep = 2 * kVec;  // elements per step: one Vectorized<BFloat16/Half>, two of float

// Loads/stores kStep elements of T as two float vectors (partial versions for a row's tail).
template <typename T>
struct Io {
  using RVec = at::vec::Vectorized<T>;
  static_assert(RVec::size() == kStep, "reduced-precision vectors hold two float vectors");
  static inline void load(const T* p, Vec& a, Vec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(RVec::loadu(p));
  }
  static inline void load(const T* p, int64_t n, Vec& a, Vec& b) {
    std::tie(a, b) = at::vec::convert_to_float<T>(RVec::loadu(p, n));
  }
  static inline void store(T* p, const Vec& a, const Vec& b) { at::vec::convert_from_float<T>(a, b).store(p); }
  static inline void store(T* p, int64_t n, const Vec& a, const Vec& b) {
    at::vec::convert_from_float<T>(a, b).store(p, n);
  }
  // h = x + r rounded to T, as torch's x + r, returned in float.
  static inline void add_round(const Vec& xa, const Vec& xb, const Vec& ra, const Vec& rb, Vec& ha, Vec& hb) {
    std::tie(ha, hb) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(xa + ra, xb + rb));
  }
};

template <>
struct Io<float> {
  static inline void load(const float* p, Vec& a, Vec& b) {
    a = Vec::loadu(p);
    b = Vec::loadu(p + kVec);
  }
  static inline void load(const float* p, int64_t n, Vec& a, Vec& b) {
    a = n >= kVec ? Vec::loadu(p) : Vec::loadu(p, n);
    b = n > kVec ? Vec::loadu(p + kVec, n - kVec) : Vec(0.f);
  }
  static inline void store(float* p, const Vec& a, const Vec& b) {
    a.store(p);
    b.store(p + kVec);
  }
  static inline void store(float* p, int64_t n, const Vec& a, const Vec& b) {
    if (n >= kVec) {
      a.store(p);
      if (n > kVec) b.store(p + kVec, n - kVec);
    } else {
      a.store(p, n);
    }
  }
  static inline void add_round(const Vec& xa, const Vec& xb, const Vec& ra, const Vec& rb, Vec& ha, Vec& hb) {
    ha = xa + ra;
    hb = xb + rb;
  }
};

// The lanes of v, added in Acc.
template <typename Acc = float>
inline Acc lane_sum(const Vec& v) {
  alignas(64) float tmp[kVec];
  v.store(tmp);
  Acc s = 0;
  for (int64_t i = 0; i < kVec; ++i) s += tmp[i];
  return s;
}

// Running (count, mean, M2) of a set of values, merged with Chan et al.'s formula.
struct Moments {
  double n = 0, mean = 0, m2 = 0;
  void merge(double nb, double mb, double m2b) {
    if (nb == 0) return;
    const double total = n + nb, delta = mb - mean;
    mean += delta * (nb / total);
    m2 += m2b + delta * delta * (n * nb / total);
    n = total;
  }
};

// ---------------------------------------------------------------------------------------------
// Forward of one row: h (optional output), statistics, y.
// ---------------------------------------------------------------------------------------------
template <typename T, bool kResidual, bool kRms>
inline void forward_row(const T* x, const T* r, T* h_out, T* y, const float* w, const float* b, int64_t N,
                        float eps, float* mean_out, float* rstd_out) {
  const T* h = kResidual ? h_out : x;  // the normalised input, re-read from cache in pass 2
  const int64_t n_main = N - N % kStep;
  // Loads kStep elements (n < kStep: a zero-padded tail) of x, adds the residual, stores h.
  auto load_h = [&](int64_t j, int64_t n, Vec& ha, Vec& hb) {
    if (n == kStep) Io<T>::load(x + j, ha, hb);
    else Io<T>::load(x + j, n, ha, hb);
    if (kResidual) {
      Vec ra, rb;
      if (n == kStep) Io<T>::load(r + j, ra, rb);
      else Io<T>::load(r + j, n, ra, rb);
      Io<T>::add_round(ha, hb, ra, rb, ha, hb);
      if (n == kStep) Io<T>::store(h_out + j, ha, hb);
      else Io<T>::store(h_out + j, n, ha, hb);
    }
  };
  float rstd;  // from the double statistics, rounded once: dx scales with up to rstd^3, so each
               // float rounding of var + eps, sqrt and the division would show in the gradient
  // y = ((h - shift) - mean_from_shift) * rstd: h - shift is exact for h near a large common
  // offset, and mean_from_shift is small, so the mean's rounding to float costs nothing.
  float shift = 0.f, mean_from_shift = 0.f;
  // Pass 1: h = x + r and the statistics of h, in blocks of kBlock steps whose float sums are
  // added up in double.
  constexpr int64_t kBlock = 64;
  if (kRms) {
    // Float sums over 4 steps, added in double: a float sum of n near-equal squares errs by up to
    // ~n/2 roundings (over 64-step blocks, 4.5 units in the last place of dx for a row of 768
    // equal values, scaled up by a large rstd). Kahan's compensation cost 10-15% more time on rows
    // in cache.
    constexpr int64_t kSquaresBlock = 4;
    double sumsq = 0;
    int64_t j = 0;
    while (j < n_main) {
      const int64_t block_end = std::min(n_main, j + kSquaresBlock * kStep);
      Vec acc_a(0.f), acc_b(0.f);
      for (; j < block_end; j += kStep) {
        Vec ha, hb;
        load_h(j, kStep, ha, hb);
        acc_a = at::vec::fmadd(ha, ha, acc_a);
        acc_b = at::vec::fmadd(hb, hb, acc_b);
      }
      sumsq += lane_sum<double>(acc_a) + lane_sum<double>(acc_b);
    }
    if (j < N) {
      Vec ha, hb;
      load_h(j, N - j, ha, hb);
      sumsq += lane_sum(ha * ha + hb * hb);  // the padding lanes hold 0
    }
    rstd = static_cast<float>(1.0 / std::sqrt(sumsq / static_cast<double>(N) + eps));
  } else {
    // Sums of (h - s) and (h - s)^2 per block, s = the mean of the block's first kStep values:
    // the moments of values near 0, and (block mean - s)^2 / block variance, the cancellation
    // in M2 = S2 - S1^2 / n, stays below ~kBlock even for skewed rows. Blocks merge with Chan's
    // formula in double.
    Moments m;
    int64_t j = 0;
    while (j < n_main) {
      const int64_t block_begin = j, block_end = std::min(n_main, j + kBlock * kStep);
      Vec ha, hb;
      load_h(j, kStep, ha, hb);
      const float s = lane_sum(ha + hb) * (1.f / kStep);
      if (block_begin == 0) shift = s;
      const Vec vs(s);
      Vec s1a = ha - vs, s1b = hb - vs;
      Vec s2a = s1a * s1a, s2b = s1b * s1b;
      for (j += kStep; j < block_end; j += kStep) {
        load_h(j, kStep, ha, hb);
        const Vec da = ha - vs, db = hb - vs;
        s1a = s1a + da;
        s1b = s1b + db;
        s2a = at::vec::fmadd(da, da, s2a);
        s2b = at::vec::fmadd(db, db, s2b);
      }
      const double n = static_cast<double>(block_end - block_begin);
      const double s1 = lane_sum(s1a + s1b), s2 = lane_sum(s2a + s2b);
      m.merge(n, s + s1 / n, std::max(s2 - s1 * s1 / n, 0.0));
    }
    if (j < N) {
      Vec ha, hb;
      load_h(j, N - j, ha, hb);
      alignas(64) float tail[kStep];
      ha.store(tail);
      hb.store(tail + kVec);
      if (j == 0) shift = tail[0];
      for (int64_t i = 0; i < N - j; ++i) m.merge(1, tail[i], 0);
    }
    const double var = std::max(m.m2 / static_cast<double>(N), 0.0);
    *mean_out = static_cast<float>(m.mean);
    mean_from_shift = static_cast<float>(m.mean - shift);
    rstd = static_cast<float>(1.0 / std::sqrt(var + eps));
  }
  *rstd_out = rstd;

  // Pass 2: y = (h - shift) * rstd - mean_from_shift * rstd, then the affine.
  const Vec vscale(rstd), vshift(shift), voffset(-mean_from_shift * rstd);
  auto normalise = [&](int64_t j, Vec& ya, Vec& yb, const Vec& ha, const Vec& hb) {
    ya = at::vec::fmadd(ha - vshift, vscale, voffset);
    yb = at::vec::fmadd(hb - vshift, vscale, voffset);
    if (w != nullptr) {
      if (b != nullptr) {
        ya = at::vec::fmadd(ya, Vec::loadu(w + j), Vec::loadu(b + j));
        yb = at::vec::fmadd(yb, Vec::loadu(w + j + kVec), Vec::loadu(b + j + kVec));
      } else {
        ya = ya * Vec::loadu(w + j);
        yb = yb * Vec::loadu(w + j + kVec);
      }
    } else if (b != nullptr) {
      ya = ya + Vec::loadu(b + j);
      yb = yb + Vec::loadu(b + j + kVec);
    }
  };
  int64_t j = 0;
  for (; j < n_main; j += kStep) {
    Vec ha, hb, ya, yb;
    Io<T>::load(h + j, ha, hb);
    normalise(j, ya, yb, ha, hb);
    Io<T>::store(y + j, ya, yb);
  }
  if (j < N) {
    Vec ha, hb, ya, yb;
    Io<T>::load(h + j, N - j, ha, hb);
    normalise(j, ya, yb, ha, hb);  // w and b are padded to a multiple of kStep
    Io<T>::store(y + j, N - j, ya, yb);
  }
}

// ---------------------------------------------------------------------------------------------
// Backward of one row. dw_acc/db_acc (padded to kStep) receive dy * xhat and dy.
// ---------------------------------------------------------------------------------------------
// A row narrower than one step (16 or 32 elements), in double, its statistics recomputed from h:
// over a handful of elements dx = rstd (g - c_g - xhat c_gx) is a cancellation (over two, its terms
// nearly cancel), which turns the float roundings of rstd, g, xhat and the sums into several units
// in the last place of dx (fuzzed RMSNorm rows of two: 6x the error of the same equations in torch).
template <typename T, bool kRms>
inline void backward_narrow_row(const T* dy, const T* dh, const T* h, T* dx, const float* w, float eps, int64_t N,
                                float* dw_acc, float* db_acc) {
  double hv[kStep], g[kStep], mean = 0, var = 0, sum_g = 0, sum_gx = 0;
  for (int64_t j = 0; j < N; ++j) {
    hv[j] = static_cast<float>(h[j]);
    mean += hv[j];
  }
  mean = kRms ? 0.0 : mean / static_cast<double>(N);
  for (int64_t j = 0; j < N; ++j) var += (hv[j] - mean) * (hv[j] - mean);
  const double rstd = 1.0 / std::sqrt(var / static_cast<double>(N) + eps);
  for (int64_t j = 0; j < N; ++j) {
    const double d = static_cast<float>(dy[j]);
    hv[j] = (hv[j] - mean) * rstd;  // xhat
    g[j] = w != nullptr ? d * w[j] : d;
    sum_g += g[j];
    sum_gx += g[j] * hv[j];
    if (dw_acc != nullptr) dw_acc[j] += static_cast<float>(d * hv[j]);
    if (db_acc != nullptr) db_acc[j] += static_cast<float>(d);
  }
  const double c_gx = sum_gx / static_cast<double>(N), c_g = kRms ? 0.0 : sum_g / static_cast<double>(N);
  for (int64_t j = 0; j < N; ++j) {
    const double v = rstd * (g[j] - c_g - hv[j] * c_gx) + (dh != nullptr ? static_cast<float>(dh[j]) : 0.f);
    dx[j] = static_cast<T>(static_cast<float>(v));
  }
}

template <typename T, bool kRms>
inline void backward_row(const T* dy, const T* dh, const T* h, T* dx, const float* w, float mean, float rstd,
                         int64_t N, float eps, float* dw_acc, float* db_acc) {
  if (N < kStep) return backward_narrow_row<T, kRms>(dy, dh, h, dx, w, eps, N, dw_acc, db_acc);
  const int64_t n_main = N - N % kStep;
  const Vec vmean(mean), vrstd(rstd);
  // Pass 1: sum(g) and sum(g * xhat), plus the weight/bias gradient contributions.
  double sum_g = 0, sum_gx = 0;
  auto pass1 = [&](int64_t j, const Vec& dya, const Vec& dyb, const Vec& ha, const Vec& hb, Vec& sg, Vec& sgx) {
    const Vec xa = (ha - vmean) * vrstd, xb = (hb - vmean) * vrstd;
    Vec ga = dya, gb = dyb;
    if (w != nullptr) {
      ga = ga * Vec::loadu(w + j);
      gb = gb * Vec::loadu(w + j + kVec);
    }
    sg = sg + ga + gb;
    sgx = at::vec::fmadd(ga, xa, at::vec::fmadd(gb, xb, sgx));
    if (dw_acc != nullptr) {
      at::vec::fmadd(dya, xa, Vec::loadu(dw_acc + j)).store(dw_acc + j);
      at::vec::fmadd(dyb, xb, Vec::loadu(dw_acc + j + kVec)).store(dw_acc + j + kVec);
    }
    if (db_acc != nullptr) {
      (Vec::loadu(db_acc + j) + dya).store(db_acc + j);
      (Vec::loadu(db_acc + j + kVec) + dyb).store(db_acc + j + kVec);
    }
  };
  int64_t j = 0;
  while (j < n_main) {
    const int64_t block_end = std::min(n_main, j + 64 * kStep);
    Vec sg(0.f), sgx(0.f);
    for (; j < block_end; j += kStep) {
      Vec dya, dyb, ha, hb;
      Io<T>::load(dy + j, dya, dyb);
      Io<T>::load(h + j, ha, hb);
      pass1(j, dya, dyb, ha, hb, sg, sgx);
    }
    sum_g += lane_sum(sg);
    sum_gx += lane_sum(sgx);
  }
  if (j < N) {
    Vec dya, dyb, ha, hb, sg(0.f), sgx(0.f);
    Io<T>::load(dy + j, N - j, dya, dyb);  // padding: dy = 0, so it adds nothing anywhere
    Io<T>::load(h + j, N - j, ha, hb);
    pass1(j, dya, dyb, ha, hb, sg, sgx);
    sum_g += lane_sum(sg);
    sum_gx += lane_sum(sgx);
  }
  const float c_gx = static_cast<float>(sum_gx / static_cast<double>(N));
  const float c_g = kRms ? 0.f : static_cast<float>(sum_g / static_cast<double>(N));
  // Pass 2: dx = rstd * (g - c_g - xhat * c_gx) + dh.
  const Vec vgx(c_gx), vg(c_g);
  auto pass2 = [&](int64_t j, const Vec& dya, const Vec& dyb, const Vec& ha, const Vec& hb, Vec& dxa, Vec& dxb) {
    Vec ga = dya, gb = dyb;
    if (w != nullptr) {
      ga = ga * Vec::loadu(w + j);
      gb = gb * Vec::loadu(w + j + kVec);
    }
    const Vec xa = (ha - vmean) * vrstd, xb = (hb - vmean) * vrstd;
    dxa = at::vec::fnmadd(xa, vgx, ga - vg) * vrstd;
    dxb = at::vec::fnmadd(xb, vgx, gb - vg) * vrstd;
  };
  for (j = 0; j < n_main; j += kStep) {
    Vec dya, dyb, ha, hb, dxa, dxb;
    Io<T>::load(dy + j, dya, dyb);
    Io<T>::load(h + j, ha, hb);
    pass2(j, dya, dyb, ha, hb, dxa, dxb);
    if (dh != nullptr) {
      Vec da, db;
      Io<T>::load(dh + j, da, db);
      dxa = dxa + da;
      dxb = dxb + db;
    }
    Io<T>::store(dx + j, dxa, dxb);
  }
  if (j < N) {
    Vec dya, dyb, ha, hb, dxa, dxb;
    Io<T>::load(dy + j, N - j, dya, dyb);
    Io<T>::load(h + j, N - j, ha, hb);
    pass2(j, dya, dyb, ha, hb, dxa, dxb);
    if (dh != nullptr) {
      Vec da, db;
      Io<T>::load(dh + j, N - j, da, db);
      dxa = dxa + da;
      dxb = dxb + db;
    }
    Io<T>::store(dx + j, N - j, dxa, dxb);
  }
}

}  // namespace cpu_norm
}  // namespace transformer_fast
