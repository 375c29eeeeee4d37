// launch/: the native Triton launch runtime, the C++ half of the GPU Triton path's launches: the
// signatures that key the launch plans of kernels/_launch.py (launch_signature.cpp), a compiled
// Triton kernel launched with its parameters packed once (triton_launch.cpp), and, in this file,
// native calls, which replay a call's launches without running Python.
//
// Why it exists: on a GPU whole models are host-bound, and each attention or norm call through
// Triton's Python launcher cost more host time than torch's own op. docs/performance.md ("Host
// cost per call") measured Hugging Face BERT-base against the same model on `sdpa`: with every
// launch through Triton's `run`, its forward and training step ran 0.61-0.64x the `sdpa` model's
// speed (on an H200); with direct launches from Python, 0.71-0.73x its forward (on an H100); with
// native calls, on an H100 in bf16 autocast, the forward ran 1.06x at 32 x 128 and 1.18x at 8 x 512,
// the training step 1.10x and 1.18x.
//
// It stays behind one switch: TRANSFORMER_FAST_NATIVE_LAUNCH=0 turns packed launches and native
// calls off together (kernels/_launch.py reads it once, as _NATIVE; transformer_fast/_device_kernels.py
// registers native calls only where _native_calls_on() says so), and the Triton kernels then launch
// from Python. No CUDA header is included, so the CPU build compiles this folder too.
//
// Native calls: the CUDA kernels of the Triton ops as one boxed C++ kernel that replays, for a call
// signature it has seen, what the Python launcher did for it: the same new tensors, the same packed
// launches (triton_launch.cpp) with this call's tensors and seed, the same results. No Python
// runs on such a call, so it costs what an ATen op costs on the host plus the driver's launches.
//
// A call's signature is every argument (a tensor's dtype, device, sizes, strides and address mod 16;
// an int's, float's, bool's or list's value; a dropout seed's class, kernels/_launch.seed_class),
// plus which tensor arguments share an address. Equal signatures mean equal launch plans in Python
// (whose own key, launch_plan_signature, reads less), so equal launches but for the tensors' addresses and
// the seed. The first call of a signature runs the Python kernel; a later one runs it while
// recording what it allocates and launches (transformer_fast/_native_calls.py), and keeps that as
// the signature's recipe where every launch was packed and every tensor it touched is an argument,
// a tensor it allocated, or a view of one. Calls whose shapes change every time (decoding from a
// growing cache) thus never record, and run the Python kernel as before.
//
// Recipes hold packed launches of the compiled kernels Triton made: kernels/_launch.py clears them
// whenever it forgets its plans or kernels (a tile override, a tool dropping compiled kernels).
#include "launch/native_calls.h"

#include "launch/launch_signature.h"
#include "launch/triton_launch.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace transformer_fast {

namespace py = pybind11;

namespace {

enum class NewKind : int64_t { kScratch = 0, kZeros = 1, kOutput = 2, kCopy = 3 };

struct NewTensor {  // contiguous, of `sizes`
  NewKind kind;
  std::vector<int64_t> sizes;
  at::TensorOptions options;
  int64_t source = -1;  // kCopy: the argument copied, read as source_sizes / source_strides
  std::vector<int64_t> source_sizes, source_strides;
};

struct TensorRef {  // a launch's tensor: an argument of the call, or a new tensor
  bool is_new;
  int64_t index;
};

struct Launch {
  std::shared_ptr<PackedLaunch> packed;
  std::vector<TensorRef> tensors;
};

struct Result {  // a view of a new tensor, or (new_index -1) an empty tensor
  int64_t new_index;
  std::vector<int64_t> sizes, strides;
  int64_t offset;
  at::TensorOptions options;
};

struct Recipe {
  std::vector<NewTensor> news;
  std::vector<Launch> launches;
  std::vector<Result> results;
};

constexpr size_t kMaxRecipes = 4096;  // per op; a full table starts again (shapes that change every call)

struct NativeOp {
  int64_t seed_arg = -1;
  std::atomic<int64_t> replayed{0};  // calls made from a recipe
  std::unordered_map<std::string, std::shared_ptr<const Recipe>> recipes;
  std::unordered_set<std::string> seen;  // signatures called once, not yet recorded
};

struct Registry {
  std::mutex mutex;
  std::unordered_map<std::string, NativeOp> ops;  // by the op's name, "<namespace>::<name>"
  py::object python_call;  // transformer_fast._native_calls.call(name, args, record, seed) -> (results, recipe)
  bool poison = false;     // new outputs NaN-filled (-1 for ints), as kernels/_new_tensors.new_output
};

Registry& registry() {
  static auto* r = new Registry();  // never destroyed: it holds Python objects
  return *r;
}

// A dropout seed argument's value (ops/op_utils.h, dropout_seed): 0 for None, nothing for a tensor
// that is not a one-element int64 CPU tensor.
std::optional<int64_t> seed_value(const c10::IValue& v) {
  if (!v.isTensor()) return 0;
  const at::Tensor& t = v.toTensor();
  if (t.scalar_type() != at::kLong || !t.device().is_cpu() || t.numel() != 1) return std::nullopt;
  return *t.const_data_ptr<int64_t>();
}

// Appends an argument's fields; false for one of a kind the signature does not cover.
bool append_arg(std::string& signature, const c10::IValue& v, bool is_seed) {
  if (is_seed && v.isTensor()) {  // what Triton specialises on of its value (kernels/_launch.seed_class)
    const std::optional<int64_t> value = seed_value(v);
    if (!value.has_value()) return false;  // not a seed: the Python kernel says why
    signature += 'S';
    signature += static_cast<char>((*value == 1) | ((*value % 16 == 0) << 1) |
                                   ((*value >= std::numeric_limits<int32_t>::min() &&
                                     *value <= std::numeric_limits<int32_t>::max()) << 2));
  } else if (v.isNone()) {
    signature += 'N';
  } else if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.has_storage()) return false;
    append_tensor_signature(signature, t);
  } else if (v.isBool()) {
    signature += v.toBool() ? 'Y' : 'B';
  } else if (v.isInt()) {
    signature += 'I';
    append_value(signature, v.toInt());
  } else if (v.isDouble()) {
    signature += 'F';
    append_value(signature, v.toDouble());
  } else if (v.isIntList()) {
    const auto values = v.toIntList();
    signature += 'L';
    append_value(signature, static_cast<int64_t>(values.size()));
    for (const int64_t value : values) append_value(signature, value);
  } else {
    return false;
  }
  return true;
}

// The call's signature (see the top of the file), or "" for arguments it does not cover.
std::string recipe_signature(c10::ArrayRef<c10::IValue> args, int64_t seed_arg) {
  std::string signature;
  signature.reserve(48 * args.size());
  std::vector<const void*> addresses;
  for (size_t i = 0; i < args.size(); ++i) {
    if (!append_arg(signature, args[i], static_cast<int64_t>(i) == seed_arg)) return {};
    if (args[i].isTensor()) addresses.push_back(args[i].toTensor().data_ptr());
  }
  for (size_t i = 0; i < addresses.size(); ++i) {  // which earlier tensor argument shares its address
    size_t first = i;
    for (size_t j = 0; j < i; ++j) {
      if (addresses[j] == addresses[i]) {
        first = j;
        break;
      }
    }
    signature += static_cast<char>(first);
  }
  return signature;
}

at::Tensor make_new(const NewTensor& n, c10::ArrayRef<c10::IValue> args, bool poison) {
  switch (n.kind) {
    case NewKind::kZeros:
      return at::zeros(n.sizes, n.options);
    case NewKind::kOutput:
      if (poison) {
        return at::full(n.sizes, at::isFloatingType(c10::typeMetaToScalarType(n.options.dtype()))
                                     ? std::numeric_limits<double>::quiet_NaN() : -1.0, n.options);
      }
      return at::empty(n.sizes, n.options);
    case NewKind::kCopy: {
      at::Tensor copy = at::empty(n.sizes, n.options);
      copy.copy_(args[n.source].toTensor().as_strided(n.source_sizes, n.source_strides));
      return copy;
    }
    case NewKind::kScratch:
      break;
  }
  return at::empty(n.sizes, n.options);
}

// Runs `recipe` with the call's `args`: its results, or nothing where it cannot launch from this
// thread (another device is current, or no CUDA context): the Python kernel then runs.
std::optional<std::vector<at::Tensor>> run_recipe(const Recipe& recipe, c10::ArrayRef<c10::IValue> args,
                                                  int64_t seed, bool poison) {
  const std::optional<void*> stream = recipe.launches.front().packed->stream_here();
  if (!stream.has_value()) return std::nullopt;
  std::vector<at::Tensor> news;
  news.reserve(recipe.news.size());
  for (const NewTensor& n : recipe.news) news.push_back(make_new(n, args, poison));
  uint64_t addresses[PackedLaunch::kMaxTensors];
  for (const Launch& launch : recipe.launches) {
    for (size_t i = 0; i < launch.tensors.size(); ++i) {
      const TensorRef& ref = launch.tensors[i];
      const at::Tensor& t = ref.is_new ? news[ref.index] : args[ref.index].toTensor();
      addresses[i] = reinterpret_cast<uintptr_t>(t.data_ptr());
    }
    launch.packed->launch(*stream, addresses, launch.tensors.size(), seed);
  }
  std::vector<at::Tensor> results;
  results.reserve(recipe.results.size());
  for (const Result& r : recipe.results) {
    results.push_back(r.new_index < 0 ? at::empty_strided(r.sizes, r.strides, r.options)
                                      : news[r.new_index].as_strided(r.sizes, r.strides, r.offset));
  }
  return results;
}

std::vector<int64_t> int_list(const py::handle& h) { return h.cast<std::vector<int64_t>>(); }

at::TensorOptions options_of(const py::handle& h) { return h.cast<at::Tensor>().options(); }

// The recipe transformer_fast/_native_calls.py describes (see its `recipe`), checked against the
// call's arguments.
std::shared_ptr<const Recipe> parse_recipe(const py::tuple& described, size_t n_args) {
  auto recipe = std::make_shared<Recipe>();
  for (const py::handle& item : described[0].cast<py::list>()) {
    const auto t = item.cast<py::tuple>();
    NewTensor n{static_cast<NewKind>(t[0].cast<int64_t>()), int_list(t[1]), options_of(t[2])};
    if (n.kind == NewKind::kCopy) {
      n.source = t[3].cast<int64_t>();
      n.source_sizes = int_list(t[4]);
      n.source_strides = int_list(t[5]);
      TORCH_CHECK(n.source >= 0 && static_cast<size_t>(n.source) < n_args, "native calls: copy of argument ",
                  n.source, " of ", n_args);
    }
    recipe->news.push_back(std::move(n));
  }
  for (const py::handle& item : described[1].cast<py::list>()) {
    const auto t = item.cast<py::tuple>();
    Launch launch{t[0].cast<std::shared_ptr<PackedLaunch>>(), {}};
    for (const py::handle& ref : t[1].cast<py::list>()) {
      const auto r = ref.cast<py::tuple>();
      TensorRef tr{r[0].cast<bool>(), r[1].cast<int64_t>()};
      const size_t bound = tr.is_new ? recipe->news.size() : n_args;
      TORCH_CHECK(tr.index >= 0 && static_cast<size_t>(tr.index) < bound, "native calls: tensor ", tr.index,
                  " out of range");
      launch.tensors.push_back(tr);
    }
    TORCH_CHECK(launch.tensors.size() >= launch.packed->num_tensors() &&
                launch.tensors.size() <= PackedLaunch::kMaxTensors, "native calls: a launch given ",
                launch.tensors.size(), " tensors");
    TORCH_CHECK(recipe->launches.empty() ||
                launch.packed->device_index() == recipe->launches.front().packed->device_index(),
                "native calls: launches on more than one device");
    recipe->launches.push_back(std::move(launch));
  }
  TORCH_CHECK(!recipe->launches.empty(), "native calls: a recipe without launches");
  for (const py::handle& item : described[2].cast<py::list>()) {
    const auto t = item.cast<py::tuple>();
    Result r{t[0].cast<int64_t>(), int_list(t[1]), int_list(t[2]), t[3].cast<int64_t>(), options_of(t[4])};
    TORCH_CHECK(r.new_index < static_cast<int64_t>(recipe->news.size()), "native calls: result of new tensor ",
                r.new_index, " out of range");
    recipe->results.push_back(std::move(r));
  }
  return recipe;
}

// The Python kernel's call (recording where asked): its results, as the schema returns them.
std::vector<c10::IValue> call_python(const c10::FunctionSchema& schema, c10::ArrayRef<c10::IValue> args,
                                     const std::string& signature, bool record, int64_t seed) {
  py::gil_scoped_acquire gil;
  Registry& reg = registry();
  py::tuple py_args(args.size());
  for (size_t i = 0; i < args.size(); ++i) py_args[i] = torch::jit::toPyObject(args[i]);
  const py::tuple answer = reg.python_call(schema.name(), py_args, record, seed);
  const py::tuple results = answer[0].cast<py::tuple>();
  const auto& returns = schema.returns();
  TORCH_CHECK(results.size() == returns.size(), "native calls: ", schema.name(), " returned ", results.size(),
              " results, its schema ", returns.size());
  std::vector<c10::IValue> out;
  out.reserve(returns.size());
  for (size_t i = 0; i < returns.size(); ++i) out.push_back(torch::jit::toIValue(results[i], returns[i].type()));
  if (record && !answer[1].is_none()) {
    std::shared_ptr<const Recipe> recipe = parse_recipe(answer[1].cast<py::tuple>(), args.size());
    std::lock_guard<std::mutex> lock(reg.mutex);
    NativeOp& op = reg.ops[schema.name()];
    if (op.recipes.size() >= kMaxRecipes) op.recipes.clear();
    op.recipes[signature] = std::move(recipe);
  }
  return out;
}

std::optional<c10::Device> first_tensor_device(c10::ArrayRef<c10::IValue> args) {
  for (const c10::IValue& arg : args) {
    if (arg.isTensor()) return arg.toTensor().device();
  }
  return std::nullopt;
}

// The kernel: the recipe's call where there is one, else the Python kernel's.
void native_call(const c10::OperatorHandle& handle, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = handle.schema();
  const size_t n_args = schema.arguments().size();
  const auto args = torch::jit::last(*stack, n_args);
  Registry& reg = registry();
  NativeOp* op = nullptr;  // the map's nodes stay where they are: the pointer outlives the lock
  {
    std::lock_guard<std::mutex> lock(reg.mutex);
    op = &reg.ops[schema.name()];
  }
  // Triton launches on the current device (packed launches, and the Python kernel's): make it the
  // call's, as ATen's CUDA kernels do, for a model spread over several GPUs.
  const c10::OptionalDeviceGuard guard(first_tensor_device(args));
  const std::string signature = recipe_signature(args, op->seed_arg);
  std::shared_ptr<const Recipe> recipe;
  bool record = false;
  if (!signature.empty()) {
    std::lock_guard<std::mutex> lock(reg.mutex);
    const auto found = op->recipes.find(signature);
    if (found != op->recipes.end()) {
      recipe = found->second;
    } else {
      if (op->seen.size() >= kMaxRecipes) op->seen.clear();
      record = !op->seen.insert(signature).second;  // seen before: record this call
    }
  }
  const int64_t seed = op->seed_arg >= 0 ? seed_value(args[op->seed_arg]).value_or(0) : 0;
  std::vector<c10::IValue> results;
  std::optional<std::vector<at::Tensor>> ran;
  if (recipe != nullptr) ran = run_recipe(*recipe, args, seed, reg.poison);
  if (ran.has_value()) {
    op->replayed.fetch_add(1, std::memory_order_relaxed);
    for (at::Tensor& t : *ran) results.emplace_back(std::move(t));
  } else {
    results = call_python(schema, args, signature, record, seed);
  }
  torch::jit::drop(*stack, n_args);
  for (c10::IValue& r : results) stack->push_back(std::move(r));
}

}  // namespace

void bind_native_calls(py::module& m) {
  // Makes the ops `names` ("namespace::name") native calls, their misses answered by
  // `python_call(name, args, record, seed)` (seed: the "seed" argument's value, else 0), registered
  // as their kernels for `dispatch_key` (CUDA; the tests and tools register twin ops' CPU kernels,
  // there being no CUDA there).
  m.def("native_calls_setup", [](const std::vector<std::string>& names, py::object python_call, bool poison,
                                 const std::string& dispatch_key) {
    Registry& reg = registry();
    {
      std::lock_guard<std::mutex> lock(reg.mutex);
      reg.python_call = std::move(python_call);
      reg.poison = poison;
    }
    static auto* libraries = new std::unordered_map<std::string, std::unique_ptr<torch::Library>>();
    const c10::DispatchKey key = c10::parseDispatchKey(dispatch_key);
    for (const std::string& name : names) {
      const c10::OperatorHandle handle = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "");
      const auto seed = handle.schema().argumentIndexWithName("seed");
      {
        std::lock_guard<std::mutex> lock(reg.mutex);
        reg.ops[handle.schema().name()].seed_arg = seed.has_value() ? static_cast<int64_t>(*seed) : -1;
      }
      const size_t split = name.find("::");
      const std::string ns = name.substr(0, split);
      auto& library = (*libraries)[ns + "." + dispatch_key];
      if (library == nullptr) {
        library = std::make_unique<torch::Library>(torch::Library::IMPL, ns, key, __FILE__, __LINE__);
      }
      library->impl(name.substr(split + 2).c_str(), torch::CppFunction::makeFromBoxedFunction<&native_call>());
    }
  }, py::arg("names"), py::arg("python_call"), py::arg("poison"), py::arg("dispatch_key"));
  // Drops every recipe (kernels/_launch.py, when it forgets its plans or kernels).
  m.def("native_calls_clear", [] {
    Registry& reg = registry();
    std::lock_guard<std::mutex> lock(reg.mutex);
    for (auto& [name, op] : reg.ops) {
      op.recipes.clear();
      op.seen.clear();
    }
  });
  // (recipes held, calls made from one) of the op `name` ("namespace::name").
  m.def("native_calls_stats", [](const std::string& name) {
    Registry& reg = registry();
    std::lock_guard<std::mutex> lock(reg.mutex);
    const auto found = reg.ops.find(name);
    if (found == reg.ops.end()) return std::make_pair(size_t{0}, int64_t{0});
    return std::make_pair(found->second.recipes.size(), found->second.replayed.load());
  });
}

}  // namespace transformer_fast
