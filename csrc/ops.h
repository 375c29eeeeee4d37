// The C++ backend: the kernel-level functions (their contract of shapes, strides, dtypes and
// results is documented once, in the matching transformer_fast/<family>.py) and the public ops'
// argument checks (csrc/<family>_op.cpp).
#pragma once

#include "attention_extras.h"
#include "new_tensors.h"

// ATen's headers, not <torch/extension.h>: that one adds torch's C++ frontend and pybind11, about
// 30 s of compile time to every translation unit; only the Python bindings include pybind11.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace transformer_fast {

// ---- softmax attention (attention_forward.cpp, attention_backward.cpp) ----
// The arguments beyond the dense masks (window, softcap, ALiBi, sinks, packed sequences, the
// decoding split) follow the schemas of csrc/schemas.cpp; AttentionExtras (attention.h) holds them.
std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal, double scale, double dropout_p, const std::optional<at::Tensor>& seed, at::IntArrayRef window,
    double softcap, const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
    const std::optional<at::Tensor>& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k,
    const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& block_table, int64_t max_q,
    int64_t max_k, int64_t num_splits, int64_t query_offset);

// (dq, dk, dv, dmask, delta). dmask (the score gradient dS, (B, H, Nq, Nk) in q's dtype) is an
// undefined tensor (None) unless compute_dmask; delta (sum_j P_ij dP_ij per row, float32 in lse's
// shape) unless compute_delta.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal, double scale, double dropout_p, const std::optional<at::Tensor>& seed, bool compute_dmask,
    at::IntArrayRef window, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& cu_seq_q,
    const std::optional<at::Tensor>& cu_seq_k, int64_t max_q, int64_t max_k, bool compute_delta,
    const std::optional<at::Tensor>& sinks, int64_t query_offset);

// Whether the CPU kernels multiply bf16/fp16 tiles with the CPU's own products of that dtype, not
// in fp32 on converted copies (cpu_blas.h: native_lowp_products).
bool native_lowp_products(at::ScalarType dtype);

// ---- LayerNorm / RMSNorm (layer_norm.cpp); absent optional results are undefined tensors (None) ----
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, bool is_rms);

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& dy, const std::optional<at::Tensor>& dh, const at::Tensor& h,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& mean, const at::Tensor& rstd, double eps, bool is_rms);

// ---- linear attention (linear_attention.cpp); results a call does not produce are empty tensors ----
// (out, final S, final z)
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double eps,
    const std::optional<at::Tensor>& initial_S, const std::optional<at::Tensor>& initial_z, bool output_final_state);

// (dq, dk, dv, d initial S, d initial z)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double eps,
    const std::optional<at::Tensor>& initial_S, const std::optional<at::Tensor>& initial_z,
    const std::optional<at::Tensor>& grad_final_S, const std::optional<at::Tensor>& grad_final_z);

// ---- the public ops (csrc/<family>_op.cpp, attention_args.cpp): argument checks, then the kernel ops ----
// Checked and normalised arguments: dense q, k, v 4-D (packed: 3-D, or 4-D key/value pages), autocast
// applied, unit last-dim strides, the mask an expanded (B, H, Nq, Nk) view, the scale resolved, and
// the extras as the kernel ops take them (window (-1, -1) when none, ALiBi slopes a (B, H) float32
// view, sinks (H,) float32).
struct AttentionArgs {
  at::Tensor q, k, v;
  std::optional<at::Tensor> attn_mask, key_padding_mask;
  double scale = 1.0;
  bool unbatched = false;  // the inputs were (H, N, D)
  AttentionExtras x;
};
AttentionArgs attention_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                             std::optional<double> scale, bool enable_gqa,
                             const std::optional<at::Tensor>& key_padding_mask,
                             at::OptionalIntArrayRef window_size = std::nullopt,
                             std::optional<double> softcap = std::nullopt,
                             const std::optional<at::Tensor>& alibi_slopes = std::nullopt,
                             const std::optional<at::Tensor>& sinks = std::nullopt);
at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                        bool is_causal, std::optional<double> scale, bool enable_gqa,
                                        const std::optional<at::Tensor>& key_padding_mask,
                                        const std::optional<at::Tensor>& seed,
                                        at::OptionalIntArrayRef window_size, std::optional<double> softcap,
                                        const std::optional<at::Tensor>& alibi_slopes,
                                        const std::optional<at::Tensor>& sinks);
AttentionArgs varlen_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k, int64_t max_q,
                          int64_t max_k, std::optional<double> scale, at::IntArrayRef window_size, bool enable_gqa,
                          const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& block_table,
                          std::optional<int64_t> num_splits, std::optional<double> softcap,
                          const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
                          double dropout_p);
std::tuple<at::Tensor, at::Tensor> varlen_attn(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& cu_seq_q,
    const std::optional<at::Tensor>& cu_seq_k, int64_t max_q, int64_t max_k, bool return_lse,
    std::optional<double> scale, at::IntArrayRef window_size, bool enable_gqa,
    const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& block_table,
    std::optional<int64_t> num_splits, std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p, const std::optional<at::Tensor>& seed);
// The attention_forward op on checked arguments (through the dispatcher: autograd, autocast, device).
std::tuple<at::Tensor, at::Tensor> call_attention_forward(const AttentionArgs& a, bool is_causal, double dropout_p,
                                                          const std::optional<at::Tensor>& seed);

// x and residual with the normalised dims as one last dim (unit stride); weight and bias flattened
// to (width,); rows_empty when the rows have no elements (then only x, residual and the result
// shape mean anything).
struct LayerNormArgs {
  at::Tensor x;
  std::optional<at::Tensor> residual, weight, bias;
  double eps = 0.0;
  bool rows_empty = false;
};
LayerNormArgs layer_norm_args(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                              const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                              std::optional<double> eps, const std::optional<at::Tensor>& residual, bool is_rms);
std::tuple<at::Tensor, at::Tensor> layer_norm(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                                              const std::optional<at::Tensor>& weight,
                                              const std::optional<at::Tensor>& bias, std::optional<double> eps,
                                              const std::optional<at::Tensor>& residual, bool is_rms);

// The initial state (S, z) checked against the inputs (both or neither; float32, float64 for float64 inputs).
struct LinearAttentionArgs {
  at::Tensor q, k, v;
  std::optional<at::Tensor> key_padding_mask, initial_S, initial_z;
};
LinearAttentionArgs linear_attention_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                          bool is_causal, const std::optional<at::Tensor>& key_padding_mask,
                                          double eps, const std::optional<at::Tensor>& initial_S,
                                          const std::optional<at::Tensor>& initial_z);
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, bool is_causal,
    const std::optional<at::Tensor>& key_padding_mask, double eps, const std::optional<at::Tensor>& initial_S,
    const std::optional<at::Tensor>& initial_z, bool output_final_state);

}  // namespace transformer_fast
