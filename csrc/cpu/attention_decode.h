// Softmax attention on the CPU, forward: what decoding (few query rows, many keys) needs beyond
// the tiles. The value product of a few rows, reading each value row once; the end of a row (its
// output and log-sum-exp from the online softmax's statistics, the sink included); and the key
// split (Flash-Decoding): when a problem has fewer (sequence, head group, query block) tasks than
// threads, or num_splits asks, each task's keys are cut into parts that threads run on their
// own, each leaving a partial (acc, m, l) per row; the parts are then merged in a fixed order,
// so the result does not depend on which thread ran which part.
#pragma once

#include "cpu/cpu_capability.h"  // first: selects at::vec's ISA

#include "cpu/attention_softmax.h"
#include "cpu/cpu_blas.h"
#include "ops/attention_problem.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>

namespace transformer_fast {
namespace cpu_attention {

// ---- acc (R x Dv) += P (R x n, fp32, leading dimension ldP) V for a few rows R, V given by its
// rows v[c] (any addresses: a paged cache needs no gather). MKL packs V for every such product,
// which cost it three times its multiplications (perf, fp32 decoding, 4 rows x 512 keys); here
// each value row is loaded once per group of up to kValueRows rows (from memory the first time,
// from cache after), in strips of two float vectors per row. Each output sums its terms in
// chunks of cpu_blas::kChunk keys in registers, each chunk then added to acc (error growing like
// kChunk + n / kChunk, as cpu_blas's few-rows products), with P in fp32 (not rounded to the
// inputs' dtype). Keys whose colsum is 0 (no row uses them) are skipped: they may hold garbage.
// (Measured alone, one thread, 4 rows against 262k value rows of 128 floats: strip by strip over
// a whole 512-key tile, 51-57 ms; chunk by chunk, 43-50 ms; with the prefetch, 40-46 ms.)
constexpr int64_t kValueRows = 4;    // rows per pass over the values
constexpr int64_t kFewValueRows = 8;  // up to this many rows take this product

template <typename T>
inline void load_strip(const T* src, int64_t count, Vec& lo, Vec& hi) {
  constexpr int64_t V = Vec::size();
  if constexpr (std::is_same_v<T, float>) {
    lo = count >= V ? Vec::loadu(src) : Vec::loadu(src, count);
    hi = count >= 2 * V ? Vec::loadu(src + V) : count > V ? Vec::loadu(src + V, count - V) : Vec(0.f);
  } else {
    using VecT = at::vec::Vectorized<T>;  // 2 * V elements
    const VecT x = count >= 2 * V ? VecT::loadu(src) : VecT::loadu(src, count);
    std::tie(lo, hi) = at::vec::convert_to_float<T>(x);
  }
}

// One chunk of up to kChunk keys [c0, c1) into ROWS rows of acc, for the strip of `count`
// columns from d0.
template <int ROWS, typename T>
void value_chunk(const float* P, int64_t ldP, const T* const* v, int64_t c0, int64_t c1, const float* colsum,
                 int64_t d0, int64_t count, float* acc, int64_t ldacc) {
  constexpr int64_t V = Vec::size();
  Vec lo[ROWS], hi[ROWS];
  for (int i = 0; i < ROWS; ++i) lo[i] = hi[i] = Vec(0.f);
  for (int64_t c = c0; c < c1; ++c) {
    if (colsum != nullptr && colsum[c] == 0.f) continue;
    Vec va, vb;
    load_strip(v[c] + d0, count, va, vb);
    for (int i = 0; i < ROWS; ++i) {
      const Vec p(P[i * ldP + c]);
      lo[i] = at::vec::fmadd(p, va, lo[i]);
      hi[i] = at::vec::fmadd(p, vb, hi[i]);
    }
  }
  for (int i = 0; i < ROWS; ++i) {
    float* a = acc + i * ldacc + d0;
    const int64_t n_lo = std::min(count, V), n_hi = count - n_lo;
    (Vec::loadu(a, n_lo) + lo[i]).store(a, n_lo);
    if (n_hi > 0) (Vec::loadu(a + V, n_hi) + hi[i]).store(a + V, n_hi);
  }
}

// Chunk by chunk of keys (a chunk's value rows stay in L1 for every strip and row group, and the
// next chunk's rows are prefetched meanwhile), strip by strip, up to kValueRows rows at a time.
template <typename T>
void rows_times_values(const float* P, int64_t ldP, int64_t R, const T* const* v, int64_t n, const float* colsum,
                       int64_t Dv, float* acc) {
  constexpr int64_t W = 2 * Vec::size(), kChunk = cpu_blas::kChunk;
  const int64_t row_bytes = Dv * static_cast<int64_t>(sizeof(T));
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t c1 = std::min(n, c0 + kChunk);
    for (int64_t c = c1; c < std::min(n, c1 + kChunk); ++c) {
      for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(reinterpret_cast<const char*>(v[c]) + byte);
    }
    for (int64_t r0 = 0; r0 < R; r0 += kValueRows) {
      const float* p = P + r0 * ldP;
      float* a = acc + r0 * Dv;
      for (int64_t d0 = 0; d0 < Dv; d0 += W) {
        const int64_t count = std::min(W, Dv - d0);
        switch (std::min(kValueRows, R - r0)) {
          case 4: value_chunk<4>(p, ldP, v, c0, c1, colsum, d0, count, a, Dv); break;
          case 3: value_chunk<3>(p, ldP, v, c0, c1, colsum, d0, count, a, Dv); break;
          case 2: value_chunk<2>(p, ldP, v, c0, c1, colsum, d0, count, a, Dv); break;
          default: value_chunk<1>(p, ldP, v, c0, c1, colsum, d0, count, a, Dv); break;
        }
      }
    }
  }
}

// A row's accumulator acc (Dv, sum of exp(s - m) v over its kept keys), running max m and sum l ->
// out = out_scale * acc / (l + exp(sink - m)) and lse = log(sum exp(s) + exp(sink)) (sink -inf:
// none), both taken against max(m, sink) so that neither term overflows; out_scale is dropout's
// 1 / (1 - p). A row with no allowed key (m = -inf) gives 0 and lse = sink, or +inf without a
// sink. acc is scaled in place; returns lse.
inline float finish_row(float m, float l, float* acc, int64_t Dv, float sink, float out_scale) {
  if (sink == kInf) {  // a +inf sink takes the whole row: out 0, lse +inf (exp(sink - top) would be NaN)
    std::fill(acc, acc + Dv, 0.f);
    return kInf;
  }
  if (l == 0.f) {  // no allowed key (NaN goes on: a NaN score makes the row NaN, as it should)
    std::fill(acc, acc + Dv, 0.f);
    return sink == kNegInf ? kInf : sink;
  }
  if (sink == kNegInf) {
    scale_row(acc, Dv, out_scale / l);
    return m + std::log(l);
  }
  const float top = std::max(m, sink), keys = std::exp(m - top), total = l * keys + std::exp(sink - top);
  scale_row(acc, Dv, out_scale * keys / total);
  return top + std::log(total);
}

// How many parts each task's keys are cut into: num_splits (at most that many; 1: none), or,
// for 0, enough for every thread to have two parts when there are fewer tasks than threads,
// each part at least kMinSplitKeys keys (a tile) long.
constexpr int64_t kMinSplitKeys = 512;

inline int64_t key_parts(int64_t num_splits, int64_t tasks, int64_t max_keys, int64_t align) {
  const int64_t units = std::max<int64_t>(1, (max_keys + align - 1) / align);
  if (num_splits >= 1) return std::min(num_splits, units);
  const int64_t threads = at::get_num_threads();
  if (tasks <= 0 || tasks >= threads) return 1;
  const int64_t wanted = (2 * threads + tasks - 1) / tasks;
  const int64_t longest = std::max<int64_t>(1, max_keys / std::max(align, kMinSplitKeys));
  return std::clamp<int64_t>(std::min(wanted, longest), 1, units);
}

// Part `part` of `parts` of the keys [start, end), in whole multiples of `align` from start.
inline std::pair<int64_t, int64_t> part_range(int64_t start, int64_t end, int64_t align, int64_t part,
                                              int64_t parts) {
  if (end <= start) return {start, start};
  const int64_t units = (end - start + align - 1) / align;
  const int64_t lo = start + units * part / parts * align, hi = start + units * (part + 1) / parts * align;
  return {std::min(lo, end), std::min(hi, end)};
}

// The partial results of the parts: per (task, part, row) an accumulator of Dv floats and (m, l).
struct Partials {
  at::Tensor acc_storage, stats_storage;
  int64_t parts = 1, rows = 0, Dv = 0;
  float* acc(int64_t task, int64_t part, int64_t row) const {
    return acc_storage.data_ptr<float>() + ((task * parts + part) * rows + row) * Dv;
  }
  float* stats(int64_t task, int64_t part, int64_t row) const {
    return stats_storage.data_ptr<float>() + ((task * parts + part) * rows + row) * 2;
  }
};

inline Partials make_partials(int64_t tasks, int64_t parts, int64_t rows, int64_t Dv) {
  Partials pt;
  pt.parts = parts;
  pt.rows = rows;
  pt.Dv = Dv;
  if (parts > 1) {
    const auto options = at::TensorOptions().dtype(at::kFloat);
    pt.acc_storage = new_tensor({tasks * parts * rows * std::max<int64_t>(Dv, 1)}, options);
    pt.stats_storage = new_tensor({tasks * parts * rows * 2}, options);
  }
  return pt;
}

// Merges row `row` of task `task` over its parts, in part order, into acc (Dv); returns (m, l).
inline std::pair<float, float> merge_parts(const Partials& pt, int64_t task, int64_t row, float* acc) {
  float m = kNegInf;
  for (int64_t s = 0; s < pt.parts; ++s) m = std::max(m, pt.stats(task, s, row)[0]);
  std::fill(acc, acc + pt.Dv, 0.f);
  float l = 0.f;
  for (int64_t s = 0; s < pt.parts; ++s) {
    const float* st = pt.stats(task, s, row);
    if (st[1] == 0.f) continue;  // a part with no allowed key
    const float w = m == kNegInf ? 1.f : std::exp(st[0] - m);
    l += st[1] * w;
    const float* a = pt.acc(task, s, row);
    for (int64_t d = 0; d < pt.Dv; ++d) acc[d] += w * a[d];
  }
  return {m, l};
}

}  // namespace cpu_attention
}  // namespace transformer_fast
