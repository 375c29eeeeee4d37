// The signatures of an op kernel's call and of a Triton launch's positional arguments
// (kernels/_launch.py), for the Python bindings: not ops.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <string>

namespace transformer_fast {

// Appends a value's bytes to a signature.
template <typename T>
void append_value(std::string& signature, T value) {
  signature.append(reinterpret_cast<const char*>(&value), sizeof(T));
}

pybind11::object launch_plan_signature(const pybind11::tuple& args);
// Appends a tensor's fields as launch_plan_signature writes them: 'T', dtype, device, sizes, strides,
// address mod 16 (also native_calls.cpp's recipe_signature).
void append_tensor_signature(std::string& signature, const at::Tensor& t);
pybind11::object triton_launch_signature(const pybind11::tuple& args);

}  // namespace transformer_fast
