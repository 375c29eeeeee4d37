// What the CPU (attention.cpp) and CUDA (attention_cuda.cu) softmax-attention kernels share: the
// description of a problem, and the dropout mask, which both regenerate from the same hash (so a
// seed drops the same probabilities on either device).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
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
  TF_HOST_DEVICE uint64_t row_key(int64_t bh, int64_t Nq, int64_t i) const {
    return mix64(seed ^ mix64(static_cast<uint64_t>(bh * Nq + i) + 0x632BE59BD9B4E019ULL));
  }
  // inv_keep if key j is kept for the row of `key`, else 0.
  TF_HOST_DEVICE float factor(uint64_t key, int64_t j) const {
    const uint64_t h = mix64(key + static_cast<uint64_t>(j) * 0x9E3779B97F4A7C15ULL);
    return static_cast<uint32_t>(h >> 40) >= threshold ? inv_keep : 0.f;
  }
  // factor(key, j0 + c) for c in [0, n).
  void factors(uint64_t key, int64_t j0, int64_t n, float* out) const {
    for (int64_t c = 0; c < n; ++c) out[c] = factor(key, j0 + c);
  }
};

// Everything about the problem that the forward and backward share; the pointers are on the
// tensors' device.
struct Problem {
  int64_t B, H, Hk, Nq, Nk, D, Dv;
  bool causal;
  float scale;
  // attn_mask: (B, H, Nq, Nk) view, element strides; nullptr when absent.
  const void* mask = nullptr;
  bool mask_is_bool = false;
  int64_t msb = 0, msh = 0, msm = 0, msn = 0;
  // key padding: (B, Nk), 1 = padded; nullptr when absent.
  const bool* pad = nullptr;
  Dropout dropout;
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
    TORCH_CHECK(m.scalar_type() == at::kBool || m.scalar_type() == q.scalar_type(),
                "attn_mask must be bool or have the query's dtype ", q.scalar_type(), ", got ", m.scalar_type());
    TORCH_CHECK(m.device() == q.device(), "attn_mask must be on the query's device ", q.device(), ", got ", m.device());
    p.mask = m.data_ptr();
    p.mask_is_bool = m.scalar_type() == at::kBool;
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

#if defined(TRANSFORMER_FAST_WITH_CUDA)
// attention_cuda.cu. q, k, v (and dout, out) have a unit last-dim stride; out, lse, dq, dk, dv are
// contiguous, allocated by the caller; dmask is undefined, or (B, H, Nq, Nk) contiguous and
// zero-filled, for dS.
void attention_fwd_cuda(const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        at::Tensor& out, at::Tensor& lse);
void attention_bwd_cuda(const Problem& p, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq,
                        at::Tensor& dk, at::Tensor& dv, at::Tensor& dmask);
#endif

}  // namespace transformer_fast
