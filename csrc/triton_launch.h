// PackedLaunch: a compiled Triton kernel launched from C++ with its arguments packed once, for the
// launch plans of kernels/_launch.py (a Python binding, not an op).
#pragma once

#include <torch/extension.h>

namespace transformer_fast {

void bind_packed_launch(pybind11::module& m);

}  // namespace transformer_fast
