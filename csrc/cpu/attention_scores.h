// Softmax attention on the CPU: what is done to a tile of scores between the product and the
// softmax, shared by the forward and the backward (attention_forward.cpp, attention_backward.cpp)
// so that both compute every score alike. Soft-capping, ALiBi, the masks and the band of keys a
// row may attend (causal, sliding window); the key range a block of query rows needs and the
// query rows a block of keys serves; the scores of few query rows made one dot product at a time.
#pragma once

#include "cpu/cpu_capability.h"  // first: selects at::vec's ISA

#include "cpu/attention_softmax.h"
#include "ops/attention_problem.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace transformer_fast {
namespace cpu_attention {

constexpr int64_t kUnbounded = std::numeric_limits<int64_t>::max() / 4;

// ---- The band of keys a query row may attend, in its sequence's coordinates: keys j with
// lo(i) <= j <= hi(i), both nondecreasing in i (bottom-right aligned window, moved by the query
// offset; top-left causal).
struct Band {
  int64_t shift, left, right;  // shift = Nk - Nq + query_offset; left/right: kUnbounded where unbounded
  bool causal;
  int64_t lo(int64_t i) const { return left == kUnbounded ? -kUnbounded : i + shift - left; }
  int64_t hi(int64_t i) const {
    const int64_t h = right == kUnbounded ? kUnbounded : i + shift + right;
    return causal ? std::min(h, i) : h;
  }
};

inline Band band_of(const Problem& p, int64_t nq, int64_t nk) {
  return {nk - nq + p.query_offset, p.window_left >= 0 ? p.window_left : kUnbounded,
          p.window_right >= 0 ? p.window_right : kUnbounded, p.causal};
}

// Keys [lo, hi) that some row of [i0, i1) may attend, within [0, nk) (empty: hi <= lo).
inline std::pair<int64_t, int64_t> key_range(const Band& band, int64_t i0, int64_t i1, int64_t nk) {
  return {std::max<int64_t>(0, band.lo(i0)), std::min<int64_t>(nk, band.hi(i1 - 1) + 1)};
}

// Query rows [lo, hi) that may attend some key of [j0, j1), within [0, nq).
inline std::pair<int64_t, int64_t> row_range(const Band& band, int64_t j0, int64_t j1, int64_t nq) {
  int64_t lo = 0, hi = nq;
  if (band.right != kUnbounded) lo = std::max(lo, j0 - band.shift - band.right);
  if (band.causal) lo = std::max(lo, j0);
  if (band.left != kUnbounded) hi = std::min(hi, j1 - 1 - band.shift + band.left + 1);
  return {lo, hi};
}

// ---- Key padding (dense problems): per batch, the running count of padded keys, so that the
// status of any key range and the first and last unpadded key are found in O(1).
enum : uint8_t { kNoPadding = 0, kSomePadding = 1, kAllPadding = 2 };

struct Padding {
  std::vector<int32_t> count;  // (B, Nk + 1): padded keys before j
  std::vector<int32_t> first, last;  // per batch: first unpadded key, last + 1 (first >= last: none)
  int64_t Nk = 0;
  bool any = false;
  uint8_t status(int64_t b, int64_t j0, int64_t j1) const {
    if (!any) return kNoPadding;
    const int32_t* c = count.data() + b * (Nk + 1);
    const int64_t padded = c[j1] - c[j0];
    return padded == 0 ? kNoPadding : padded == j1 - j0 ? kAllPadding : kSomePadding;
  }
  // Keys [j0, j1) hold some padding: where it all trails the sequence's last unpadded key (right
  // padding), the unpadded keys j0 .. that key; else j1 - j0 (padding to mask).
  int64_t unpadded_prefix(int64_t b, int64_t j0, int64_t j1) const {
    const int64_t end = last[b];
    return end > j0 && end < j1 && status(b, j0, end) == kNoPadding ? end - j0 : j1 - j0;
  }
};

inline Padding padding_of(const Problem& p) {
  Padding pad;
  if (p.pad == nullptr || p.packed()) return pad;
  pad.any = true;
  pad.Nk = p.Nk;
  pad.count.resize(p.B * (p.Nk + 1));
  pad.first.assign(p.B, static_cast<int32_t>(p.Nk));
  pad.last.assign(p.B, 0);
  for (int64_t b = 0; b < p.B; ++b) {
    int32_t* c = pad.count.data() + b * (p.Nk + 1);
    c[0] = 0;
    for (int64_t j = 0; j < p.Nk; ++j) {
      const bool padded = p.pad[b * p.Nk + j];
      c[j + 1] = c[j] + padded;
      if (!padded) {
        pad.first[b] = std::min<int32_t>(pad.first[b], static_cast<int32_t>(j));
        pad.last[b] = static_cast<int32_t>(j + 1);
      }
    }
  }
  return pad;
}

// ---- Score transforms. Every element goes through the same vector code (the tail as a
// partial vector), so a score comes out the same whichever tile and position it is computed in.
template <typename Fn>
inline void map_row(float* x, int64_t n, Fn fn) {
  int64_t c = 0;
  for (; c + Vec::size() <= n; c += Vec::size()) fn(Vec::loadu(x + c), c).store(x + c);
  if (c < n) fn(Vec::loadu(x + c, n - c), c).store(x + c, n - c);
}

// s <- cap * tanh(s / cap); tanh_out (when given) keeps tanh(s / cap) for the backward.
inline void softcap_row(float* s, int64_t n, float cap, float* tanh_out) {
  const Vec vcap(cap);
  int64_t c = 0;
  auto step = [&](int64_t count) {
    const Vec t = (Vec::loadu(s + c, count) / vcap).tanh();
    if (tanh_out != nullptr) t.store(tanh_out + c, count);
    (t * vcap).store(s + c, count);
  };
  for (; c + Vec::size() <= n; c += Vec::size()) step(Vec::size());
  if (c < n) step(n - c);
}

// s[c] -= slope * |distance0 - c| (ALiBi; distance0 = i + shift - j0 for the row's first key).
inline void alibi_row(float* s, int64_t n, float slope, int64_t distance0) {
  const Vec vslope(slope), base(static_cast<float>(distance0)), lanes = Vec::arange(0.f, 1.f);
  map_row(s, n, [&](Vec x, int64_t c) {
    const Vec d = (base - (lanes + Vec(static_cast<float>(c)))).abs();
    return x - vslope * d;
  });
}

template <typename mask_t>
void add_float_mask(const Problem& p, float* S, int64_t ldS, int64_t bm, int64_t bn, const mask_t* base,
                    int64_t i0, int64_t j0) {
  for (int64_t r = 0; r < bm; ++r) {
    const mask_t* m = base + (i0 + r) * p.msm + j0 * p.msn;
    float* s = S + r * ldS;
    if (p.msn == 1) {
      for (int64_t c = 0; c < bn; ++c) s[c] += static_cast<float>(m[c]);
    } else {
      for (int64_t c = 0; c < bn; ++c) s[c] += static_cast<float>(m[c * p.msn]);
    }
  }
}

// Where a tile of scores sits: sequence b, head h, rows i0.. and keys j0.. of the sequence.
struct TilePlace {
  int64_t b, h, i0, j0;
};

// The scaled score tile S (bm x bn) -> the final scores: soft-capping (tanh_tile, when given,
// keeps tanh(s / cap) per element, leading dimension ldS), ALiBi, the float attn_mask added,
// then -inf wherever the key is not allowed (bool mask, band, padding), which overwrites whatever
// a garbage key or mask value produced. Returns whether any position may have been masked.
template <typename scalar_t>
bool transform_scores(const Problem& p, const Band& band, float* S, int64_t ldS, int64_t bm, int64_t bn,
                      const TilePlace& at, uint8_t pad_status, float* tanh_tile) {
  if (p.softcap > 0.f) {
    for (int64_t r = 0; r < bm; ++r) {
      softcap_row(S + r * ldS, bn, p.softcap, tanh_tile != nullptr ? tanh_tile + r * ldS : nullptr);
    }
  }
  if (p.alibi != nullptr) {
    const float slope = p.alibi[at.b * p.alibi_sb + at.h * p.alibi_sh];
    for (int64_t r = 0; r < bm; ++r) alibi_row(S + r * ldS, bn, slope, at.i0 + r + band.shift - at.j0);
  }
  bool masked = false;
  if (p.mask != nullptr) {
    masked = true;
    const int64_t off = at.b * p.msb + at.h * p.msh;
    if (p.mask_is_bool) {
      const bool* base = static_cast<const bool*>(p.mask) + off;
      for (int64_t r = 0; r < bm; ++r) {
        const bool* m = base + (at.i0 + r) * p.msm + at.j0 * p.msn;
        float* s = S + r * ldS;
        for (int64_t c = 0; c < bn; ++c) s[c] = m[c * p.msn] ? s[c] : kNegInf;
      }
    } else if (p.mask_is_float32) {
      add_float_mask(p, S, ldS, bm, bn, static_cast<const float*>(p.mask) + off, at.i0, at.j0);
    } else {
      add_float_mask(p, S, ldS, bm, bn, static_cast<const scalar_t*>(p.mask) + off, at.i0, at.j0);
    }
  }
  // The band: lo and hi grow with the row, so the tile lies inside it iff its last row's lo and
  // its first row's hi do.
  const int64_t j1 = at.j0 + bn - 1;
  if (band.lo(at.i0 + bm - 1) > at.j0 || band.hi(at.i0) < j1) {
    masked = true;
    for (int64_t r = 0; r < bm; ++r) {
      float* s = S + r * ldS;
      const int64_t lo = std::clamp<int64_t>(band.lo(at.i0 + r) - at.j0, 0, bn);
      const int64_t hi = std::clamp<int64_t>(band.hi(at.i0 + r) - at.j0 + 1, lo, bn);
      std::fill(s, s + lo, kNegInf);
      std::fill(s + hi, s + bn, kNegInf);
    }
  }
  if (pad_status == kSomePadding) {
    masked = true;
    const bool* pad = p.pad + at.b * p.Nk + at.j0;
    for (int64_t r = 0; r < bm; ++r) {
      float* s = S + r * ldS;
      for (int64_t c = 0; c < bn; ++c) s[c] = pad[c] ? kNegInf : s[c];
    }
  }
  return masked;
}

// dS (the final scores' gradient, written out as dmask first) -> the raw scores' gradient through
// the soft-capping: dS * (1 - tanh^2), and exactly 0 where dS is (masked keys: tanh may be NaN).
inline void softcap_gradient_row(float* ds, const float* t, int64_t n) {
  const Vec one(1.f), zero(0.f);
  int64_t c = 0;
  auto step = [&](int64_t count) {
    const Vec g = Vec::loadu(ds + c, count), tv = Vec::loadu(t + c, count);
    Vec::blendv(g * (one - tv * tv), zero, g == zero).store(ds + c, count);
  };
  for (; c + Vec::size() <= n; c += Vec::size()) step(Vec::size());
  if (c < n) step(n - c);
}

// ---- Scores of a few query rows, one dot product at a time: S[r][c] = scale * (q_r . k_c), each
// a sum of Vec::size() lane-wise partial sums over the head dim, reduced in a fixed order. A
// score's value depends on its two rows only (not on the tile or how many rows are made
// together), so the forward can stack the query rows of all the heads that share a key head
// (decoding with GQA) and the backward still recomputes every score exactly. The query rows are
// fp32 (bf16/fp16 converted exactly beforehand); key rows of bf16/fp16 are converted in chunks.
constexpr int64_t kRowwiseMaxRows = 16;  // query rows per sequence, with GQA (score_path)

inline float reduce_add(Vec v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// 2 rows x 4 keys at a time (8 accumulators), the keys outer, so that a group of 4 key rows is
// loaded from memory once and stays in L1 for every row pair; the leftovers one at a time. Each
// element's partial sums come from the same loads and FMAs in the same order either way.
inline Vec dot_partial_sums(const float* q, const float* k, int64_t D) {
  constexpr int64_t V = Vec::size();
  Vec acc(0.f);
  int64_t d = 0;
  for (; d + V <= D; d += V) acc = at::vec::fmadd(Vec::loadu(q + d), Vec::loadu(k + d), acc);
  if (d < D) acc = at::vec::fmadd(Vec::loadu(q + d, D - d), Vec::loadu(k + d, D - d), acc);
  return acc;
}

inline void dot_rows_fp32(const float* const* q, int64_t R, const float* const* k, int64_t n, int64_t D,
                          float scale, float* S, int64_t ldS) {
  constexpr int64_t V = Vec::size();
  const int64_t Dv = D - D % V, tail = D - Dv;
  int64_t c = 0;
  for (; c + 4 <= n; c += 4) {
    int64_t r = 0;
    for (; r + 2 <= R; r += 2) {
      Vec acc[2][4];
      for (auto& row : acc) for (auto& a : row) a = Vec(0.f);
      for (int64_t d = 0; d < Dv; d += V) {
        const Vec q0 = Vec::loadu(q[r] + d), q1 = Vec::loadu(q[r + 1] + d);
        for (int64_t t = 0; t < 4; ++t) {
          const Vec kv = Vec::loadu(k[c + t] + d);
          acc[0][t] = at::vec::fmadd(q0, kv, acc[0][t]);
          acc[1][t] = at::vec::fmadd(q1, kv, acc[1][t]);
        }
      }
      if (tail) {
        const Vec q0 = Vec::loadu(q[r] + Dv, tail), q1 = Vec::loadu(q[r + 1] + Dv, tail);
        for (int64_t t = 0; t < 4; ++t) {
          const Vec kv = Vec::loadu(k[c + t] + Dv, tail);
          acc[0][t] = at::vec::fmadd(q0, kv, acc[0][t]);
          acc[1][t] = at::vec::fmadd(q1, kv, acc[1][t]);
        }
      }
      for (int64_t t = 0; t < 4; ++t) {
        S[r * ldS + c + t] = reduce_add(acc[0][t]) * scale;
        S[(r + 1) * ldS + c + t] = reduce_add(acc[1][t]) * scale;
      }
    }
    for (; r < R; ++r) {
      for (int64_t t = 0; t < 4; ++t) S[r * ldS + c + t] = reduce_add(dot_partial_sums(q[r], k[c + t], D)) * scale;
    }
  }
  for (; c < n; ++c) {
    for (int64_t r = 0; r < R; ++r) S[r * ldS + c] = reduce_add(dot_partial_sums(q[r], k[c], D)) * scale;
  }
}

// S (R x n) = scale * Q K^T for fp32 query rows q[r] and key rows k[c] of scalar_t; key_float:
// scratch for kRowwiseChunk converted key rows of D floats.
constexpr int64_t kRowwiseChunk = 16;

template <typename scalar_t>
void rowwise_scores(const float* const* q, int64_t R, const scalar_t* const* k, int64_t n, int64_t D, float scale,
                    float* S, int64_t ldS, float* key_float) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    dot_rows_fp32(q, R, k, n, D, scale, S, ldS);
  } else {
    const float* rows[kRowwiseChunk];
    for (int64_t c0 = 0; c0 < n; c0 += kRowwiseChunk) {
      const int64_t m = std::min(kRowwiseChunk, n - c0);
      for (int64_t c = 0; c < m; ++c) {
        at::vec::convert(k[c0 + c], key_float + c * D, D);
        rows[c] = key_float + c * D;
      }
      dot_rows_fp32(q, R, rows, m, D, scale, S + c0, ldS);
    }
  }
}

}  // namespace cpu_attention
}  // namespace transformer_fast
