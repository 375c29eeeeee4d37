// transformer_fast._C: loading it registers the ops (ops/schemas.cpp and the TORCH_LIBRARY_IMPL
// blocks of ops/, cpu/ and cuda/). The Python bindings below serve what the dispatcher does not:
//   * the public ops' C++ functions, called directly by the Python functions in eager mode (the
//     same code the dispatcher runs for torch.ops.transformer_fast.<op>, without the boxed call);
//   * their argument checks alone (*_args), for the torch.func transforms (transformer_fast/_transforms.py);
//   * the kernel-level functions, for a backend named by backend= and the context-parallel blocks;
//   * the other way, the call from the ops' BackendSelect kernels into a named backend's Python
//     kernel (run_named_kernel, ops/named_backend.h), and the calling thread's named backend;
//   * the signatures of an op kernel's call and of a Triton launch's arguments (launch/launch_signature.cpp),
//     and launches of compiled Triton kernels from C++ (launch/triton_launch.cpp), for kernels/_launch.py;
//   * the native calls' set-up (launch/native_calls.cpp), for transformer_fast/_native_calls.py;
//   * `direct`, the check that lets a Python function take the first path.
#include "launch/launch_signature.h"
#include "launch/native_calls.h"
#include "launch/triton_launch.h"
#include "ops/attention_ops.h"
#include "ops/layer_norm_ops.h"
#include "ops/linear_attention_ops.h"
#include "ops/named_backend.h"
#include "ops/op_utils.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/forward_grad.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace {

namespace py = pybind11;

at::OptionalIntArrayRef optional_array(const std::optional<std::vector<int64_t>>& values) {
  return values.has_value() ? at::OptionalIntArrayRef(*values) : at::OptionalIntArrayRef();
}

// _C.direct(n_tensors, *args): whether a public Python function may call its op's C++ function
// directly rather than through torch.ops. True when the first n_tensors args are plain tensors
// (torch.Tensor or nn.Parameter: no __torch_function__ of their own; not nested, which the Python
// caller then refuses by name), the first of a dtype the
// kernels take, the other args plain tensors or None, and nothing must see the op itself: no
// TorchFunctionMode, jit.trace, torch.func transform, forward-mode AD level, torch.compile or
// torch.export (torch.compiler._is_compiling_flag; under Dynamo the Python caller asks
// is_dynamo_compiling() first, which Dynamo folds to True), and TRANSFORMER_FAST_BACKEND unset.
// One C call (~0.1 us) in place of the same checks in Python (~1 us of a small call's host time).
PyObject* compiler_module = nullptr;  // torch.compiler
PyObject* compiling_flag_name = nullptr;

bool nothing_must_see_the_op() {
  if (at::impl::torch_function_mode_enabled() || torch::jit::tracer::isTracing()) return false;
  const auto included = c10::impl::tls_local_dispatch_key_set().included_;
  if (included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
      included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode)) {
    return false;
  }
  if (torch::autograd::ForwardADLevel::try_get_by_idx(0) != nullptr) return false;
  if (std::getenv("TRANSFORMER_FAST_BACKEND") != nullptr) return false;
  PyObject* compiling = PyObject_GetAttr(compiler_module, compiling_flag_name);
  if (compiling == nullptr) {
    PyErr_Clear();
    return false;
  }
  Py_DECREF(compiling);
  return compiling == Py_False;
}

PyObject* direct(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  const Py_ssize_t n_tensors = nargs > 0 ? PyLong_AsSsize_t(args[0]) : -1;
  if (n_tensors < 1 || n_tensors >= nargs) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "direct(n_tensors, *args): 1 <= n_tensors <= len(args)");
    return nullptr;
  }
  for (Py_ssize_t i = 1; i < nargs; ++i) {
    if (i > n_tensors && args[i] == Py_None) continue;
    if (!THPVariable_CheckExact(args[i]) || THPVariable_Unpack(args[i]).is_nested()) Py_RETURN_FALSE;
  }
  const auto dtype = THPVariable_Unpack(args[1]).scalar_type();
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf) Py_RETURN_FALSE;
  if (!nothing_must_see_the_op()) Py_RETURN_FALSE;
  Py_RETURN_TRUE;
}

// The named backends' Python kernels (ops/named_backend.h): _device_kernels.run_named(op, backend,
// *args), set once and never freed. The kernel ops' arguments are tensors, None, bools, ints, floats
// and int lists; their results tuples of tensors. to_python converts those few types itself:
// torch::jit::toPyObject needs pybind_utils.h, and a file that included it took 14.5 s to compile.
PyObject* named_kernel_runner = nullptr;

py::object to_python(const c10::IValue& v) {
  if (v.isNone()) return py::none();
  if (v.isTensor()) return py::cast(v.toTensor());
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isInt()) return py::int_(v.toInt());
  if (v.isDouble()) return py::float_(v.toDouble());
  if (v.isIntList()) return py::cast(v.toIntVector());
  TORCH_CHECK(false, "transformer_fast: a kernel op argument of type ", v.tagKind(), " has no Python form here");
}

PyMethodDef direct_method[] = {
    {"direct", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&direct)), METH_FASTCALL,
     "direct(n_tensors, *args) -> bool: whether a public function may call its op's C++ function directly."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

namespace transformer_fast {

void run_named_kernel(const c10::OperatorName& op, int8_t backend, torch::jit::Stack& stack) {
  py::gil_scoped_acquire gil;
  TORCH_CHECK(named_kernel_runner != nullptr, "transformer_fast: no runner for named backends was set");
  py::tuple args(stack.size() + 2);
  args[0] = py::str(op.name.substr(op.name.find("::") + 2));
  args[1] = py::int_(backend);
  for (size_t i = 0; i < stack.size(); ++i) args[i + 2] = to_python(stack[i]);
  stack.clear();
  const py::object results = py::reinterpret_borrow<py::object>(named_kernel_runner)(*args);
  for (const py::handle t : results) stack.emplace_back(py::cast<at::Tensor>(t));
}

}  // namespace transformer_fast

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace tf = transformer_fast;
  namespace py = pybind11;
  m.doc() = "transformer_fast C++ kernels and op registrations (CPU; CUDA for attention where built with CUDA)";
  compiler_module = py::module::import("torch.compiler").release().ptr();
  compiling_flag_name = PyUnicode_InternFromString("_is_compiling_flag");
  if (PyModule_AddFunctions(m.ptr(), direct_method) != 0) throw py::error_already_set();

  m.def("scaled_dot_product_attention",
        [](const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
           const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal, std::optional<double> scale,
           bool enable_gqa, const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& seed,
           const std::optional<std::vector<int64_t>>& window_size, std::optional<double> softcap,
           const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks) {
          return tf::scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                                  enable_gqa, key_padding_mask, seed, optional_array(window_size),
                                                  softcap, alibi_slopes, sinks);
        });
  m.def("varlen_attn", [](const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k, int64_t max_q,
                          int64_t max_k, bool return_lse, std::optional<double> scale,
                          const std::vector<int64_t>& window_size, bool enable_gqa,
                          const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& block_table,
                          std::optional<int64_t> num_splits, std::optional<double> softcap,
                          const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
                          double dropout_p, const std::optional<at::Tensor>& seed) {
    return tf::varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_lse, scale, window_size,
                           enable_gqa, seqused_k, block_table, num_splits, softcap, alibi_slopes, sinks, dropout_p,
                           seed);
  });
  m.def("layer_norm", [](const at::Tensor& input, const std::vector<int64_t>& normalized_shape,
                         const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                         std::optional<double> eps, const std::optional<at::Tensor>& residual, bool is_rms) {
    return tf::layer_norm(input, c10::fromIntArrayRefSlow(normalized_shape), weight, bias, eps, residual, is_rms);
  });
  m.def("linear_attention", &tf::linear_attention);
  // A backend by name below the ops' autograd (ops/named_backend.h).
  m.def("set_named_kernel_runner", [](py::object fn) { named_kernel_runner = fn.release().ptr(); });
  m.def("exchange_named_backend", [](int8_t backend) {
    const int8_t previous = tf::current_named_backend;
    tf::current_named_backend = backend;
    return previous;
  }, py::arg("backend"));
  // The attention ops' dropout seed as an int (their checks and messages), for the Python kernels.
  // The sinks' gradient of the ops' autograd formula, for the context-parallel backwards.
  m.def("sinks_gradient", &tf::sinks_gradient, py::arg("delta"), py::arg("lse"), py::arg("sinks"), py::arg("packed"));
  m.def("dropout_seed", &tf::dropout_seed, py::arg("fn"), py::arg("seed"), py::arg("dropout_p"));

  // (q, k, v, attn_mask, key_padding_mask, scale, unbatched, extras): extras is a dict of the kernel
  // ops' arguments beyond the dense masks, by their schema names.
  const auto with_extras = [](const tf::AttentionArgs& a) {
    const tf::AttentionExtras& x = a.x;
    py::dict extras;
    extras["window"] = py::make_tuple(x.window_left, x.window_right);
    extras["softcap"] = x.softcap;
    extras["alibi_slopes"] = x.alibi_slopes;
    extras["sinks"] = x.sinks;
    extras["cu_seq_q"] = x.cu_seq_q;
    extras["cu_seq_k"] = x.cu_seq_k;
    extras["seqused_k"] = x.seqused_k;
    extras["block_table"] = x.block_table;
    extras["max_q"] = x.max_q;
    extras["max_k"] = x.max_k;
    extras["num_splits"] = x.num_splits;
    return py::make_tuple(a.q, a.k, a.v, a.attn_mask, a.key_padding_mask, a.scale, a.unbatched, extras);
  };
  m.def("attention_args", [with_extras](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                        const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                                        std::optional<double> scale, bool enable_gqa,
                                        const std::optional<at::Tensor>& key_padding_mask,
                                        std::optional<std::vector<int64_t>> window_size, std::optional<double> softcap,
                                        const std::optional<at::Tensor>& alibi_slopes,
                                        const std::optional<at::Tensor>& sinks) {
    return with_extras(tf::attention_args(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                          key_padding_mask, optional_array(window_size), softcap, alibi_slopes,
                                          sinks));
  }, py::arg("query"), py::arg("key"), py::arg("value"), py::arg("attn_mask"), py::arg("dropout_p"),
     py::arg("is_causal"), py::arg("scale"), py::arg("enable_gqa"), py::arg("key_padding_mask"),
     py::arg("window_size") = py::none(), py::arg("softcap") = py::none(), py::arg("alibi_slopes") = py::none(),
     py::arg("sinks") = py::none());
  m.def("varlen_args", [with_extras](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k,
                                     int64_t max_q, int64_t max_k, std::optional<double> scale,
                                     const std::vector<int64_t>& window_size, bool enable_gqa,
                                     const std::optional<at::Tensor>& seqused_k,
                                     const std::optional<at::Tensor>& block_table, std::optional<int64_t> num_splits,
                                     std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
                                     const std::optional<at::Tensor>& sinks, double dropout_p) {
    return with_extras(tf::varlen_args(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, enable_gqa,
                                       seqused_k, block_table, num_splits, softcap, alibi_slopes, sinks, dropout_p));
  });
  m.def("layer_norm_args", [](const at::Tensor& input, const std::vector<int64_t>& normalized_shape,
                              const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                              std::optional<double> eps, const std::optional<at::Tensor>& residual, bool is_rms) {
    const auto a = tf::layer_norm_args(input, c10::fromIntArrayRefSlow(normalized_shape), weight, bias, eps, residual,
                                       is_rms);
    return py::make_tuple(a.x, a.residual, a.weight, a.bias, a.eps, a.rows_empty);
  });
  m.def("linear_attention_args", [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool is_causal,
                                    const std::optional<at::Tensor>& key_padding_mask, double eps,
                                    const std::optional<at::Tensor>& initial_S,
                                    const std::optional<at::Tensor>& initial_z) {
    const auto a = tf::linear_attention_args(q, k, v, is_causal, key_padding_mask, eps, initial_S, initial_z);
    return py::make_tuple(a.q, a.k, a.v, a.key_padding_mask, a.initial_S, a.initial_z);
  });

  // The kernel-level attention functions take every argument of their op, positionally: a call
  // (transformer_fast/_attention_call.py) spread into them.
  m.def("attention_forward", &tf::CallKernel<tf::AttentionForwardCall>::of<&tf::attention_forward>);
  m.def("attention_backward", &tf::CallKernel<tf::AttentionBackwardCall>::of<&tf::attention_backward>);
  m.def("launch_plan_signature", &tf::launch_plan_signature, py::arg("args"));
  m.def("triton_launch_signature", &tf::triton_launch_signature, py::arg("args"));
  tf::bind_packed_launch(m);
  tf::bind_native_calls(m);
  m.def("layer_norm_forward", &tf::layer_norm_forward);
  m.def("layer_norm_backward", &tf::layer_norm_backward);
  m.def("linear_attention_forward", &tf::linear_attention_forward);
  m.def("linear_attention_backward", &tf::linear_attention_backward);
#if defined(TRANSFORMER_FAST_WITH_CUDA)
  m.def("attention_forward_cuda", &tf::CallKernel<tf::AttentionForwardCall>::of<&tf::attention_forward_cuda>);
  m.def("attention_backward_cuda", &tf::CallKernel<tf::AttentionBackwardCall>::of<&tf::attention_backward_cuda>);
  m.def("register_cuda_kernels", &tf::register_cuda_kernels);
#endif
  // Whether the CPU kernels' bf16/fp16 tile products use the CPU's own (cpu/cpu_blas.h), for tests.
  m.def("native_lowp_products", &tf::native_lowp_products, py::arg("dtype"));
  // The kernel families that also run on CUDA tensors in this build.
  m.def("cuda_families", [] {
#if defined(TRANSFORMER_FAST_WITH_CUDA)
    return std::vector<std::string>{"attention"};
#else
    return std::vector<std::string>{};
#endif
  });
}
