// Native calls: the CUDA kernels of the Triton ops in C++, replaying what the Python launchers
// launched for a call signature (native_calls.cpp). Python bindings, not ops.
#pragma once

#include <torch/csrc/utils/pybind.h>

namespace transformer_fast {

void bind_native_calls(pybind11::module& m);

}  // namespace transformer_fast
