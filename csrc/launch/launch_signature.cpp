// Two signatures of a call's arguments, as bytes objects (hashed by Python in one pass):
//   launch_plan_signature: everything a launcher reads of an op kernel's arguments, for the launch plans of
//     kernels/_launch.py (keyed by it: equal signatures mean the same launches but for the tensors'
//     addresses and a dropout seed's value);
//   triton_launch_signature: what Triton's specialisation reads of a launch's positional arguments,
//     for the direct launches of kernels/_launch.py. Per argument:
//   tensor (torch.Tensor or Parameter, not other subclasses): 'T', dtype, address mod 16
//   bool: 'B' (Triton passes it as u1, whatever its value)
//   int: 'I', width ('4': fits int32, '8': int64, 'U': uint64), 16 if it is 1 (Triton makes a
//        constexpr of it) else its value mod 16 (Triton asks whether it divides by 16)
//   float: 'F' (fp32, whatever its value)
// Anything else (None, another tensor subclass, a tensor without storage, an int beyond uint64)
// gives None: the caller leaves that launch to Triton. Each field is finer than Triton's or
// equal, so equal signatures never mean different compiled kernels.
#include "launch/launch_signature.h"

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <limits>
#include <string>

namespace transformer_fast {

namespace py = pybind11;

namespace {

char int_residue(unsigned long long value) { return static_cast<char>(value & 15); }

// Appends arg's fields; false for an argument of a type it does not cover.
bool append_call_arg(std::string& signature, PyObject* obj) {
  if (obj == Py_None) {
    signature += 'N';
  } else if (THPVariable_Check(obj)) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (!t.has_storage()) return false;
    append_tensor_signature(signature, t);
  } else if (PyBool_Check(obj)) {
    signature += obj == Py_True ? 'Y' : 'B';
  } else if (PyLong_Check(obj)) {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    signature += 'I';
    append_value(signature, value);
  } else if (PyFloat_Check(obj)) {
    signature += 'F';
    append_value(signature, PyFloat_AS_DOUBLE(obj));
  } else if (PyTuple_Check(obj) || PyList_Check(obj)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    signature += 'L';
    append_value(signature, static_cast<int64_t>(n));
    PyObject** items = PySequence_Fast_ITEMS(obj);
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!append_call_arg(signature, items[i])) return false;
    }
  } else {
    return false;
  }
  return true;
}

}  // namespace

void append_tensor_signature(std::string& signature, const at::Tensor& t) {
  signature += 'T';
  signature += static_cast<char>(t.scalar_type());
  signature += static_cast<char>(t.device().type());
  signature += static_cast<char>(t.device().index());
  signature += static_cast<char>(t.dim());
  for (const int64_t size : t.sizes()) append_value(signature, size);
  for (const int64_t stride : t.strides()) append_value(signature, stride);
  signature += static_cast<char>(reinterpret_cast<std::uintptr_t>(t.data_ptr()) & 15);
}

py::object launch_plan_signature(const py::tuple& args) {
  // per argument: a tensor's dtype, device, sizes, strides and address mod 16; None; a bool; an
  // int's or float's exact value; a tuple or list of these. None for anything else (or an int
  // beyond int64): the caller then plans that call afresh.
  std::string signature;
  signature.reserve(32 * args.size());
  for (py::handle arg : args) {
    if (!append_call_arg(signature, arg.ptr())) return py::none();
  }
  return py::bytes(signature);
}

py::object triton_launch_signature(const py::tuple& args) {
  std::string signature;
  signature.reserve(3 * args.size());
  for (py::handle arg : args) {
    PyObject* obj = arg.ptr();
    if (THPVariable_CheckExact(obj)) {
      const at::Tensor& t = THPVariable_Unpack(obj);
      if (!t.has_storage()) return py::none();
      signature += 'T';
      signature += static_cast<char>(t.scalar_type());
      signature += static_cast<char>(reinterpret_cast<std::uintptr_t>(t.data_ptr()) & 15);
    } else if (PyBool_Check(obj)) {
      signature += 'B';
    } else if (PyLong_CheckExact(obj)) {
      int overflow = 0;
      const long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
      signature += 'I';
      if (overflow == 0) {
        const bool fits32 = value >= std::numeric_limits<int32_t>::min() && value <= std::numeric_limits<int32_t>::max();
        signature += fits32 ? '4' : '8';
        signature += value == 1 ? static_cast<char>(16) : int_residue(static_cast<unsigned long long>(value));
      } else {
        const unsigned long long unsigned_value = overflow > 0 ? PyLong_AsUnsignedLongLong(obj) : 0;
        if (overflow < 0 || PyErr_Occurred()) {  // below int64 or beyond uint64: Triton refuses it
          PyErr_Clear();
          return py::none();
        }
        signature += 'U';
        signature += int_residue(unsigned_value);
      }
    } else if (PyFloat_CheckExact(obj)) {
      signature += 'F';
    } else {
      return py::none();
    }
  }
  return py::bytes(signature);
}

}  // namespace transformer_fast
