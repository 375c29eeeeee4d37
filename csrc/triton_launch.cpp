// PackedLaunch: one launch of a compiled Triton kernel, made from C++.
//
// Triton's launcher (CompiledKernel.run) parses every argument of every launch from Python: a
// Python call per tensor for its address, a driver call per pointer to validate it, the launch
// hooks, the scratch allocators. A launch plan (kernels/_launch.py) fixes everything of a launch
// but the call's tensors and dropout seed, so this packs the kernel's parameters once, as Triton
// would pass them, and each launch writes the tensors' addresses and the seed into a copy, takes
// the device's current stream from c10 and calls the driver's cuLaunchKernel.
//
// Parameters: one 8-byte slot each, in the kernel's order (Triton's signature without its
// constexprs, then the global and profile scratch pointers, null here). An int is written as a
// little-endian int64 (its low bytes are its value in any narrower type), an fp32 as its 4 bytes:
// the driver copies from each slot the size the kernel declares. kernels/_launch.py packs them and
// launches only what this covers (one CTA per cluster, no launch attributes, no scratch memory).
//
// No CUDA header: the driver's functions come as addresses (resolved in Python with ctypes), the
// stream through c10's device guard, so the CPU build has it too; `stream` fixes the stream for a
// driver that is not CUDA's (the recording driver of the tests and tools).
#include "triton_launch.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace transformer_fast {

namespace py = pybind11;

namespace {

using CUresult = int;
using LaunchKernel = CUresult (*)(void* function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x,
                                  unsigned block_y, unsigned block_z, unsigned shared_bytes, void* stream,
                                  void** params, void** extra);
using CtxGetCurrent = CUresult (*)(void** context);
using GetErrorName = CUresult (*)(CUresult error, const char** name);

constexpr size_t kSlot = 8;
constexpr size_t kMaxParams = 128;

unsigned as_unsigned(int64_t value, const char* what) {
  TORCH_CHECK_VALUE(value >= 0 && value <= std::numeric_limits<unsigned>::max(), "PackedLaunch: ", what,
                    " must fit 32 bits unsigned, got ", value);
  return static_cast<unsigned>(value);
}

class PackedLaunch {
 public:
  PackedLaunch(uint64_t function, const std::array<int64_t, 3>& grid, int64_t block_x, int64_t shared_bytes,
               const py::bytes& params, const std::vector<std::pair<int64_t, int64_t>>& tensor_params,
               int64_t seed_param, const std::array<uint64_t, 3>& driver, int64_t device_index,
               std::optional<uint64_t> stream)
      : function_(reinterpret_cast<void*>(function)),
        grid_{as_unsigned(grid[0], "grid"), as_unsigned(grid[1], "grid"), as_unsigned(grid[2], "grid")},
        block_x_(as_unsigned(block_x, "block_x")),
        shared_bytes_(as_unsigned(shared_bytes, "shared_bytes")),
        params_(params),
        seed_param_(seed_param),
        launch_kernel_(reinterpret_cast<LaunchKernel>(driver[0])),
        ctx_get_current_(reinterpret_cast<CtxGetCurrent>(driver[1])),
        get_error_name_(reinterpret_cast<GetErrorName>(driver[2])),
        device_index_(device_index),
        fixed_stream_(stream.has_value()),
        stream_(stream.has_value() ? reinterpret_cast<void*>(*stream) : nullptr) {
    const size_t n = params_.size() / kSlot;
    TORCH_CHECK_VALUE(params_.size() % kSlot == 0 && n <= kMaxParams, "PackedLaunch: params must be at most ",
                      kMaxParams, " slots of ", kSlot, " bytes, got ", params_.size(), " bytes");
    TORCH_CHECK_VALUE(launch_kernel_ != nullptr && ctx_get_current_ != nullptr,
                      "PackedLaunch: the driver's cuLaunchKernel and cuCtxGetCurrent are required");
    TORCH_CHECK_VALUE(seed_param_ >= -1 && seed_param_ < static_cast<int64_t>(n), "PackedLaunch: seed_param ",
                      seed_param_, " is not a parameter of ", n);
    for (const auto& [param, tensor] : tensor_params) {
      TORCH_CHECK_VALUE(param >= 0 && param < static_cast<int64_t>(n) && tensor >= 0, "PackedLaunch: tensor "
                        "parameter (", param, ", ", tensor, ") out of range for ", n, " parameters");
      tensor_params_.emplace_back(static_cast<size_t>(param), static_cast<Py_ssize_t>(tensor));
    }
    if (!fixed_stream_) current_stream(cuda_guard());  // a torch without c10's native stream handles refuses here
  }

  // Launches with `tensors` (the plan's tensor arguments) and `seed`; false where it cannot here
  // (another device is current, or the thread has no CUDA context): the caller launches through Triton.
  bool launch(const py::tuple& tensors, int64_t seed) const {
    void* stream = stream_;
    if (!fixed_stream_) {
      const c10::impl::DeviceGuardImplInterface* impl = cuda_guard();
      if (impl->getDevice().index() != device_index_) return false;
      stream = current_stream(impl);
    }
    void* context = nullptr;
    if (ctx_get_current_(&context) != 0 || context == nullptr) return false;
    if (static_cast<uint64_t>(grid_[0]) * grid_[1] * grid_[2] == 0) return true;  // nothing to run, as Triton
    alignas(kSlot) unsigned char slots[kMaxParams * kSlot];
    void* params[kMaxParams];
    const size_t n = fill(slots, tensors, seed);
    for (size_t i = 0; i < n; ++i) params[i] = slots + i * kSlot;
    const CUresult result = launch_kernel_(function_, grid_[0], grid_[1], grid_[2], block_x_, 1, 1, shared_bytes_,
                                           stream, params, nullptr);
    if (result != 0) {
      const char* name = nullptr;
      if (get_error_name_ == nullptr || get_error_name_(result, &name) != 0) name = nullptr;
      TORCH_CHECK(false, "cuLaunchKernel failed: ", name != nullptr ? name : "CUDA error", " (", result, ")");
    }
    return true;
  }

  // The parameter slots a launch with `tensors` and `seed` passes (for tests and tools).
  py::bytes pack(const py::tuple& tensors, int64_t seed) const {
    alignas(kSlot) unsigned char slots[kMaxParams * kSlot];
    const size_t n = fill(slots, tensors, seed);
    return py::bytes(reinterpret_cast<const char*>(slots), n * kSlot);
  }

  size_t num_params() const { return params_.size() / kSlot; }

 private:
  static const c10::impl::DeviceGuardImplInterface* cuda_guard() {
    return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  }

  // The current stream of the plan's device, as a cudaStream_t.
  void* current_stream(const c10::impl::DeviceGuardImplInterface* impl) const {
    return impl->getStreamNativeHandle(impl->getStream(c10::Device(c10::DeviceType::CUDA, device_index_)));
  }

  size_t fill(unsigned char* slots, const py::tuple& tensors, int64_t seed) const {
    const size_t n = params_.size() / kSlot;
    std::memcpy(slots, params_.data(), params_.size());
    const Py_ssize_t given = PyTuple_GET_SIZE(tensors.ptr());
    for (const auto& [param, index] : tensor_params_) {
      TORCH_CHECK_VALUE(index < given, "PackedLaunch: tensor ", index, " of a launch given ", given);
      PyObject* obj = PyTuple_GET_ITEM(tensors.ptr(), index);
      TORCH_CHECK_TYPE(THPVariable_Check(obj), "PackedLaunch: argument ", index, " must be a tensor, got ",
                       Py_TYPE(obj)->tp_name);
      const uint64_t address = reinterpret_cast<uintptr_t>(THPVariable_Unpack(obj).data_ptr());
      std::memcpy(slots + param * kSlot, &address, kSlot);
    }
    if (seed_param_ >= 0) std::memcpy(slots + seed_param_ * kSlot, &seed, kSlot);
    return n;
  }

  void* function_;
  std::array<unsigned, 3> grid_;
  unsigned block_x_;
  unsigned shared_bytes_;
  std::string params_;
  std::vector<std::pair<size_t, Py_ssize_t>> tensor_params_;
  int64_t seed_param_;
  LaunchKernel launch_kernel_;
  CtxGetCurrent ctx_get_current_;
  GetErrorName get_error_name_;
  int64_t device_index_;
  bool fixed_stream_;
  void* stream_;
};

}  // namespace

void bind_packed_launch(py::module& m) {
  py::class_<PackedLaunch>(m, "PackedLaunch")
      .def(py::init<uint64_t, const std::array<int64_t, 3>&, int64_t, int64_t, const py::bytes&,
                    const std::vector<std::pair<int64_t, int64_t>>&, int64_t, const std::array<uint64_t, 3>&, int64_t,
                    std::optional<uint64_t>>(),
           py::arg("function"), py::arg("grid"), py::arg("block_x"), py::arg("shared_bytes"), py::arg("params"),
           py::arg("tensor_params"), py::arg("seed_param"), py::arg("driver"), py::arg("device_index"),
           py::arg("stream") = py::none())
      .def("launch", &PackedLaunch::launch, py::arg("tensors"), py::arg("seed") = 0)
      .def("pack", &PackedLaunch::pack, py::arg("tensors"), py::arg("seed") = 0)
      .def_property_readonly("num_params", &PackedLaunch::num_params);
}

}  // namespace transformer_fast
