// The signatures of an op kernel's call and of a Triton launch's positional arguments
// (kernels/_launch.py), for the Python bindings: not ops.
#pragma once

#include <torch/extension.h>

namespace transformer_fast {

pybind11::object call_signature(const pybind11::tuple& args);
pybind11::object triton_launch_signature(const pybind11::tuple& args);

}  // namespace transformer_fast
