// Python bindings of the C++ backend: transformer_fast._C. The ops are registered with
// torch.library on the Python side (transformer_fast/<family>.py), which also owns autograd.
#include "ops.h"

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
  m.doc() = "transformer_fast C++ kernels (CPU; CUDA for attention where built with CUDA)";
  m.def("attention_forward", &tf::attention_forward);
  m.def("attention_backward", &tf::attention_backward);
  m.def("layer_norm_forward", &tf::layer_norm_forward);
  m.def("layer_norm_backward", &tf::layer_norm_backward);
  m.def("linear_attention_forward", &tf::linear_attention_forward);
  m.def("linear_attention_backward", &tf::linear_attention_backward);
  // The kernel families that also run on CUDA tensors in this build.
  m.def("cuda_families", [] {
#if defined(TRANSFORMER_FAST_WITH_CUDA)
    return std::vector<std::string>{"attention"};
#else
    return std::vector<std::string>{};
#endif
  });
}
