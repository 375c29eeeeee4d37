// The pattern of a Triton launch's positional arguments (kernels/_launch.py), for the Python
// bindings: not an op.
#pragma once

#include <torch/extension.h>

namespace transformer_fast {

pybind11::object triton_launch_signature(const pybind11::tuple& args);

}  // namespace transformer_fast
