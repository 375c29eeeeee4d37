// PLACEHOLDER until the attention kernel lands (issue 3).
#include "ops.h"
namespace transformer_fast {
std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, bool, double, double, int64_t) {
  TORCH_CHECK(false, "attention_forward: not implemented in C++ yet");
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool, double,
    double, int64_t) {
  TORCH_CHECK(false, "attention_backward: not implemented in C++ yet");
}
}  // namespace transformer_fast
