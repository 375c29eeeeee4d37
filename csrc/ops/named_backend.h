// A backend chosen by name (backend="triton", TRANSFORMER_FAST_BACKEND, float64 -> plain torch) runs
// below the op's one autograd node: each kernel op has a kernel for the BackendSelect dispatch key
// (which torch keeps in every thread's included set, inference mode too, and which runs after
// autograd and autocast and before the device's kernel). With no backend named it passes the call on
// to the device's kernel; with one it runs that backend's kernel, a Python function
// (transformer_fast/_device_kernels.py, run_named), through run_named_kernel (bindings.cpp). The name
// lives in a thread-local, set for one call by the public Python functions; an autograd node keeps
// the name its forward ran with and sets it again around its backward, which the engine may run in
// another thread.
#pragma once

#include <ATen/core/boxing/impl/boxing.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cstdint>

namespace transformer_fast {

// 0: none (the dispatcher's kernel for the device); else 1 + the index of the backend in
// transformer_fast/_backends.py, BACKENDS ("triton", "cpp", "reference").
inline thread_local int8_t current_named_backend = 0;

inline int8_t named_backend() { return current_named_backend; }

class NamedBackendGuard {
 public:
  explicit NamedBackendGuard(int8_t backend) : previous_(current_named_backend) { current_named_backend = backend; }
  ~NamedBackendGuard() { current_named_backend = previous_; }
  NamedBackendGuard(const NamedBackendGuard&) = delete;
  NamedBackendGuard& operator=(const NamedBackendGuard&) = delete;

 private:
  int8_t previous_;
};

// Runs the Python kernel of `op` for `backend` on the boxed arguments in `stack`, leaving its results
// there (bindings.cpp, where the extension meets Python).
void run_named_kernel(const c10::OperatorName& op, int8_t backend, torch::jit::Stack& stack);

template <class Sig>
struct BackendChoice;

// BackendChoice<Sig>::kernel<&NAME_op>: the BackendSelect kernel of the op NAME.
template <class Ret, class... Args>
struct BackendChoice<Ret(Args...)> {
  template <const c10::TypedOperatorHandle<Ret(Args...)>& (*Op)()>
  static Ret kernel(c10::DispatchKeySet keys, Args... args) {
    if (C10_LIKELY(current_named_backend == 0)) {
      return Op().redispatch(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::BackendSelect),
                             args...);
    }
    torch::jit::Stack stack = c10::impl::boxArgs<Args...>(args...);
    run_named_kernel(Op().operator_name(), current_named_backend, stack);
    return c10::impl::PopResult<Ret>::call(stack);
  }
};

}  // namespace transformer_fast
