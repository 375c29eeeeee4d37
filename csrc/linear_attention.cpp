// PLACEHOLDER until the linear-attention kernel lands (issue 5).
#include "ops.h"
namespace transformer_fast {
at::Tensor linear_attention_forward(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                    const std::optional<at::Tensor>&, bool, double) {
  TORCH_CHECK(false, "linear_attention_forward: not implemented in C++ yet");
}
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention_backward(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const std::optional<at::Tensor>&, bool, double) {
  TORCH_CHECK(false, "linear_attention_backward: not implemented in C++ yet");
}
}  // namespace transformer_fast
