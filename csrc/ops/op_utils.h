// Helpers of the dispatcher layer (*_op.cpp): argument checks whose messages name the argument, the
// expected and the actual value (TORCH_CHECK_VALUE raises ValueError in Python, TORCH_CHECK_TYPE
// TypeError); torch's autocast rules; and typed handles to call an op through the dispatcher.
// Shapes are read as SymInts, so the checks also run while torch.compile traces with dynamic shapes.
#pragma once

#include "ops/new_tensors.h"

#include <ATen/autocast_mode.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <optional>
#include <sstream>
#include <string>

namespace transformer_fast {

constexpr int64_t kMaxHeadDim = 256;  // the widest head the tile tables of every backend cover

// Python's spelling of a dtype ("torch.float32"), as the messages of torch.nn.functional read.
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kBool: return "torch.bool";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    default: return std::string("torch.") + c10::toString(t);
  }
}

// A shape as Python prints a tuple: "(2, 3)", "(5,)", "()".
inline std::string shape_str(c10::SymIntArrayRef shape) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << (shape.size() == 1 ? ",)" : ")");
  return s.str();
}

inline void check_floating(const char* name, const at::Tensor& t) {
  TORCH_CHECK_TYPE(t.is_floating_point(), name, " must be a floating-point tensor, got dtype ",
                   dtype_name(t.scalar_type()));
}

inline void check_ndim(const char* name, const at::Tensor& t, bool ok, const char* expected) {
  TORCH_CHECK_VALUE(ok, name, " must have ", expected, " dimensions, got shape ", shape_str(t.sym_sizes()));
}

inline void check_same_device(const char* name, const at::Tensor& t, const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " is on ", t.device(), " but ", ref_name, " is on ",
                    ref.device(), "; they must share a device");
}

inline void check_same_dtype(const char* name, const at::Tensor& t, const char* ref_name, const at::Tensor& ref) {
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), name, " has dtype ", dtype_name(t.scalar_type()), " but ",
                   ref_name, " has ", dtype_name(ref.scalar_type()), "; they must match");
}

// t.shape[dim] == expected; `what` says what the dim is ("batch", "key length, as key").
inline void check_size(const char* name, const at::Tensor& t, int64_t dim, const c10::SymInt& expected,
                       const char* what) {
  TORCH_CHECK_VALUE(t.sym_size(dim) == expected, name, ".shape[", dim, "] (", what, ") must be ", expected,
                    ", got ", t.sym_size(dim), " (shape ", shape_str(t.sym_sizes()), ")");
}

inline void check_head_dim(const char* name, const c10::SymInt& size) {
  TORCH_CHECK_VALUE(size >= 1 && size <= kMaxHeadDim, name, " head dim must be between 1 and ", kMaxHeadDim,
                    ", got ", size);
}

// A dropout seed as the attention ops take it: a one-element int64 CPU tensor, or None without
// dropout. A tensor, so that torch.compile keeps the public ops' draw from torch's generator in its
// graph (an int would need .item(), a graph break); on the CPU, so reading it never waits for a device.
inline int64_t dropout_seed(const char* fn, const std::optional<at::Tensor>& seed, double dropout_p) {
  if (!seed.has_value() || !seed->defined()) {
    TORCH_CHECK_VALUE(dropout_p == 0.0, fn, ": dropout_p = ", dropout_p, " needs a seed (a one-element int64 "
                      "CPU tensor), got None");
    return 0;
  }
  TORCH_CHECK_TYPE(seed->scalar_type() == at::kLong, fn, ": seed must be an int64 tensor, got dtype ",
                   dtype_name(seed->scalar_type()));
  TORCH_CHECK_VALUE(seed->device().is_cpu() && seed->numel() == 1, fn, ": seed must be a one-element CPU tensor, "
                    "got shape ", shape_str(seed->sym_sizes()), " on ", seed->device());
  return *seed->const_data_ptr<int64_t>();
}

// (B, Nk) bool, True = padded key; returned as given.
inline void check_key_padding_mask(const std::optional<at::Tensor>& mask, const c10::SymInt& B,
                                   const c10::SymInt& Nk, const at::Tensor& ref) {
  if (!mask.has_value()) return;
  TORCH_CHECK_TYPE(mask->scalar_type() == at::kBool,
                   "key_padding_mask must be a bool tensor (True = padded key), got dtype ",
                   dtype_name(mask->scalar_type()));
  TORCH_CHECK_VALUE(mask->dim() == 2 && mask->sym_size(0) == B && mask->sym_size(1) == Nk,
                    "key_padding_mask must have shape (batch, key_len) = (", B, ", ", Nk, "), got ",
                    shape_str(mask->sym_sizes()));
  check_same_device("key_padding_mask", *mask, "query", ref);
}

// The kernels take a unit stride along the last dim; any other stride is kept.
inline at::Tensor with_unit_last_stride(const at::Tensor& t) {
  return (t.sym_size(-1) <= 1 || t.sym_stride(-1) == 1) ? t : t.contiguous();
}

// The ops' contract: results a call does not produce are empty tensors, not None.
inline at::Tensor or_empty(const at::Tensor& t, const at::Tensor& like) {
  return t.defined() ? t : new_tensor({0}, like.options());
}

// ---- autocast -------------------------------------------------------------------------------
inline bool autocast_device(c10::DeviceType device) {
  return device == c10::DeviceType::CPU || device == c10::DeviceType::CUDA;
}

// The dtype torch's autocast gives the inputs of an op on its lower-precision list (SDPA,
// matmul) on `device`; nullopt where autocast is off there.
inline std::optional<at::ScalarType> autocast_lower_precision(c10::DeviceType device) {
  if (!autocast_device(device) || !at::autocast::is_autocast_enabled(device)) return std::nullopt;
  return at::autocast::get_autocast_dtype(device);
}

// layer_norm and rms_norm: CUDA autocast runs them in float32, CPU autocast leaves them alone.
inline std::optional<at::ScalarType> autocast_norm(c10::DeviceType device) {
  if (device != c10::DeviceType::CUDA || !at::autocast::is_autocast_enabled(device)) return std::nullopt;
  return at::kFloat;
}

// t cast as autocast casts an op's argument (floating, not float64, on `device`); t where dtype is nullopt.
inline at::Tensor autocast_arg(const std::optional<at::ScalarType>& dtype, const at::Tensor& t,
                               c10::DeviceType device) {
  return dtype.has_value() ? at::autocast::cached_cast(*dtype, t, device) : t;
}
inline std::optional<at::Tensor> autocast_arg(const std::optional<at::ScalarType>& dtype,
                                              const std::optional<at::Tensor>& t, c10::DeviceType device) {
  return t.has_value() ? std::optional<at::Tensor>(autocast_arg(dtype, *t, device)) : std::nullopt;
}

// Kernels run with autocast off, so that no ATen call inside them is autocast.
using AutocastOff = c10::impl::ExcludeDispatchKeyGuard;
inline AutocastOff autocast_off() { return AutocastOff(c10::autocast_dispatch_keyset); }

// ---- autograd -------------------------------------------------------------------------------
// Whether autograd must record a call with these inputs.
inline bool any_requires_grad() { return false; }
template <typename... Rest>
bool any_requires_grad(const at::Tensor& t, const Rest&... rest);
template <typename... Rest>
bool any_requires_grad(const std::optional<at::Tensor>& t, const Rest&... rest);
template <typename... Rest>
bool any_requires_grad(const at::Tensor& t, const Rest&... rest) {
  return t.requires_grad() || any_requires_grad(rest...);
}
template <typename... Rest>
bool any_requires_grad(const std::optional<at::Tensor>& t, const Rest&... rest) {
  return (t.has_value() && t->requires_grad()) || any_requires_grad(rest...);
}
template <typename... Tensors>
bool requires_grad(const Tensors&... tensors) {
  return at::GradMode::is_enabled() && any_requires_grad(tensors...);
}

// ---- calling an op through the dispatcher ---------------------------------------------------
// NAME_op(): a typed handle to transformer_fast::NAME, looked up once; NAME_op().call(...) dispatches.
#define TRANSFORMER_FAST_OP(NAME, SIGNATURE)                                                          \
  inline const c10::TypedOperatorHandle<SIGNATURE>& NAME##_op() {                                   \
    static const auto handle =                                                                      \
        c10::Dispatcher::singleton().findSchemaOrThrow("transformer_fast::" #NAME, "").typed<SIGNATURE>(); \
    return handle;                                                                                  \
  }

}  // namespace transformer_fast
