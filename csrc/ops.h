// The kernel-level functions of the C++ backend. Their Python-side contract (shapes, strides,
// dtypes, what is returned) is documented once, in the matching transformer_fast/<family>.py.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

namespace transformer_fast {

// Allocates a kernel output. With TRANSFORMER_FAST_POISON=1 in the environment it is filled with
// NaN (or all-ones bits for integer types), so tests catch a kernel that leaves any element unwritten.
at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options);

// ---- softmax attention (attention.cpp) ----
std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal, double scale, double dropout_p, int64_t seed);

// dmask (the score gradient dS, (B, H, Nq, Nk) in q's dtype) is an undefined tensor (None) unless
// compute_dmask.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal, double scale, double dropout_p, int64_t seed, bool compute_dmask);

// ---- LayerNorm / RMSNorm (layer_norm.cpp); absent optional results are undefined tensors (None) ----
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, bool is_rms);

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& dy, const std::optional<at::Tensor>& dh, const at::Tensor& h,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& mean, const at::Tensor& rstd, double eps, bool is_rms);

// ---- linear attention (linear_attention.cpp) ----
at::Tensor linear_attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double eps);

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double eps);

}  // namespace transformer_fast
