// Softmax attention on the CPU, forward: the end of a row (its output and log-sum-exp from the
// online softmax's statistics, the sink included) and the decoding split (Flash-Decoding): when a
// problem has fewer (sequence, head group, query block) tasks than threads, or num_splits asks,
// each task's keys are cut into parts that threads run on their own, each leaving a partial
// (acc, m, l) per row; the parts are then merged in a fixed order, so the result does not depend
// on which thread ran which part.
#pragma once

#include "cpu_capability.h"  // first: selects at::vec's ISA

#include "attention.h"
#include "attention_softmax.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace transformer_fast {
namespace cpu_attention {

// A row's accumulator acc (Dv, sum of exp(s - m) v over its keys), running max m and sum l ->
// out = acc / (l + exp(sink - m)) and lse = log(sum exp(s) + exp(sink)) (sink -inf: none), both
// taken against max(m, sink) so that neither term overflows. A row with no allowed key (m = -inf)
// gives 0 and lse = sink, or +inf without a sink. acc is scaled in place; returns lse.
inline float finish_row(float m, float l, float* acc, int64_t Dv, float sink) {
  if (l == 0.f) {  // no allowed key (NaN goes on: a NaN score makes the row NaN, as it should)
    std::fill(acc, acc + Dv, 0.f);
    return sink == kNegInf ? kInf : sink;
  }
  if (sink == kNegInf) {
    scale_row(acc, Dv, 1.f / l);
    return m + std::log(l);
  }
  const float top = std::max(m, sink), keys = std::exp(m - top), total = l * keys + std::exp(sink - top);
  scale_row(acc, Dv, keys / total);
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
    pt.acc_storage = at::empty({tasks * parts * rows * std::max<int64_t>(Dv, 1)}, options);
    pt.stats_storage = at::empty({tasks * parts * rows * 2}, options);
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
