// LayerNorm / RMSNorm's functions in C++: the CPU kernel-level functions (cpu/layer_norm.cpp; their
// contract is documented once, in transformer_fast/layer_norm.py) and the public op with its argument
// checks (layer_norm_op.cpp).
#pragma once

#include "ops/new_tensors.h"

// ATen's headers, not <torch/extension.h>: that one adds torch's C++ frontend and pybind11, about
// 30 s of compile time to every translation unit; only the Python bindings include pybind11.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

namespace transformer_fast {

// ---- the CPU kernels (cpu/layer_norm.cpp); absent optional results are undefined tensors (None) ----
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    double eps, bool is_rms);

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& dy, const std::optional<at::Tensor>& dh, const at::Tensor& h,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& mean, const at::Tensor& rstd, double eps, bool is_rms);

// ---- the public op (layer_norm_op.cpp): argument checks, then the kernel ops ----
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

}  // namespace transformer_fast
