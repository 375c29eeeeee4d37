// PackedLaunch: a compiled Triton kernel launched from C++ with its arguments packed once, for the
// launch plans of kernels/_launch.py and the native calls of native_calls.cpp.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace transformer_fast {

// Hidden, as pybind11's own types are: the class is bound to Python below, not exported.
#if defined(__GNUC__)
#define TRANSFORMER_FAST_HIDDEN __attribute__((visibility("hidden")))
#else
#define TRANSFORMER_FAST_HIDDEN
#endif

class TRANSFORMER_FAST_HIDDEN PackedLaunch {
 public:
  using LaunchKernel = int (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                               unsigned block_y, unsigned block_z, unsigned shared_bytes, void* stream, void** params,
                               void** extra);
  using CtxGetCurrent = int (*)(void** context);
  using GetErrorName = int (*)(int error, const char** name);
  static constexpr size_t kSlot = 8;
  static constexpr size_t kMaxParams = 128;
  static constexpr size_t kMaxTensors = 64;

  PackedLaunch(uint64_t function, const std::array<int64_t, 3>& grid, int64_t block_x, int64_t shared_bytes,
               const pybind11::bytes& params, const std::vector<std::pair<int64_t, int64_t>>& tensor_params,
               int64_t seed_param, const std::array<uint64_t, 3>& driver, int64_t device_index,
               std::optional<uint64_t> stream);

  // The stream a launch from this thread goes to (the plan's device's current one), or nullopt
  // where it cannot launch here (another device is current, or the thread has no CUDA context).
  std::optional<void*> stream_here() const;
  // Launches on `stream` with addresses[i] as the plan's tensor i (n of them) and `seed`.
  void launch(void* stream, const uint64_t* addresses, size_t n, int64_t seed) const;
  // The same with the plan's tensors from Python; false where it cannot launch here.
  bool launch_tensors(const pybind11::tuple& tensors, int64_t seed) const;
  // The parameter slots a launch with `tensors` and `seed` passes (for tests and tools).
  pybind11::bytes pack(const pybind11::tuple& tensors, int64_t seed) const;

  size_t num_params() const { return params_.size() / kSlot; }
  int64_t seed_param() const { return seed_param_; }
  int64_t device_index() const { return device_index_; }
  // How many tensors a launch takes (one past the highest tensor index read).
  size_t num_tensors() const { return num_tensors_; }
  // The parameter slots that hold a tensor's address.
  std::vector<size_t> tensor_slots() const {
    std::vector<size_t> slots;
    for (const auto& [slot, tensor] : tensor_params_) slots.push_back(slot);
    return slots;
  }

 private:
  size_t fill(unsigned char* slots, const uint64_t* addresses, size_t n, int64_t seed) const;

  void* function_;
  std::array<unsigned, 3> grid_;
  unsigned block_x_;
  unsigned shared_bytes_;
  std::string params_;
  std::vector<std::pair<size_t, size_t>> tensor_params_;  // (parameter slot, tensor index)
  size_t num_tensors_ = 0;
  int64_t seed_param_;
  LaunchKernel launch_kernel_;
  CtxGetCurrent ctx_get_current_;
  GetErrorName get_error_name_;
  int64_t device_index_;
  bool fixed_stream_;
  void* stream_;
};

void bind_packed_launch(pybind11::module& m);

}  // namespace transformer_fast
