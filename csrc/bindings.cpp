// transformer_fast._C: loading it registers the ops (csrc/schemas.cpp and the TORCH_LIBRARY_IMPL
// blocks). The Python bindings below serve what the dispatcher does not:
//   * the public ops' C++ functions, called directly by the Python functions in eager mode (the
//     same code the dispatcher runs for torch.ops.transformer_fast.<op>, without the boxed call);
//   * their argument checks alone (*_args), for the paths that run a backend other than the
//     dispatcher's (backend=..., the torch.func transforms);
//   * the kernel-level functions, for those paths.
#include "ops.h"
#if defined(TRANSFORMER_FAST_WITH_CUDA)
#include "attention.h"
#endif

#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace transformer_fast {

at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const char* poison = std::getenv("TRANSFORMER_FAST_POISON");
  if (poison != nullptr && std::strcmp(poison, "1") == 0) {
    if (at::isFloatingType(c10::typeMetaToScalarType(options.dtype()))) {
      return at::full(sizes, std::numeric_limits<double>::quiet_NaN(), options);
    }
    return at::full(sizes, -1, options);
  }
  return at::empty(sizes, options);
}

}  // namespace transformer_fast

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace tf = transformer_fast;
  namespace py = pybind11;
  m.doc() = "transformer_fast C++ kernels and op registrations (CPU; CUDA for attention where built with CUDA)";

  m.def("scaled_dot_product_attention", &tf::scaled_dot_product_attention);
  m.def("layer_norm", [](const at::Tensor& input, const std::vector<int64_t>& normalized_shape,
                         const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                         std::optional<double> eps, const std::optional<at::Tensor>& residual, bool is_rms) {
    return tf::layer_norm(input, c10::fromIntArrayRefSlow(normalized_shape), weight, bias, eps, residual, is_rms);
  });
  m.def("linear_attention", &tf::linear_attention);

  m.def("attention_args", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                             std::optional<double> scale, bool enable_gqa,
                             const std::optional<at::Tensor>& key_padding_mask) {
    const auto a = tf::attention_args(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask);
    return py::make_tuple(a.q, a.k, a.v, a.attn_mask, a.key_padding_mask, a.scale, a.unbatched);
  });
  m.def("layer_norm_args", [](const at::Tensor& input, const std::vector<int64_t>& normalized_shape,
                              const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                              std::optional<double> eps, const std::optional<at::Tensor>& residual, bool is_rms) {
    const auto a = tf::layer_norm_args(input, c10::fromIntArrayRefSlow(normalized_shape), weight, bias, eps, residual,
                                       is_rms);
    return py::make_tuple(a.x, a.residual, a.weight, a.bias, a.eps, a.rows_empty);
  });
  m.def("linear_attention_args", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                                    const std::optional<at::Tensor>& key_padding_mask, double eps,
                                    const std::optional<at::Tensor>& initial_S,
                                    const std::optional<at::Tensor>& initial_z) {
    const auto a = tf::linear_attention_args(q, k, v, is_causal, key_padding_mask, eps, initial_S, initial_z);
    return py::make_tuple(a.q, a.k, a.v, a.key_padding_mask, a.initial_S, a.initial_z);
  });

  m.def("attention_forward", &tf::attention_forward);
  m.def("attention_backward", &tf::attention_backward);
  m.def("layer_norm_forward", &tf::layer_norm_forward);
  m.def("layer_norm_backward", &tf::layer_norm_backward);
  m.def("linear_attention_forward", &tf::linear_attention_forward);
  m.def("linear_attention_backward", &tf::linear_attention_backward);
#if defined(TRANSFORMER_FAST_WITH_CUDA)
  m.def("attention_forward_cuda", &tf::attention_forward_cuda);
  m.def("attention_backward_cuda", &tf::attention_backward_cuda);
  m.def("register_cuda_kernels", &tf::register_cuda_kernels);
#endif
  // The kernel families that also run on CUDA tensors in this build.
  m.def("cuda_families", [] {
#if defined(TRANSFORMER_FAST_WITH_CUDA)
    return std::vector<std::string>{"attention"};
#else
    return std::vector<std::string>{};
#endif
  });
}
