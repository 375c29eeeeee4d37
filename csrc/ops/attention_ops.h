// Softmax attention's functions in C++: the kernel-level functions of the CPU (and, where built
// with CUDA, of the GPU), whose contract of shapes, strides, dtypes and results is documented once,
// in transformer_fast/attention.py, and the public ops with their argument checks (attention_args.cpp).
#pragma once

#include "ops/attention_call.h"
#include "ops/attention_extras.h"
#include "ops/new_tensors.h"

// ATen's headers, not <torch/extension.h>: that one adds torch's C++ frontend and pybind11, about
// 30 s of compile time to every translation unit; only the Python bindings include pybind11.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace transformer_fast {

// ---- the CPU kernels (cpu/attention_forward.cpp, cpu/attention_backward.cpp) ----
// (out, lse).
std::tuple<at::Tensor, at::Tensor> attention_forward(const AttentionForwardCall& c);

// (dq, dk, dv, dmask, delta). dmask (the score gradient dS, (B, H, Nq, Nk) in q's dtype) is an
// undefined tensor (None) unless compute_dmask; delta (sum_j P_ij dP_ij per row, float32 in lse's
// shape) unless compute_delta.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const AttentionBackwardCall& c);

// Whether the CPU kernels multiply bf16/fp16 tiles with the CPU's own products of that dtype, not
// in fp32 on converted copies (cpu/cpu_blas.h: native_lowp_products).
bool native_lowp_products(at::ScalarType dtype);

#if defined(TRANSFORMER_FAST_WITH_CUDA)
// cuda/attention_cuda.cu: the CUDA kernels' entry points (the contract of attention_forward and
// attention_backward above), and their registration for the CUDA dispatch key, made only where
// Triton does not serve CUDA tensors (transformer_fast/_device_kernels.py).
std::tuple<at::Tensor, at::Tensor> attention_forward_cuda(const AttentionForwardCall& c);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const AttentionBackwardCall& c);
void register_cuda_kernels();
#endif

// ---- the public ops (attention_args.cpp): argument checks, then the kernel ops ----
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
// d loss / d sinks from the backward op's delta (attention_op.cpp); lse-shaped rows, packed or dense.
at::Tensor sinks_gradient(const at::Tensor& delta, const at::Tensor& lse, const at::Tensor& sinks, bool packed);
// The attention_forward op on checked arguments (through the dispatcher: autograd, autocast, device).
std::tuple<at::Tensor, at::Tensor> call_attention_forward(const AttentionArgs& a, bool is_causal, double dropout_p,
                                                          const std::optional<at::Tensor>& seed);

}  // namespace transformer_fast
