// LayerNorm / RMSNorm with the residual add fused in, forward and backward, on CPU.
//
// Forward, per row: one pass over x (and the residual) writes h = x + residual and gathers the
// statistics; a second pass over h, which is still in L1/L2, writes y. Statistics are float32
// sums of values shifted near 0 within blocks of 1024 elements, blocks merged in double (Chan et
// al.), so a large common offset (mean 1e4, small variance) loses nothing to cancellation
// (RMSNorm: float32 sums of squares over 4 steps, added in double).
// Backward, per row: one pass gathers sum(g) and sum(g * xhat) (g = dy * weight) and the
// weight/bias gradient contributions; a second pass over the cached row writes dx. dweight/dbias
// are summed into one float32 buffer per block of rows, then reduced in block order: the result
// is deterministic for a fixed thread count. Within a block, rows are summed in chunks of
// kSumChunk, each chunk's sums added to the block's as it ends with Kahan's compensation, so a
// column's rounding error grows with kSumChunk, not with the block's thousands of rows (plain
// adds of the chunks gave 2.7x torch's error over 6,000 rows in one block).

// The code below is written for any Vec::size().
#include "cpu_capability.h"  // first: selects at::vec's ISA

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "op_utils.h"
#include "ops.h"

namespace transformer_fast {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVec = Vec::size();
constexpr int64_t kStep = 2 * kVec;  // elements per step: one Vectorized<BFloat16/Half>, two of float
constexpr int64_t kSumChunk = 64;    // rows per chunk of the weight/bias gradient sums

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

// weight/bias as float32 contiguous, zero-padded to a multiple of kStep (empty if absent).
at::Tensor padded_float(const std::optional<at::Tensor>& t, int64_t N, const char* name) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  TORCH_CHECK(t->dim() == 1 && t->size(0) == N, "layer_norm: ", name, " must have shape (", N, ",), got ",
              t->sizes());
  TORCH_CHECK(t->device().is_cpu(), "layer_norm: ", name, " must be a CPU tensor, got ", t->device());
  // Used in place when no padding or conversion is needed: the zero-fill and copy cost ~12 us per
  // parameter, which on 8 x 512 rows was most of the call (docs/design.md).
  if (N % kStep == 0 && t->scalar_type() == at::kFloat && t->is_contiguous()) return *t;
  const int64_t padded = (N + kStep - 1) / kStep * kStep;
  at::Tensor out = new_zeros({padded}, t->options().dtype(at::kFloat));
  out.narrow(0, 0, N).copy_(*t);
  return out;
}

void check_rows(const at::Tensor& t, const char* name, int64_t M, int64_t N, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == M && t.size(1) == N, "layer_norm: ", name, " must have shape (", M,
              ", ", N, "), got ", t.sizes());
  TORCH_CHECK(t.device().is_cpu(), "layer_norm: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "layer_norm: ", name, " must have dtype ", dtype, ", got ",
              t.scalar_type());
  // Without rows nothing is read (an empty tensor counts as contiguous whatever its strides).
  TORCH_CHECK(M == 0 || N <= 1 || t.stride(1) == 1, "layer_norm: ", name,
              " must have unit stride along the row, got strides ", t.strides());
}

// The (rows, width) matrix of a (..., width) tensor: a view where the leading dims flatten, else a copy.
at::Tensor rows_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 1, "layer_norm: ", name, " must have at least one dimension");
  return t.dim() == 2 ? t : t.reshape({-1, t.size(-1)});
}

// Rows per parallel task: at least ~32K elements, so narrow rows are not scheduled one by one.
int64_t row_grain(int64_t N) { return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(N, 1)); }

template <typename T, bool kResidual, bool kRms>
void forward_impl(const at::Tensor& x, const at::Tensor& r, const at::Tensor& h, const at::Tensor& y,
                  const at::Tensor& w, const at::Tensor& b, const at::Tensor& mean, const at::Tensor& rstd,
                  double eps) {
  const int64_t M = x.size(0), N = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  const T* rp = kResidual ? r.const_data_ptr<T>() : nullptr;
  T* hp = kResidual ? h.data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  const float* wp = w.defined() ? w.const_data_ptr<float>() : nullptr;
  const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
  float* meanp = kRms ? nullptr : mean.data_ptr<float>();
  float* rstdp = rstd.data_ptr<float>();
  const int64_t sx = x.stride(0), sr = kResidual ? r.stride(0) : 0, sh = kResidual ? h.stride(0) : 0,
                sy = y.stride(0);
  at::parallel_for(0, M, row_grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      forward_row<T, kResidual, kRms>(xp + i * sx, kResidual ? rp + i * sr : nullptr,
                                      kResidual ? hp + i * sh : nullptr, yp + i * sy, wp, bp, N,
                                      static_cast<float>(eps), kRms ? nullptr : meanp + i, rstdp + i);
    }
  });
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

template <typename T, bool kRms>
void backward_impl(const at::Tensor& dy, const at::Tensor& dh, const at::Tensor& h, const at::Tensor& w,
                   const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& dx, at::Tensor& dw_partial,
                   at::Tensor& db_partial, const at::Tensor& chunk_sums, int64_t num_blocks, float eps) {
  const int64_t M = h.size(0), N = h.size(1);
  const int64_t padded = (N + kStep - 1) / kStep * kStep;
  const T* dyp = dy.const_data_ptr<T>();
  const T* dhp = dh.defined() ? dh.const_data_ptr<T>() : nullptr;
  const T* hp = h.const_data_ptr<T>();
  T* dxp = dx.data_ptr<T>();
  const float* wp = w.defined() ? w.const_data_ptr<float>() : nullptr;
  const float* meanp = kRms ? nullptr : mean.const_data_ptr<float>();
  const float* rstdp = rstd.const_data_ptr<float>();
  float* dwp = dw_partial.defined() ? dw_partial.data_ptr<float>() : nullptr;
  float* dbp = db_partial.defined() ? db_partial.data_ptr<float>() : nullptr;
  const int64_t sdy = dy.stride(0), sdh = dh.defined() ? dh.stride(0) : 0, sh = h.stride(0), sdx = dx.stride(0);
  float* chunks = chunk_sums.defined() ? chunk_sums.data_ptr<float>() : nullptr;  // (num_blocks, 4, padded)
  // Block k owns rows [k*M/num_blocks, (k+1)*M/num_blocks), partial-sum row k and chunk rows 4k..4k+3
  // (dw's and db's chunk sums, then their compensations).
  at::parallel_for(0, num_blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    for (int64_t k = block_begin; k < block_end; ++k) {
      const int64_t row_begin = k * M / num_blocks, row_end = (k + 1) * M / num_blocks;
      float* dw_acc = dwp != nullptr ? dwp + k * padded : nullptr;
      float* db_acc = dbp != nullptr ? dbp + k * padded : nullptr;
      const bool chunked = chunks != nullptr && row_end - row_begin > kSumChunk;
      float* dw_chunk = chunked && dw_acc != nullptr ? chunks + 4 * k * padded : nullptr;
      float* db_chunk = chunked && db_acc != nullptr ? chunks + (4 * k + 1) * padded : nullptr;
      float* compensation = chunked ? chunks + (4 * k + 2) * padded : nullptr;  // dw's, then db's
      if (chunked) std::fill_n(compensation, 2 * padded, 0.f);
      for (int64_t c = row_begin; c < row_end; c += kSumChunk) {
        if (dw_chunk != nullptr) std::fill_n(dw_chunk, padded, 0.f);
        if (db_chunk != nullptr) std::fill_n(db_chunk, padded, 0.f);
        for (int64_t i = c; i < std::min(row_end, c + kSumChunk); ++i) {
          backward_row<T, kRms>(dyp + i * sdy, dhp != nullptr ? dhp + i * sdh : nullptr, hp + i * sh,
                                dxp + i * sdx, wp, kRms ? 0.f : meanp[i], rstdp[i], N, eps,
                                dw_chunk != nullptr ? dw_chunk : dw_acc, db_chunk != nullptr ? db_chunk : db_acc);
        }
        for (auto [acc, chunk, lost] : {std::tuple{dw_acc, dw_chunk, compensation},
                                        std::tuple{db_acc, db_chunk, compensation + padded}}) {
          if (chunk == nullptr) continue;
          for (int64_t j = 0; j < padded; j += kVec) {  // Kahan: acc += chunk, carrying what rounding lost
            const Vec sum = Vec::loadu(acc + j), add = Vec::loadu(chunk + j) - Vec::loadu(lost + j);
            const Vec next = sum + add;
            ((next - sum) - add).store(lost + j);
            next.store(acc + j);
          }
        }
      }
    }
  });
}

#define LN_DISPATCH_TYPES(TYPE, NAME, ...)                                                            \
  [&] {                                                                                              \
    switch (TYPE) {                                                                                  \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }                             \
      case at::kBFloat16: { using scalar_t = at::BFloat16; return __VA_ARGS__(); }                   \
      case at::kHalf: { using scalar_t = at::Half; return __VA_ARGS__(); }                           \
      default: TORCH_CHECK(false, NAME, ": unsupported dtype ", TYPE, " (float32, bfloat16, float16)"); \
    }                                                                                                \
  }()

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(
    const at::Tensor& x_in, const std::optional<at::Tensor>& residual_in, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool is_rms) {
  const at::Tensor x = rows_of(x_in, "x");
  const std::optional<at::Tensor> residual =
      residual_in.has_value() && residual_in->defined() ? std::optional<at::Tensor>(rows_of(*residual_in, "residual"))
                                                        : std::nullopt;
  const int64_t M = x.size(0), N = x.size(1);
  TORCH_CHECK(N >= 1, "layer_norm_forward: the row width must be >= 1");
  check_rows(x, "x", M, N, x.scalar_type());
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual) check_rows(*residual, "residual", M, N, x.scalar_type());
  TORCH_CHECK(!(is_rms && bias.has_value() && bias->defined()), "layer_norm_forward: RMSNorm takes no bias");
  const at::Tensor w = padded_float(weight, N, "weight"), b = padded_float(bias, N, "bias");
  const auto opts = x.options();
  at::Tensor y = new_output({M, N}, opts);
  at::Tensor h = has_residual ? new_output({M, N}, opts) : at::Tensor();
  at::Tensor mean = is_rms ? at::Tensor() : new_output({M}, opts.dtype(at::kFloat));
  at::Tensor rstd = new_output({M}, opts.dtype(at::kFloat));
  const at::Tensor r = has_residual ? *residual : at::Tensor();
  LN_DISPATCH_TYPES(x.scalar_type(), "layer_norm_forward", [&] {
    if (has_residual) {
      if (is_rms) forward_impl<scalar_t, true, true>(x, r, h, y, w, b, mean, rstd, eps);
      else forward_impl<scalar_t, true, false>(x, r, h, y, w, b, mean, rstd, eps);
    } else {
      if (is_rms) forward_impl<scalar_t, false, true>(x, r, h, y, w, b, mean, rstd, eps);
      else forward_impl<scalar_t, false, false>(x, r, h, y, w, b, mean, rstd, eps);
    }
  });
  if (x_in.dim() == 2) return {y, h, mean, rstd};
  return {y.view(x_in.sizes()), has_residual ? h.view(x_in.sizes()) : h, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& dy_in, const std::optional<at::Tensor>& dh_in, const at::Tensor& h_in,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& mean, const at::Tensor& rstd, double eps, bool is_rms) {
  (void)eps;
  const at::Tensor h = rows_of(h_in, "h"), dy = rows_of(dy_in, "dy");
  const std::optional<at::Tensor> dh =
      dh_in.has_value() && dh_in->defined() ? std::optional<at::Tensor>(rows_of(*dh_in, "dh")) : std::nullopt;
  const int64_t M = h.size(0), N = h.size(1);
  TORCH_CHECK(N >= 1, "layer_norm_backward: the row width must be >= 1");
  check_rows(h, "h", M, N, h.scalar_type());
  check_rows(dy, "dy", M, N, h.scalar_type());
  const bool has_dh = dh.has_value() && dh->defined();
  if (has_dh) check_rows(*dh, "dh", M, N, h.scalar_type());
  TORCH_CHECK(rstd.dim() == 1 && rstd.size(0) == M && rstd.scalar_type() == at::kFloat,
              "layer_norm_backward: rstd must be a float32 (", M, ",) tensor, got ", rstd.scalar_type(), " ",
              rstd.sizes());
  at::Tensor mean_c;
  if (!is_rms) {
    TORCH_CHECK(mean.has_value() && mean->defined() && mean->dim() == 1 && mean->size(0) == M &&
                    mean->scalar_type() == at::kFloat,
                "layer_norm_backward: mean must be a float32 (", M, ",) tensor");
    mean_c = mean->contiguous();
  }
  const at::Tensor rstd_c = rstd.contiguous();
  const at::Tensor w = padded_float(weight, N, "weight");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "layer_norm_backward: bias must have shape (", N, ",)");
  }
  const int64_t padded = (N + kStep - 1) / kStep * kStep;
  // A block of rows per thread, but at least ~32K elements per block: for small inputs a parallel
  // region costs more than the work.
  const int64_t num_blocks =
      std::max<int64_t>(1, std::min<int64_t>({M, at::get_num_threads(), M * N / (int64_t{1} << 15)}));
  const auto fopts = h.options().dtype(at::kFloat);
  // One block of rows that needs no padding: the kernel sums dweight/dbias straight into the
  // results (on tiny inputs the select/narrow views of a partial buffer were ~10% of the call).
  const bool direct = num_blocks == 1 && padded == N;
  auto partial_sums = [&](bool needed) {
    if (!needed) return at::Tensor();
    return direct ? new_zeros({N}, fopts) : new_zeros({num_blocks, padded}, fopts);
  };
  at::Tensor dw_partial = partial_sums(w.defined());
  at::Tensor db_partial = partial_sums(has_bias);
  const bool chunked = (w.defined() || has_bias) && (M + num_blocks - 1) / num_blocks > kSumChunk;
  const at::Tensor chunk_sums = chunked ? new_tensor({num_blocks, 4, padded}, fopts) : at::Tensor();
  at::Tensor dx = new_output({M, N}, h.options());
  const at::Tensor dh_t = has_dh ? *dh : at::Tensor();
  LN_DISPATCH_TYPES(h.scalar_type(), "layer_norm_backward", [&] {
    if (is_rms) backward_impl<scalar_t, true>(dy, dh_t, h, w, mean_c, rstd_c, dx, dw_partial, db_partial, chunk_sums,
                                                num_blocks, static_cast<float>(eps));
    else backward_impl<scalar_t, false>(dy, dh_t, h, w, mean_c, rstd_c, dx, dw_partial, db_partial, chunk_sums,
                                        num_blocks, static_cast<float>(eps));
  });
  // Final reduce over the blocks, in block order (one block: its row is the sum).
  auto reduce = [&](const at::Tensor& partial, at::ScalarType dtype) {
    if (direct) return partial.scalar_type() == dtype ? partial : partial.to(dtype);
    if (num_blocks == 1) return partial[0].narrow(0, 0, N).to(dtype);
    at::Tensor total = new_tensor({N}, fopts);
    const float* p = partial.const_data_ptr<float>();
    float* t = total.data_ptr<float>();
    at::parallel_for(0, N, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) t[j] = p[j];
      for (int64_t k = 1; k < num_blocks; ++k) {
        const float* row = p + k * padded;
        for (int64_t j = begin; j < end; ++j) t[j] += row[j];
      }
    });
    return total.to(dtype);
  };
  at::Tensor dweight, dbias;
  if (w.defined()) dweight = reduce(dw_partial, weight->scalar_type());
  if (has_bias) dbias = reduce(db_partial, bias->scalar_type());
  return {h_in.dim() == 2 ? dx : dx.view(h_in.sizes()), dweight, dbias};
}

}  // namespace transformer_fast

namespace transformer_fast {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool is_rms) {
  auto [y, h, mean, rstd] = layer_norm_forward(x, residual, weight, bias, eps, is_rms);
  return {y, or_empty(h, x), or_empty(mean, rstd), rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cpu(
    const at::Tensor& dy, const std::optional<at::Tensor>& dh, const at::Tensor& h,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& mean,
    const at::Tensor& rstd, double eps, bool is_rms) {
  auto [dx, dweight, dbias] = layer_norm_backward(dy, dh, h, weight, bias, is_rms ? std::nullopt : std::optional(mean),
                                                  rstd, eps, is_rms);
  return {dx, or_empty(dweight, h), or_empty(dbias, h)};
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fast, CPU, m) {
  m.impl("layer_norm_forward", &layer_norm_forward_cpu);
  m.impl("layer_norm_backward", &layer_norm_backward_cpu);
}

}  // namespace transformer_fast
