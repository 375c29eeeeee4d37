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
#include "launch/triton_launch.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>

#include <algorithm>
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

unsigned as_unsigned(int64_t value, const char* what) {
  TORCH_CHECK_VALUE(value >= 0 && value <= std::numeric_limits<unsigned>::max(), "PackedLaunch: ", what,
                    " must fit 32 bits unsigned, got ", value);
  return static_cast<unsigned>(value);
}

const c10::impl::DeviceGuardImplInterface* cuda_guard() {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

// The current stream of `device_index`, as a cudaStream_t.
void* current_stream(const c10::impl::DeviceGuardImplInterface* impl, int64_t device_index) {
  return impl->getStreamNativeHandle(impl->getStream(c10::Device(c10::DeviceType::CUDA, device_index)));
}

}  // namespace

PackedLaunch::PackedLaunch(uint64_t function, const std::array<int64_t, 3>& grid, int64_t block_x,
                           int64_t shared_bytes, const py::bytes& params,
                           const std::vector<std::pair<int64_t, int64_t>>& tensor_params, int64_t seed_param,
                           const std::array<uint64_t, 3>& driver, int64_t device_index, std::optional<uint64_t> stream)
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
    TORCH_CHECK_VALUE(param >= 0 && param < static_cast<int64_t>(n) && tensor >= 0 &&
                      tensor < static_cast<int64_t>(kMaxTensors), "PackedLaunch: tensor parameter (", param, ", ",
                      tensor, ") out of range for ", n, " parameters and ", kMaxTensors, " tensors");
    tensor_params_.emplace_back(static_cast<size_t>(param), static_cast<size_t>(tensor));
    num_tensors_ = std::max(num_tensors_, static_cast<size_t>(tensor) + 1);
  }
  if (!fixed_stream_) current_stream(cuda_guard(), device_index_);  // a torch without native stream handles refuses
}

std::optional<void*> PackedLaunch::stream_here() const {
  void* stream = stream_;
  if (!fixed_stream_) {
    const c10::impl::DeviceGuardImplInterface* impl = cuda_guard();
    if (impl->getDevice().index() != device_index_) return std::nullopt;
    stream = current_stream(impl, device_index_);
  }
  void* context = nullptr;
  if (ctx_get_current_(&context) != 0 || context == nullptr) return std::nullopt;
  return stream;
}

void PackedLaunch::launch(void* stream, const uint64_t* addresses, size_t n, int64_t seed) const {
  if (static_cast<uint64_t>(grid_[0]) * grid_[1] * grid_[2] == 0) return;  // nothing to run, as Triton
  alignas(kSlot) unsigned char slots[kMaxParams * kSlot];
  void* params[kMaxParams];
  const size_t n_params = fill(slots, addresses, n, seed);
  for (size_t i = 0; i < n_params; ++i) params[i] = slots + i * kSlot;
  const int result = launch_kernel_(function_, grid_[0], grid_[1], grid_[2], block_x_, 1, 1, shared_bytes_, stream,
                                    params, nullptr);
  if (result != 0) {
    const char* name = nullptr;
    if (get_error_name_ == nullptr || get_error_name_(result, &name) != 0) name = nullptr;
    TORCH_CHECK(false, "cuLaunchKernel failed: ", name != nullptr ? name : "CUDA error", " (", result, ")");
  }
}

namespace {

// The addresses of a launch's tensors from Python (at most kMaxTensors), into `addresses`.
size_t tensor_addresses(const py::tuple& tensors, size_t needed, uint64_t* addresses) {
  const size_t given = static_cast<size_t>(PyTuple_GET_SIZE(tensors.ptr()));
  TORCH_CHECK_VALUE(needed <= given, "PackedLaunch: tensor ", needed - 1, " of a launch given ", given);
  for (size_t i = 0; i < needed; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(tensors.ptr(), static_cast<Py_ssize_t>(i));
    TORCH_CHECK_TYPE(THPVariable_Check(obj), "PackedLaunch: argument ", i, " must be a tensor, got ",
                     Py_TYPE(obj)->tp_name);
    addresses[i] = reinterpret_cast<uintptr_t>(THPVariable_Unpack(obj).data_ptr());
  }
  return needed;
}

}  // namespace

bool PackedLaunch::launch_tensors(const py::tuple& tensors, int64_t seed) const {
  const std::optional<void*> stream = stream_here();
  if (!stream.has_value()) return false;
  uint64_t addresses[kMaxTensors];
  launch(*stream, addresses, tensor_addresses(tensors, num_tensors_, addresses), seed);
  return true;
}

py::bytes PackedLaunch::pack(const py::tuple& tensors, int64_t seed) const {
  alignas(kSlot) unsigned char slots[kMaxParams * kSlot];
  uint64_t addresses[kMaxTensors];
  const size_t n = fill(slots, addresses, tensor_addresses(tensors, num_tensors_, addresses), seed);
  return py::bytes(reinterpret_cast<const char*>(slots), n * kSlot);
}

size_t PackedLaunch::fill(unsigned char* slots, const uint64_t* addresses, size_t n, int64_t seed) const {
  TORCH_CHECK_VALUE(n >= num_tensors_, "PackedLaunch: a launch takes ", num_tensors_, " tensors, got ", n);
  std::memcpy(slots, params_.data(), params_.size());
  for (const auto& [param, index] : tensor_params_) std::memcpy(slots + param * kSlot, addresses + index, kSlot);
  if (seed_param_ >= 0) std::memcpy(slots + seed_param_ * kSlot, &seed, kSlot);
  return params_.size() / kSlot;
}

void bind_packed_launch(py::module& m) {
  py::class_<PackedLaunch, std::shared_ptr<PackedLaunch>>(m, "PackedLaunch")
      .def(py::init<uint64_t, const std::array<int64_t, 3>&, int64_t, int64_t, const py::bytes&,
                    const std::vector<std::pair<int64_t, int64_t>>&, int64_t, const std::array<uint64_t, 3>&, int64_t,
                    std::optional<uint64_t>>(),
           py::arg("function"), py::arg("grid"), py::arg("block_x"), py::arg("shared_bytes"), py::arg("params"),
           py::arg("tensor_params"), py::arg("seed_param"), py::arg("driver"), py::arg("device_index"),
           py::arg("stream") = py::none())
      .def("launch", &PackedLaunch::launch_tensors, py::arg("tensors"), py::arg("seed") = 0)
      .def("pack", &PackedLaunch::pack, py::arg("tensors"), py::arg("seed") = 0)
      .def_property_readonly("num_params", &PackedLaunch::num_params)
      .def_property_readonly("seed_param", &PackedLaunch::seed_param)
      .def_property_readonly("tensor_slots", &PackedLaunch::tensor_slots);
}

}  // namespace transformer_fast
