// The vectorised row operations of the CPU softmax-attention kernels (attention_forward.cpp,
// attention_backward.cpp): the softmax's exp, row max and sums, the gradient's dS and delta, and
// fp32 rows rounded to bf16/fp16. Each works on one row; the tiles, masks and tile products are
// attention_tiles.h's.
#pragma once

#include "cpu/cpu_capability.h"  // first: selects at::vec's ISA

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define TRANSFORMER_FAST_NATIVE_BF16_CONVERT 1
#endif
#endif

namespace transformer_fast {
namespace cpu_attention {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Two float vectors -> 2 * Vec::size() values of T at out (bf16/fp16, rounded to nearest even).
// Where the CPU has AVX512-BF16, bf16 takes one instruction (vcvtne2ps2bf16; it flushes
// denormals, which only changes values below 1e-38); at::vec's conversion otherwise rounds with
// integer arithmetic, about six instructions, which perf showed as a fifth of the bf16 softmax.
template <typename T>
inline void store_converted(const Vec& lo, const Vec& hi, T* out) {
#if defined(TRANSFORMER_FAST_NATIVE_BF16_CONVERT)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    _mm512_storeu_si512(out, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(__m512(hi), __m512(lo))));
    return;
  }
#endif
  at::vec::convert_from_float<T>(lo, hi).store(out);
}

template <typename T>
inline void convert_row(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    constexpr int64_t kStep = 2 * Vec::size();
    int64_t c = 0;
    for (; c + kStep <= n; c += kStep) {
      store_converted(Vec::loadu(src + c), Vec::loadu(src + c + Vec::size()), dst + c);
    }
    for (; c < n; ++c) dst[c] = static_cast<T>(src[c]);
  }
}

// exp(x) for the softmax, to within 1 ulp, and 0 where the result would be below 2^-126 (as
// at::vec's exp_u20, measured at up to 3 ulp). With AVX-512: n = round(x / ln 2), r = x - n ln 2
// (ln 2 in two parts, so r is exact to ~1e-10), e^r from its Taylor polynomial of degree 7 (error
// below 1e-8 for |r| <= ln(2) / 2), scaled by 2^n with vscalefps: 14 instructions against
// exp_u20's 19, and the exp pass is most of the bf16 forward's own time. -inf gives 0; NaN stays
// NaN (a NaN input must show in the output, not vanish as a zero probability).
inline Vec exp_softmax(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 xv = x;
  const __m512 t = _mm512_max_ps(_mm512_set1_ps(-151.f), _mm512_mul_ps(xv, _mm512_set1_ps(1.44269504088896341f)));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xv);  // ln 2's first 16 bits: n * it is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  // Denormal results would take microcode assists (slow): 0 instead. (NaN compares unordered:
  // kept.)
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(n, _mm512_set1_ps(-126.f), _CMP_NLT_UQ), p, n);
#else
  return Vec::blendv(x.exp_u20(), x, x.isnan());  // exp_u20 makes NaN inf
#endif
}

inline float row_max(const float* x, int64_t n) {
  // Four independent maxima: one chain of dependent vector max ops is latency-bound. The tail in
  // (partial) vectors as well, its missing lanes -inf.
  auto vmax = [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); };
  Vec m0(kNegInf), m1(kNegInf), m2(kNegInf), m3(kNegInf);
  int64_t c = 0;
  for (; c + 4 * Vec::size() <= n; c += 4 * Vec::size()) {
    m0 = vmax(m0, Vec::loadu(x + c));
    m1 = vmax(m1, Vec::loadu(x + c + Vec::size()));
    m2 = vmax(m2, Vec::loadu(x + c + 2 * Vec::size()));
    m3 = vmax(m3, Vec::loadu(x + c + 3 * Vec::size()));
  }
  for (; c < n; c += Vec::size()) {
    const int64_t rest = std::min<int64_t>(Vec::size(), n - c);
    m0 = vmax(m0, Vec::set(Vec(kNegInf), Vec::loadu(x + c, rest), rest));
  }
  const Vec all = vmax(vmax(m0, m1), vmax(m2, m3));
  return at::vec::vec_reduce_all<float>([&](Vec& a, Vec& b) { return vmax(a, b); }, all);
}

// out <- exp(x * mult - shift) (out may be x, or a bf16/fp16 row); returns the sum of the fp32
// values. mult folds the softmax scale into the exponent where the tile product left it out.
template <typename T>
inline float exp_shift_sum(const float* x, int64_t n, float mult, float shift, T* out) {
  constexpr int64_t kStep = 2 * Vec::size();  // a bf16/fp16 vector holds two float vectors
  int64_t c = 0;
  Vec acc(0.f);
  const Vec vmult(mult), vshift(shift);
  for (; c + kStep <= n; c += kStep) {
    const Vec e0 = exp_softmax(at::vec::fmsub(Vec::loadu(x + c), vmult, vshift));
    const Vec e1 = exp_softmax(at::vec::fmsub(Vec::loadu(x + c + Vec::size()), vmult, vshift));
    if constexpr (std::is_same_v<T, float>) {
      e0.store(out + c);
      e1.store(out + c + Vec::size());
    } else {
      store_converted(e0, e1, out + c);
    }
    acc = acc + e0 + e1;
  }
  // The tail in partial vectors (a scalar std::exp loop here took 8% of a 304-key bf16 forward),
  // with the lanes past the row kept out of the sum.
  for (; c < n; c += Vec::size()) {
    const int64_t rest = std::min<int64_t>(Vec::size(), n - c);
    const Vec e = Vec::set(Vec(0.f), exp_softmax(at::vec::fmsub(Vec::loadu(x + c, rest), vmult, vshift)), rest);
    if constexpr (std::is_same_v<T, float>) {
      e.store(out + c, rest);
    } else {
      at::vec::convert_from_float<T>(e, Vec(0.f)).store(out + c, rest);
    }
    acc = acc + e;
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
}

// a . b in fp32 with a vector of partial sums: its rounding error grows like n / 16 rather than n,
// as does that of dP, the BLAS product it is subtracted from in dS = P * (dP - delta). Where one
// key takes a row's whole probability, dP and delta are the same number in exact arithmetic, and
// a sequential sum here measurably raised the fp32 dQ error over the reference's.
template <typename T>
inline float dot_fp32(const T* a, const T* b, int64_t n) {
  Vec acc(0.f);
  int64_t c = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; c + Vec::size() <= n; c += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + c), Vec::loadu(b + c), acc);
  } else {
    using VecT = at::vec::Vectorized<T>;
    for (; c + VecT::size() <= n; c += VecT::size()) {
      auto [a0, a1] = at::vec::convert_to_float<T>(VecT::loadu(a + c));
      auto [b0, b1] = at::vec::convert_to_float<T>(VecT::loadu(b + c));
      acc = at::vec::fmadd(a1, b1, at::vec::fmadd(a0, b0, acc));
    }
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; c < n; ++c) sum += static_cast<float>(a[c]) * static_cast<float>(b[c]);
  return sum;
}

// dp <- p * (dp - delta), and exactly 0 where p == 0 (masked keys: dp may hold garbage there).
inline void ds_from_dp(const float* s, float* dp, int64_t n, float delta) {
  int64_t c = 0;
  const Vec vdelta(delta), zero(0.f);
  for (; c + Vec::size() <= n; c += Vec::size()) {
    const Vec pv = Vec::loadu(s + c);
    const Vec ds = pv * (Vec::loadu(dp + c) - vdelta);
    Vec::blendv(ds, zero, pv == zero).store(dp + c);
  }
  for (; c < n; ++c) dp[c] = s[c] == 0.f ? 0.f : s[c] * (dp[c] - delta);
}

// delta = sum_j P_j dP_j over a row's keys (0 terms where p == 0: dp may hold garbage there), in
// fp32 with a vector of partial sums. Where a row's keys fit one tile, this replaces dO . O: with O
// rounded to bf16/fp16, dO . O misses sum_j P_j dP_j by that rounding, which dominates dS where
// one key takes nearly all of a row's probability (dP_j and delta then nearly cancel).
inline float delta_from_tile(const float* s, const float* dp, int64_t n) {
  Vec acc(0.f);
  const Vec zero(0.f);
  int64_t c = 0;
  for (; c + Vec::size() <= n; c += Vec::size()) {
    const Vec pv = Vec::loadu(s + c);
    acc = acc + Vec::blendv(pv * Vec::loadu(dp + c), zero, pv == zero);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; c < n; ++c) sum += s[c] == 0.f ? 0.f : s[c] * dp[c];
  return sum;
}

// A row whose keys all lie in one tile: its P = exp(S - lse) sum to 1 - P_sink (P_sink = exp(sink -
// lse), 0 without a sink) but for the rounding of lse to fp32 (and of the forward's sum inside it),
// a factor 1 + e common to the row, |e| up to about |lse| 2^-24: at scales of 1-3 over a few keys
// (|lse| ~ 50) that made fp32 dQ 3x torch's error. A sum within that factor of its target is
// scaled to the target; a sum further off is left as it is. P_sink carries the same factor, which
// the scaling leaves as e P_sink / (1 - P_sink): where the sink takes more than half of the row,
// the row is left as it is.
inline void renormalize_row(float* s, int64_t n, float lse, float sink) {
  if (!std::isfinite(lse)) return;  // a row with no allowed key: P = 0
  // The sum with Kahan's compensation in each lane (a row's P sum to 1 with a few near 1: a plain
  // float sum would add back up to n / 8 roundings of 2^-24), the lanes then added in double.
  Vec sum_v(0.f), lost(0.f);
  int64_t c = 0;
  for (; c + Vec::size() <= n; c += Vec::size()) {
    const Vec y = Vec::loadu(s + c) - lost;
    const Vec t = sum_v + y;
    lost = (t - sum_v) - y;
    sum_v = t;
  }
  alignas(64) float lanes[Vec::size()], lanes_lost[Vec::size()];
  sum_v.store(lanes);
  lost.store(lanes_lost);
  double sum = 0;
  for (int64_t i = 0; i < Vec::size(); ++i) sum += static_cast<double>(lanes[i]) - lanes_lost[i];
  for (; c < n; ++c) sum += s[c];
  const double sink_share = sink == kNegInf ? 0.0 : std::exp(static_cast<double>(sink) - lse);
  if (!(sink_share <= 0.5)) return;
  const double target = 1.0 - sink_share;
  const double bound = (std::abs(static_cast<double>(lse)) + static_cast<double>(n) + 4.0) * 0x1p-23;
  if (sum == target || !(std::abs(sum / target - 1.0) <= bound)) return;
  const Vec factor(static_cast<float>(target / sum));
  at::vec::map([factor](Vec x) { return x * factor; }, s, s, n);
}

// s <- P = exp(s * mult - lse) and dp <- dS = P * (dp - delta), for a row with no masked key.
inline void p_and_ds(float* s, float* dp, int64_t n, float mult, float lse, float delta) {
  const Vec vmult(mult), vlse(lse), vdelta(delta);
  int64_t c = 0;
  for (; c + Vec::size() <= n; c += Vec::size()) {
    const Vec pv = exp_softmax(at::vec::fmsub(Vec::loadu(s + c), vmult, vlse));
    pv.store(s + c);
    (pv * (Vec::loadu(dp + c) - vdelta)).store(dp + c);
  }
  if (c < n) {  // the tail as a partial vector, as at::vec::map does
    const int64_t rest = n - c;
    const Vec pv = exp_softmax(at::vec::fmsub(Vec::loadu(s + c, rest), vmult, vlse));
    pv.store(s + c, rest);
    (pv * (Vec::loadu(dp + c, rest) - vdelta)).store(dp + c, rest);
  }
}

inline void scale_row(float* x, int64_t n, float s) {
  at::vec::map([s](Vec a) { return a * Vec(s); }, x, x, n);
}

}  // namespace cpu_attention
}  // namespace transformer_fast
