// Allocating what the kernels write (ops/new_tensors.h says what each function makes and why).
#include "ops/new_tensors.h"

#include <ATen/EmptyTensor.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>

#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace transformer_fast {

at::Tensor new_tensor(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (options.device().is_cpu()) return at::detail::empty_cpu(sizes, options);
  return at::empty(sizes, options);
}

at::Tensor new_zeros(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = new_tensor(sizes, options);
  if (t.is_cpu() && t.numel() <= at::internal::GRAIN_SIZE) {
    std::memset(t.data_ptr(), 0, t.nbytes());
    return t;
  }
  return t.zero_();
}

bool poison_requested() {
  const char* poison = std::getenv("TRANSFORMER_FAST_POISON");
  return poison != nullptr && std::strcmp(poison, "1") == 0;
}

bool poison_scratch() {
  static const bool poison = poison_requested();
  return poison;
}

at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  if (poison_requested()) {
    if (at::isFloatingType(c10::typeMetaToScalarType(options.dtype()))) {
      return at::full(sizes, std::numeric_limits<double>::quiet_NaN(), options);
    }
    return at::full(sizes, -1, options);
  }
  return new_tensor(sizes, options);
}

at::Tensor new_output_in_rows_of(const at::Tensor& like, int64_t width, const at::TensorOptions& options) {
  std::vector<int64_t> sizes = like.sizes().vec();
  sizes.back() = width;
  if (like.dim() != 4 || like.stride(1) >= like.stride(2)) return new_output(sizes, options);
  return new_output({sizes[0], sizes[2], sizes[1], width}, options).transpose(1, 2);
}

}  // namespace transformer_fast
