// What the CPU (cpu/attention_forward.cpp, cpu/attention_backward.cpp) and CUDA (cuda/attention_cuda.cu)
// softmax-attention kernels share: their entry points' common part, the
// description of a problem, and the dropout mask, which both regenerate from the same hash (so a
// seed drops the same probabilities on either device).
#pragma once

#include "ops/attention_extras.h"
#include "ops/new_tensors.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <cmath>
#include <cstdint>
#include <optional>

#if defined(__CUDACC__)
#define TF_HOST_DEVICE __host__ __device__
#else
#define TF_HOST_DEVICE
#endif

namespace transformer_fast {

// SplitMix64's finalizer: a bijective 64-bit mix.
TF_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Dropout with no stored mask: whether key j survives for query row i of head bh is a hash of
// (seed, bh * Nq + i, j), so the backward regenerates the forward's keep mask.
struct Dropout {
  float p = 0.f;
  float inv_keep = 1.f;
  uint32_t threshold = 0;  // keep iff the 24-bit hash >= threshold
  uint64_t seed = 0;
  TF_HOST_DEVICE bool active() const { return p > 0.f; }
  TF_HOST_DEVICE uint64_t row_key(int64_t bh, int64_t Nq, int64_t i) const { return row_key(bh * Nq + i); }
  // The key of the row whose log-sum-exp is lse[index] (dense: bh * Nq + i; packed: h * Tq + row).
  TF_HOST_DEVICE uint64_t row_key(int64_t lse_index) const {
    return mix64(seed ^ mix64(static_cast<uint64_t>(lse_index) + 0x632BE59BD9B4E019ULL));
  }
  // Whether key j is kept for the row of `key`.
  TF_HOST_DEVICE bool kept(uint64_t key, int64_t j) const {
    const uint64_t h = mix64(key + static_cast<uint64_t>(j) * 0x9E3779B97F4A7C15ULL);
    return static_cast<uint32_t>(h >> 40) >= threshold;
  }
  // inv_keep if key j is kept for the row of `key`, else 0.
  TF_HOST_DEVICE float factor(uint64_t key, int64_t j) const { return kept(key, j) ? inv_keep : 0.f; }
  // For c in [0, n): `value` if key j0 + c is kept for the row of `key`, else 0.
  void factors(uint64_t key, int64_t j0, int64_t n, float value, float* out) const {
    for (int64_t c = 0; c < n; ++c) out[c] = kept(key, j0 + c) ? value : 0.f;
  }
};

// Everything about the problem that the forward and backward share; the pointers are on the
// tensors' device. Dense problems (the only ones the CUDA kernels take) have B sequences of Nq
// queries and Nk keys each. Packed ones (cu_seq_q set; CPU only) have B sequences of their own
// lengths, laid out one after another in (rows, heads, width) tensors: Nq and Nk are then the
// longest lengths, and the per-sequence accessors below give each one's rows.
struct Problem {
  int64_t B, H, Hk, Nq, Nk, D, Dv;
  bool causal;
  float scale;
  // attn_mask: (B, H, Nq, Nk) view, element strides; nullptr when absent. A float mask has the
  // query's dtype or float32 (which torch's SDPA also accepts with a half-precision query).
  const void* mask = nullptr;
  bool mask_is_bool = false;
  bool mask_is_float32 = false;
  int64_t msb = 0, msh = 0, msm = 0, msn = 0;
  // key padding: (B, Nk), 1 = padded; nullptr when absent.
  const bool* pad = nullptr;
  Dropout dropout;

  // Sliding window (-1: unbounded side), aligned to the bottom right of each sequence and moved
  // by query_offset: query i sits at key position i + Nk - Nq + query_offset (ALiBi's too).
  int64_t window_left = -1, window_right = -1;
  int64_t query_offset = 0;
  float softcap = 0.f;             // 0: none
  const float* alibi = nullptr;    // (B, H) slopes, strides alibi_sb, alibi_sh
  int64_t alibi_sb = 0, alibi_sh = 0;
  const float* sinks = nullptr;    // (H,)
  // Packed sequences: cu_seq_q (B + 1) offsets of each sequence's query rows; cu_seq_k those of
  // its key rows (nullptr with a paged cache); seqused_k (B) the keys each uses (nullptr: all).
  // Paged cache: key j of sequence b is row j % page_size of page block_table[b * pages_per_seq +
  // j / page_size]. Tq: the rows of q (lse is (H, Tq)).
  const int32_t* cu_seq_q = nullptr;
  const int32_t* cu_seq_k = nullptr;
  const int32_t* seqused_k = nullptr;
  const int32_t* block_table = nullptr;
  int64_t pages_per_seq = 0, page_size = 0, Tq = 0;
  int64_t num_splits = 0;  // 0: the kernel chooses; 1: never split a row's keys; n: at most n parts

  bool packed() const { return cu_seq_q != nullptr; }
  bool paged() const { return block_table != nullptr; }
  int64_t q_start(int64_t b) const { return packed() ? cu_seq_q[b] : 0; }
  int64_t q_len(int64_t b) const { return packed() ? cu_seq_q[b + 1] - cu_seq_q[b] : Nq; }
  int64_t k_start(int64_t b) const { return cu_seq_k != nullptr ? cu_seq_k[b] : 0; }
  int64_t k_len(int64_t b) const {
    if (!packed()) return Nk;
    if (seqused_k != nullptr) return seqused_k[b];
    return cu_seq_k[b + 1] - cu_seq_k[b];
  }
  // The index of row i of head h of sequence b in lse (dense (B, H, Nq); packed (H, Tq)), which
  // also keys its dropout.
  int64_t lse_index(int64_t b, int64_t h, int64_t i) const {
    return packed() ? h * Tq + cu_seq_q[b] + i : (b * H + h) * Nq + i;
  }
  bool has_window() const { return window_left >= 0 || window_right >= 0; }
  // Scores need the scale applied before anything else is done to them (not folded into exp).
  bool transforms_scores() const { return softcap > 0.f || alibi != nullptr; }
};

// A unit stride along the last dim (any stride is fine when it has size 1).
inline at::Tensor unit_last_stride(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

// The (B, Nk) key padding mask, contiguous, or an undefined tensor when there is none.
inline at::Tensor padding_mask_contiguous(const std::optional<at::Tensor>& key_padding_mask) {
  if (!key_padding_mask.has_value() || !key_padding_mask->defined()) return at::Tensor();
  TORCH_CHECK(key_padding_mask->scalar_type() == at::kBool, "key_padding_mask must be bool");
  return key_padding_mask->contiguous();
}

// Drops each probability with chance p (the threshold on a 24-bit hash rounds p up to a multiple
// of 2^-24), scaling the kept ones by 1 / (1 - p).
inline Dropout make_dropout(double p, int64_t seed) {
  Dropout d;
  d.p = static_cast<float>(p);
  if (p > 0) {
    d.inv_keep = static_cast<float>(1.0 / (1.0 - p));
    d.threshold = static_cast<uint32_t>(std::min(std::ceil(p * 16777216.0), 16777216.0));
    d.seed = mix64(static_cast<uint64_t>(seed));
  }
  return d;
}

// The problem of q (B, H, Nq, D), k (B, Hk, Nk, D), v (B, Hk, Nk, Dv), attn_mask a (B, H, Nq, Nk)
// view or none, pad_contig a contiguous (B, Nk) bool tensor or undefined.
inline Problem make_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::optional<at::Tensor>& attn_mask, const at::Tensor& pad_contig,
                            bool is_causal, double scale, double dropout_p, int64_t seed) {
  Problem p;
  p.B = q.size(0);
  p.H = q.size(1);
  p.Nq = q.size(2);
  p.D = q.size(3);
  p.Hk = k.size(1);
  p.Nk = k.size(2);
  p.Dv = v.size(3);
  p.causal = is_causal;
  p.scale = static_cast<float>(scale);
  if (attn_mask.has_value() && attn_mask->defined()) {
    const at::Tensor& m = *attn_mask;
    TORCH_CHECK(m.dim() == 4 && m.size(0) == p.B && m.size(1) == p.H && m.size(2) == p.Nq && m.size(3) == p.Nk,
                "attn_mask must be a (B, H, Nq, Nk) = (", p.B, ", ", p.H, ", ", p.Nq, ", ", p.Nk,
                ") view, got shape ", m.sizes());
    TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == q.scalar_type() || m.scalar_type() == at::kFloat,
                "attn_mask must be bool, float32 or have the query's dtype ", q.scalar_type(), ", got ",
                m.scalar_type());
    TORCH_CHECK(m.device() == q.device(), "attn_mask must be on the query's device ", q.device(), ", got ", m.device());
    p.mask = m.data_ptr();
    p.mask_is_bool = m.scalar_type() == at::kBool;
    p.mask_is_float32 = m.scalar_type() == at::kFloat;
    p.msb = m.stride(0);
    p.msh = m.stride(1);
    p.msm = m.stride(2);
    p.msn = m.stride(3);
  }
  if (pad_contig.defined()) {
    TORCH_CHECK(pad_contig.dim() == 2 && pad_contig.size(0) == p.B && pad_contig.size(1) == p.Nk,
                "key_padding_mask must have shape (B, Nk) = (", p.B, ", ", p.Nk, "), got ", pad_contig.sizes());
    TORCH_CHECK(pad_contig.device() == q.device(), "key_padding_mask must be on the query's device ", q.device(),
                ", got ", pad_contig.device());
    p.pad = pad_contig.data_ptr<bool>();
  }
  p.dropout = make_dropout(dropout_p, seed);
  return p;
}

// dS, the float attn_mask's gradient, zero-filled (the kernels write it only where they visit),
// in the mask's dtype: the query's, or float32 (a float32 mask keeps a float32 gradient).
inline at::Tensor new_dmask(const Problem& p, const at::Tensor& q) {
  const auto dtype = p.mask_is_float32 ? at::kFloat : q.scalar_type();
  return at::zeros({p.B, p.H, p.Nq, p.Nk}, q.options().dtype(dtype));
}

inline void check_shape(const char* fn, const char* name, const at::Tensor& t, at::IntArrayRef expected) {
  TORCH_CHECK_VALUE(t.sizes() == expected, fn, ": ", name, " must have shape ", expected, ", got ", t.sizes());
}

// q (B, H, Nq, D), k (B, Hk, Nk, D), v (B, Hk, Nk, Dv) of one dtype on one `device`; Hk divides H
// (or H = 0).
inline void check_inputs(const char* fn, c10::DeviceType device, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v) {
  TORCH_CHECK(q.device().type() == device && k.device() == q.device() && v.device() == q.device(), fn,
              ": q, k, v must be on one ", c10::DeviceTypeName(device), " device, got ", q.device(), ", ", k.device(),
              ", ", v.device());
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, fn, ": q, k, v must be 4-D");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), fn,
              ": q, k, v must share a dtype");
  // The kernels read k and v by these sizes: a mismatch would read past the tensors.
  check_shape(fn, "k", k, {q.size(0), k.size(1), k.size(2), q.size(3)});
  check_shape(fn, "v", v, {q.size(0), k.size(1), k.size(2), v.size(3)});
  TORCH_CHECK_VALUE(q.size(1) == 0 || (k.size(1) > 0 && q.size(1) % k.size(1) == 0), fn, ": key heads (",
                    k.size(1), ") must divide query heads (", q.size(1), ")");
}

// The entry points of every device (cpu/attention_forward.cpp, cpu/attention_backward.cpp,
// cuda/attention_cuda.cu) share their checks, normalised inputs, outputs and empty problems;
// `launch(p, q, k, v, out, lse)` runs the device's kernels on a non-empty problem.
//
// Empty problems need no kernel: with no query rows (B, H or Nq = 0) out and lse are empty; with
// no keys every row has none allowed, so out = 0 and lse = +inf, as for a fully masked row. A head
// dim of 0 goes through the kernels, whose products over it are 0: D = 0 makes every score 0 (the
// masks still apply), so each row averages the values of its allowed keys; Dv = 0 leaves out empty
// and lse each row's log-sum-exp.
template <typename Launch>
std::tuple<at::Tensor, at::Tensor> attention_forward_entry(
    c10::DeviceType device, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
    double scale, double dropout_p, int64_t seed, Launch launch) {
  check_inputs("attention_forward", device, q_in, k_in, v_in);
  const at::Tensor q = unit_last_stride(q_in), k = unit_last_stride(k_in), v = unit_last_stride(v_in);
  const at::Tensor pad = padding_mask_contiguous(key_padding_mask);
  const Problem p = make_problem(q, k, v, attn_mask, pad, is_causal, scale, dropout_p, seed);
  at::Tensor out = new_output_in_rows_of(q_in, p.Dv, q.options());
  at::Tensor lse = new_output({p.B, p.H, p.Nq}, q.options().dtype(at::kFloat));
  if (p.B * p.H * p.Nq == 0) return {out, lse};
  if (p.Nk == 0) {
    out.zero_();
    lse.fill_(std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  launch(p, q, k, v, out, lse);
  return {out, lse};
}

// `launch(p, dout, q, k, v, out, lse, dq, dk, dv, dmask)` runs the device's kernels on a non-empty
// problem; dmask (the score gradient dS) is undefined unless compute_dmask.
template <typename Launch>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_entry(
    c10::DeviceType device, const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
    double scale, double dropout_p, int64_t seed, bool compute_dmask, Launch launch) {
  check_inputs("attention_backward", device, q_in, k_in, v_in);
  const int64_t B = q_in.size(0), H = q_in.size(1), Nq = q_in.size(2), Dv = v_in.size(3);
  check_shape("attention_backward", "dout", dout_in, {B, H, Nq, Dv});
  check_shape("attention_backward", "out", out_in, {B, H, Nq, Dv});
  check_shape("attention_backward", "lse", lse_in, {B, H, Nq});
  TORCH_CHECK(dout_in.device() == q_in.device() && out_in.device() == q_in.device() &&
                  lse_in.device() == q_in.device(),
              "attention_backward: dout, out and lse must be on q's device ", q_in.device());
  const at::Tensor q = unit_last_stride(q_in), k = unit_last_stride(k_in), v = unit_last_stride(v_in);
  const at::Tensor dout = unit_last_stride(dout_in.to(q.scalar_type()));
  const at::Tensor out = unit_last_stride(out_in.to(q.scalar_type()));
  const at::Tensor lse = lse_in.to(at::kFloat).contiguous();
  const at::Tensor pad = padding_mask_contiguous(key_padding_mask);
  const Problem p = make_problem(q, k, v, attn_mask, pad, is_causal, scale, dropout_p, seed);
  at::Tensor dq = new_output_in_rows_of(q_in, p.D, q.options());
  at::Tensor dk = new_output_in_rows_of(k_in, p.D, k.options());
  at::Tensor dv = new_output_in_rows_of(v_in, p.Dv, v.options());
  // The kernels skip key blocks that are all padded or above the causal diagonal.
  at::Tensor dmask = compute_dmask ? new_dmask(p, q) : at::Tensor();
  if (p.Nq == 0 || p.Nk == 0 || p.B * p.H == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv, dmask};
  }
  launch(p, dout, q, k, v, out, lse, dq, dk, dv, dmask);
  return {dq, dk, dv, dmask};
}

}  // namespace transformer_fast
