// The CPU attention entry points' problem (attention_forward.cpp, attention_backward.cpp): the
// inputs checked and normalised, dense or packed (variable-length sequences, a paged key/value
// cache), with the extras of AttentionExtras. The CPU kernels read the index tensors on the host,
// so their values are checked here (the public op does not read them: that would synchronise
// with a GPU): offsets that start at 0, never decrease and end within the packed tensors,
// seqused_k within each sequence's slot, block_table entries naming existing pages, max_q and
// max_k covering every sequence.
#pragma once

#include "ops/attention_ops.h"
#include "ops/attention_problem.h"
#include "ops/op_utils.h"

#include <ATen/ops/full.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace transformer_fast {

struct CpuProblem {
  Problem p;
  at::Tensor q, k, v;  // unit last-dim strides
  at::Tensor pad, cu_q, cu_k, used, table, alibi, sinks;  // what p points into

  std::vector<int64_t> out_sizes(int64_t width) const {
    return p.packed() ? std::vector<int64_t>{p.Tq, p.H, width} : std::vector<int64_t>{p.B, p.H, p.Nq, width};
  }
  std::vector<int64_t> lse_sizes() const {
    return p.packed() ? std::vector<int64_t>{p.H, p.Tq} : std::vector<int64_t>{p.B, p.H, p.Nq};
  }
  // Packed query rows after the last sequence belong to none: rows with no allowed key, so out 0
  // and lse the sink (or +inf), as the contract and the other backends give them.
  void fill_rows_outside_sequences(at::Tensor& out, at::Tensor& lse) const {
    if (!p.packed()) return;
    const int64_t end = p.cu_seq_q[p.B];
    out.narrow(0, end, p.Tq - end).zero_();
    at::Tensor rows = lse.narrow(1, end, p.Tq - end);
    if (sinks.defined()) {
      rows.copy_(sinks.view({p.H, 1}).expand_as(rows));
    } else {
      rows.fill_(std::numeric_limits<float>::infinity());
    }
  }
  // With no key in any sequence: out 0 and lse the sink (or +inf) on every row of a sequence.
  void fill_keyless(at::Tensor& out, at::Tensor& lse) const {
    const int64_t end = p.packed() ? p.cu_seq_q[p.B] : p.Nq;
    out.narrow(p.packed() ? 0 : 2, 0, end).zero_();
    at::Tensor rows = lse.narrow(p.packed() ? 1 : 2, 0, end);
    if (!sinks.defined()) {
      rows.fill_(std::numeric_limits<float>::infinity());
    } else {
      rows.copy_(p.packed() ? sinks.view({p.H, 1}).expand_as(rows) : sinks.view({1, p.H, 1}).expand_as(rows));
    }
  }
};

namespace sequences_detail {

inline at::Tensor index_tensor(const char* fn, const char* name, const at::Tensor& t, int64_t dim,
                               const at::Tensor& q) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, fn, ": ", name, " must be an int32 tensor, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dim, fn, ": ", name, " must have ", dim, " dimension(s), got shape ", t.sizes());
  TORCH_CHECK(t.device() == q.device(), fn, ": ", name, " must be on q's device ", q.device(), ", got ", t.device());
  return t.contiguous();
}

// cu_seq offsets: start at 0, nondecreasing, end within `rows`.
inline void check_offsets(const char* fn, const char* name, const at::Tensor& cu, int64_t rows, const char* of) {
  const int32_t* c = cu.data_ptr<int32_t>();
  const int64_t n = cu.numel();
  TORCH_CHECK_VALUE(n >= 1, fn, ": ", name, " must hold batch + 1 >= 1 offsets, got none");
  TORCH_CHECK_VALUE(c[0] == 0, fn, ": ", name, " must start at 0, got ", name, "[0] = ", c[0]);
  for (int64_t b = 0; b + 1 < n; ++b) {
    TORCH_CHECK_VALUE(c[b + 1] >= c[b], fn, ": ", name, " must be nondecreasing, got ", name, "[", b + 1, "] = ",
                      c[b + 1], " < ", name, "[", b, "] = ", c[b]);
  }
  TORCH_CHECK_VALUE(c[n - 1] <= rows, fn, ": ", name, " must end within the ", rows, " rows of ", of, ", got ", name,
                    "[", n - 1, "] = ", c[n - 1]);
}

inline void check_float_vector(const char* fn, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                               const at::Tensor& q) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, fn, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.sizes() == shape, fn, ": ", name, " must have shape ", shape, ", got ", t.sizes());
  TORCH_CHECK(t.device() == q.device(), fn, ": ", name, " must be on q's device ", q.device(), ", got ", t.device());
}

// Window, query offset, softcap, ALiBi slopes ((B, H) view) and sinks ((H,)) into cp.p.
inline void set_score_extras(const char* fn, CpuProblem& cp, const AttentionExtras& x) {
  Problem& p = cp.p;
  TORCH_CHECK_VALUE(x.window_left >= -1 && x.window_right >= -1, fn, ": window entries must be >= 0, or -1 for an "
                    "unbounded side, got (", x.window_left, ", ", x.window_right, ")");
  TORCH_CHECK_VALUE(std::isfinite(x.softcap) && x.softcap >= 0.0, fn, ": softcap must be >= 0 (0: none), got ",
                    x.softcap);
  check_query_offset(fn, x.query_offset);
  p.window_left = x.window_left;
  p.window_right = x.window_right;
  p.query_offset = x.query_offset;
  p.softcap = static_cast<float>(x.softcap);
  p.num_splits = x.num_splits;
  TORCH_CHECK_VALUE(x.num_splits >= 0, fn, ": num_splits must be >= 0 (0: chosen), got ", x.num_splits);
  if (x.alibi_slopes.has_value()) {
    cp.alibi = *x.alibi_slopes;
    check_float_vector(fn, "alibi_slopes", cp.alibi, {p.B, p.H}, cp.q);
    p.alibi = cp.alibi.data_ptr<float>();
    p.alibi_sb = cp.alibi.stride(0);
    p.alibi_sh = cp.alibi.stride(1);
  }
  if (x.sinks.has_value()) {
    check_float_vector(fn, "sinks", *x.sinks, {p.H}, cp.q);
    cp.sinks = x.sinks->contiguous();
    p.sinks = cp.sinks.data_ptr<float>();
  }
}

inline void check_heads(const char* fn, int64_t H, int64_t Hk) {
  TORCH_CHECK_VALUE(H == 0 || (Hk > 0 && H % Hk == 0), fn, ": key heads (", Hk, ") must divide query heads (", H,
                    ")");
}

// The packed problem: q (Tq, H, D), k/v (Tk, Hk, D/Dv) or paged (pages, page_size, Hk, D/Dv).
inline void set_packed(const char* fn, CpuProblem& cp, const AttentionExtras& x) {
  Problem& p = cp.p;
  const at::Tensor &q = cp.q, &k = cp.k, &v = cp.v;
  const bool paged = x.block_table.has_value();
  TORCH_CHECK_VALUE(q.dim() == 3, fn, ": packed q must be (total_q, heads, head_dim), got shape ", q.sizes());
  TORCH_CHECK_VALUE(k.dim() == (paged ? 4 : 3) && v.dim() == k.dim(), fn, ": packed k and v must be ",
                    paged ? "(pages, page_size, kv_heads, head_dim) with block_table" : "(total_k, kv_heads, head_dim)",
                    ", got shapes ", k.sizes(), " and ", v.sizes());
  const int64_t hd = k.dim() - 2;  // k's heads dim
  std::vector<int64_t> k_shape(k.sizes().begin(), k.sizes().end()), v_shape = k_shape;
  k_shape.back() = q.size(2);
  v_shape.back() = v.size(-1);
  check_shape(fn, "k", k, k_shape);
  check_shape(fn, "v", v, v_shape);
  p.H = q.size(1);
  p.Hk = k.size(hd);
  p.D = q.size(2);
  p.Dv = v.size(-1);
  p.Tq = q.size(0);
  check_heads(fn, p.H, p.Hk);

  cp.cu_q = index_tensor(fn, "cu_seq_q", *x.cu_seq_q, 1, q);
  check_offsets(fn, "cu_seq_q", cp.cu_q, p.Tq, "q");
  p.B = cp.cu_q.numel() - 1;
  p.cu_seq_q = cp.cu_q.data_ptr<int32_t>();
  if (paged) {
    TORCH_CHECK_VALUE(x.seqused_k.has_value(), fn, ": block_table needs seqused_k (the keys of each sequence)");
    cp.table = index_tensor(fn, "block_table", *x.block_table, 2, q);
    TORCH_CHECK_VALUE(cp.table.size(0) == p.B, fn, ": block_table must have a row per sequence (", p.B, "), got shape ",
                      cp.table.sizes());
    const int64_t pages = k.size(0);
    const int32_t* t = cp.table.data_ptr<int32_t>();
    for (int64_t e = 0; e < cp.table.numel(); ++e) {
      TORCH_CHECK_VALUE(t[e] >= 0 && t[e] < pages, fn, ": block_table entries must name pages in [0, ", pages,
                        "), got block_table[", e / cp.table.size(1), ", ", e % cp.table.size(1), "] = ", t[e]);
    }
    p.block_table = t;
    p.pages_per_seq = cp.table.size(1);
    p.page_size = k.size(1);
  } else {
    TORCH_CHECK_VALUE(x.cu_seq_k.has_value(), fn, ": cu_seq_k is needed without a paged cache (block_table)");
    cp.cu_k = index_tensor(fn, "cu_seq_k", *x.cu_seq_k, 1, q);
    TORCH_CHECK_VALUE(cp.cu_k.numel() == p.B + 1, fn, ": cu_seq_k must have batch + 1 = ", p.B + 1,
                      " entries, as cu_seq_q, got ", cp.cu_k.numel());
    check_offsets(fn, "cu_seq_k", cp.cu_k, k.size(0), "k");
    p.cu_seq_k = cp.cu_k.data_ptr<int32_t>();
  }
  if (x.seqused_k.has_value()) {
    cp.used = index_tensor(fn, "seqused_k", *x.seqused_k, 1, q);
    TORCH_CHECK_VALUE(cp.used.numel() == p.B, fn, ": seqused_k must have an entry per sequence (", p.B, "), got ",
                      cp.used.numel());
    const int32_t* u = cp.used.data_ptr<int32_t>();
    for (int64_t b = 0; b < p.B; ++b) {
      const int64_t slot = paged ? p.pages_per_seq * p.page_size : p.cu_seq_k[b + 1] - p.cu_seq_k[b];
      TORCH_CHECK_VALUE(u[b] >= 0 && u[b] <= slot, fn, ": seqused_k[", b, "] must be in [0, ", slot, "] (",
                        paged ? "the keys of its block_table row's pages" : "its cu_seq_k range", "), got ", u[b]);
    }
    p.seqused_k = u;
  }
  p.Nq = 0;
  p.Nk = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    p.Nq = std::max(p.Nq, p.q_len(b));
    p.Nk = std::max(p.Nk, p.k_len(b));
  }
  TORCH_CHECK_VALUE(x.max_q >= p.Nq, fn, ": max_q must be at least the longest query sequence (", p.Nq, "), got ",
                    x.max_q);
  TORCH_CHECK_VALUE(x.max_k >= p.Nk, fn, ": max_k must be at least the longest key sequence (", p.Nk, "), got ",
                    x.max_k);
}

}  // namespace sequences_detail

// The problem of an entry point's inputs: dense (B, H, N, D) tensors with the dense masks, or a
// packed one (x.cu_seq_q given), which takes none of them.
inline CpuProblem cpu_problem(const char* fn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const std::optional<at::Tensor>& attn_mask,
                              const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale,
                              double dropout_p, const std::optional<at::Tensor>& seed, const AttentionExtras& x) {
  namespace d = sequences_detail;
  const int64_t seed_value = dropout_seed(fn, seed, dropout_p);
  CpuProblem cp;
  if (!x.packed()) {
    TORCH_CHECK_VALUE(!x.cu_seq_k.has_value() && !x.seqused_k.has_value() && !x.block_table.has_value(), fn,
                      ": cu_seq_k, seqused_k and block_table describe packed sequences and need cu_seq_q");
    check_inputs(fn, c10::DeviceType::CPU, q, k, v);
    cp.q = unit_last_stride(q);
    cp.k = unit_last_stride(k);
    cp.v = unit_last_stride(v);
    cp.pad = padding_mask_contiguous(key_padding_mask);
    cp.p = make_problem(cp.q, cp.k, cp.v, attn_mask, cp.pad, is_causal, scale, dropout_p, seed_value);
    d::set_score_extras(fn, cp, x);
    return cp;
  }
  TORCH_CHECK_VALUE(!(attn_mask.has_value() && attn_mask->defined()) &&
                        !(key_padding_mask.has_value() && key_padding_mask->defined()) && !is_causal,
                    fn, ": packed sequences take no attn_mask, key_padding_mask or is_causal (a causal mask is "
                    "window (-1, 0))");
  TORCH_CHECK(q.device().type() == c10::DeviceType::CPU && k.device() == q.device() && v.device() == q.device(), fn,
              ": q, k, v must be on one CPU device, got ", q.device(), ", ", k.device(), ", ", v.device());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), fn,
              ": q, k, v must share a dtype");
  cp.q = unit_last_stride(q);
  cp.k = unit_last_stride(k);
  cp.v = unit_last_stride(v);
  cp.p.causal = false;
  cp.p.scale = static_cast<float>(scale);
  cp.p.dropout = make_dropout(dropout_p, seed_value);
  d::set_packed(fn, cp, x);
  d::set_score_extras(fn, cp, x);
  return cp;
}

}  // namespace transformer_fast
