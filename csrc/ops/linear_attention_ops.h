// Linear attention's functions in C++: the CPU kernel-level functions (cpu/linear_attention.cpp;
// their contract is documented once, in transformer_fast/linear_attention.py) and the public op with
// its argument checks (linear_attention_op.cpp).
#pragma once

#include "ops/new_tensors.h"

// ATen's headers, not <torch/extension.h>: that one adds torch's C++ frontend and pybind11, about
// 30 s of compile time to every translation unit; only the Python bindings include pybind11.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace transformer_fast {

// ---- the CPU kernels (cpu/linear_attention.cpp); results a call does not produce are empty tensors ----
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

// ---- the public op (linear_attention_op.cpp): argument checks, then the kernel ops ----
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
