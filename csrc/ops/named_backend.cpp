// The named backend's thread-local and the call into its Python kernels (named_backend.h says why).
#include "ops/named_backend.h"

#include <torch/csrc/jit/python/pybind_utils.h>

namespace transformer_fast {

namespace py = pybind11;

namespace {
thread_local int8_t current_backend = 0;
PyObject* runner = nullptr;  // transformer_fast/_device_kernels.py, run_named; set once, never freed
}  // namespace

int8_t named_backend() { return current_backend; }

NamedBackendGuard::NamedBackendGuard(int8_t backend) : previous_(current_backend) { current_backend = backend; }
NamedBackendGuard::~NamedBackendGuard() { current_backend = previous_; }

void run_named_kernel(const c10::OperatorName& op, int8_t backend, torch::jit::Stack& stack) {
  py::gil_scoped_acquire gil;
  TORCH_CHECK(runner != nullptr, "transformer_fast: no kernel runner for named backends was set");
  const std::string& full = op.name;
  py::tuple args(stack.size() + 2);
  args[0] = py::str(full.substr(full.find("::") + 2));
  args[1] = py::int_(backend);
  for (size_t i = 0; i < stack.size(); ++i) args[i + 2] = torch::jit::toPyObject(std::move(stack[i]));
  stack.clear();
  const py::object results = py::reinterpret_borrow<py::object>(runner)(*args);
  for (const py::handle t : results) stack.emplace_back(py::cast<at::Tensor>(t));
}

void set_named_kernel_runner(PyObject* fn) {
  Py_XINCREF(fn);
  runner = fn;
}

// Sets the calling thread's named backend and returns the previous one (for a Python context manager).
int8_t exchange_named_backend(int8_t backend) {
  const int8_t previous = current_backend;
  current_backend = backend;
  return previous;
}

}  // namespace transformer_fast
