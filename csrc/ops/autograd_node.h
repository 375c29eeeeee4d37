// Building autograd graph nodes by hand, as torch's generated code does for its own ops
// (VariableType): one Node subclass per op, its saved tensors as SavedVariable members, its
// history set on the outputs. A torch::autograd::Function costs more per call (a context object,
// saved_data in a string-keyed map of IValues, extracting and wrapping every input and output): on
// a small LayerNorm the difference was most of the gap to torch's own forward+backward.
#pragma once

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <memory>
#include <type_traits>

namespace transformer_fast {

// A new node of type T. torch owns nodes through c10::intrusive_ptr where Node derives from
// c10::intrusive_ptr_target (recent torch), through std::shared_ptr before; the check is on T so
// that only the branch of the installed torch is compiled.
template <typename T>
auto make_node() {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>) {
    return c10::make_intrusive<T>();
  } else {
    return std::make_shared<T>();
  }
}

inline std::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

inline torch::autograd::SavedVariable saved(const std::optional<at::Tensor>& t, bool is_output = false) {
  return t.has_value() ? torch::autograd::SavedVariable(*t, is_output) : torch::autograd::SavedVariable();
}

}  // namespace transformer_fast
