// Runs the C++ backend's CUDA attention kernels (csrc/cuda/attention_cuda.cuh) on the CPU, so that
// their logic (indexing, masks, the online softmax, shuffles, ballots and barriers) is tested
// against the float64 reference on machines without a GPU (tests/test_attention_cuda_emulated.py).
//
// Each block runs alone, its kThreads threads as fibers (ucontext) on the calling thread, sharing
// one shared-memory buffer (filled with NaN first, so a read of anything not staged shows). A
// thread runs until it waits at a barrier, then the next ready one runs: thread 0 always reaches
// a barrier first, so a read of what a later thread stages without a barrier between sees NaN, and
// a write past a missing barrier lands before the others read. A warp intrinsic stores each lane's
// value, waits for the warp, reads, and waits again; __syncthreads waits for the block. Lanes that
// skip a shuffle their warp makes (undefined behaviour on a GPU) or a barrier leave every thread
// waiting: the launch raises. (One OS thread per CUDA thread, with condition variables, took
// ~10x as long: thread starts and wake-ups, 128 a block on a 2-core machine.) This checks the
// kernels' logic, not what only a GPU shows (its compiler, memory model and speed): the nvcc
// compile check and the gpu-marked tests do that.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // not <torch/extension.h>: ~30 s less to compile

#include <ucontext.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

// CUDA's built-in index variables of the running thread.
struct EmulatedIndex {
  unsigned x = 0, y = 0, z = 0;
};
thread_local EmulatedIndex threadIdx, blockIdx;

namespace tf_emulation {

struct Hang {};  // thrown out of a barrier wait when no thread of the block can go on

constexpr int kThreadsPerBlock = 128;  // checked against the kernels' kThreads below
constexpr size_t kStackBytes = 256 * 1024;

struct Block;

class Barrier {
 public:
  Barrier(int count, Block* block) : count_(count), block_(block) {}
  void wait();
  void release_waiters();  // makes the waiting threads ready (they see `hung` and throw Hang)

 private:
  int count_;
  Block* block_;
  std::vector<int> waiting_;
};

struct Block {
  enum State { kReady, kWaiting, kDone };
  // Shared memory as sized by the launch, plus a NaN guard: a read past the end shows as NaN.
  Block(size_t shared_bytes, std::function<void()> kernel_)
      : shared(shared_bytes / sizeof(float) + 4096, std::numeric_limits<float>::quiet_NaN()),
        block_barrier(kThreadsPerBlock, this),
        kernel(std::move(kernel_)) {
    for (int w = 0; w < kThreadsPerBlock / 32; ++w) warp_barriers.push_back(std::make_unique<Barrier>(32, this));
  }
  std::vector<float> shared;
  bool hung = false;
  Barrier block_barrier;
  std::vector<std::unique_ptr<Barrier>> warp_barriers;
  float values[kThreadsPerBlock];
  unsigned predicates[kThreadsPerBlock];

  std::function<void()> kernel;
  std::exception_ptr error;  // the first exception a thread threw (the others then hang)
  ucontext_t scheduler;
  ucontext_t contexts[kThreadsPerBlock];
  State state[kThreadsPerBlock];
  int running = 0;

  void suspend() {  // the running thread waits: back to the scheduler
    state[running] = kWaiting;
    swapcontext(&contexts[running], &scheduler);
  }
  void run(unsigned block_index, char* stacks);
};

thread_local Block* block = nullptr;

void Barrier::wait() {
  if (block_->hung) throw Hang{};
  if (static_cast<int>(waiting_.size()) + 1 == count_) {  // the last to arrive: everyone goes on
    release_waiters();
    return;
  }
  waiting_.push_back(block_->running);
  block_->suspend();
  if (block_->hung) throw Hang{};
}

void Barrier::release_waiters() {
  for (int t : waiting_) block_->state[t] = Block::kReady;
  waiting_.clear();
}

void thread_entry() {
  Block* b = block;
  try {
    b->kernel();
  } catch (const Hang&) {
  } catch (...) {  // it must not unwind past the fiber's first frame
    if (!b->error) b->error = std::current_exception();
  }
  b->state[b->running] = Block::kDone;
}  // returns to uc_link: the scheduler

// Runs the threads round-robin, each until it waits or ends, until all have ended. Where none is
// ready but some wait, the block hung: each waiting thread is resumed to throw Hang.
void Block::run(unsigned block_index, char* stacks) {
  block = this;
  blockIdx.x = block_index;
  for (int t = 0; t < kThreadsPerBlock; ++t) {
    getcontext(&contexts[t]);
    contexts[t].uc_stack.ss_sp = stacks + t * kStackBytes;
    contexts[t].uc_stack.ss_size = kStackBytes;
    contexts[t].uc_link = &scheduler;
    makecontext(&contexts[t], thread_entry, 0);
    state[t] = kReady;
  }
  for (;;) {
    bool ran = false, waiting = false;
    for (int t = 0; t < kThreadsPerBlock; ++t) {
      if (state[t] == kWaiting) waiting = true;
      if (state[t] != kReady) continue;
      running = t;
      threadIdx.x = static_cast<unsigned>(t);
      swapcontext(&scheduler, &contexts[t]);
      ran = true;
    }
    if (ran) continue;
    if (!waiting) break;
    hung = true;
    block_barrier.release_waiters();
    for (auto& w : warp_barriers) w->release_waiters();
  }
  block = nullptr;
}

inline float* shared_memory() { return block->shared.data(); }

// A value from lane `src` of the calling thread's warp.
inline float exchange(float v, int src) {
  const int t = static_cast<int>(threadIdx.x), w = t / 32;
  block->values[t] = v;
  block->warp_barriers[w]->wait();
  const float result = block->values[w * 32 + (src & 31)];
  block->warp_barriers[w]->wait();
  return result;
}

}  // namespace tf_emulation

// CUDA's intrinsics, as the kernels use them.
inline void __syncthreads() { tf_emulation::block->block_barrier.wait(); }
inline float __shfl_sync(unsigned, float v, int src) { return tf_emulation::exchange(v, src); }
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  return tf_emulation::exchange(v, static_cast<int>(threadIdx.x % 32) ^ mask);
}
inline unsigned __ballot_sync(unsigned, bool predicate) {
  using tf_emulation::block;
  const int t = static_cast<int>(threadIdx.x), w = t / 32;
  block->predicates[t] = predicate ? 1u : 0u;
  block->warp_barriers[w]->wait();
  unsigned bits = 0;
  for (int lane = 0; lane < 32; ++lane) bits |= block->predicates[w * 32 + lane] << lane;
  block->warp_barriers[w]->wait();
  return bits;
}

#define __global__
#define __device__
#define __launch_bounds__(...)
#define TF_SHARED_MEMORY(name) float* name = tf_emulation::shared_memory()

#include "cuda/attention_cuda.cuh"

namespace tf_emulation {

namespace ck = transformer_fast::cuda_kernels;
using transformer_fast::padding_mask_contiguous;
using transformer_fast::unit_last_stride;
static_assert(ck::kThreads == kThreadsPerBlock, "the emulated block size must match the kernels'");

// launch(kernel, blocks, shared_bytes, args...) for run_forward / run_backward: the blocks one
// after another, each on kThreads fibers.
struct EmulatedLaunch {
  template <typename... Params, typename... Args>
  void operator()(void (*kernel)(Params...), int64_t blocks, size_t shared_bytes, Args... args) const {
    // uninitialised (new char[], not a vector): only the pages a fiber's stack reaches are touched
    std::unique_ptr<char[]> stacks(new char[kThreadsPerBlock * kStackBytes]);
    for (int64_t b = 0; b < blocks; ++b) {
      Block state(shared_bytes, [&] { kernel(args...); });
      state.run(static_cast<unsigned>(b), stacks.get());
      if (state.error) std::rethrow_exception(state.error);
      TORCH_CHECK(!state.hung, "emulated CUDA kernel hung in block ", b,
                  ": some threads skipped a barrier, shuffle or ballot that others made");
    }
  }
};

at::Tensor poisoned(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return at::full(sizes, std::numeric_limits<double>::quiet_NaN(), options);
}

// Poisoned, and laid out as the entry points lay out results (new_output_in_rows_of): in the row
// order of `like`, so that the kernels' strided writes are tested.
at::Tensor poisoned_in_rows_of(const at::Tensor& like, int64_t width, const at::TensorOptions& options) {
  if (like.stride(1) >= like.stride(2)) return poisoned({like.size(0), like.size(1), like.size(2), width}, options);
  return poisoned({like.size(0), like.size(2), like.size(1), width}, options).transpose(1, 2);
}

// As transformer_fast's attention_forward, through the CUDA kernels with a key tile of `tile`.
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                           const std::optional<at::Tensor>& attn_mask,
                                           const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                                           double scale, double dropout_p, int64_t seed, int64_t tile) {
  const at::Tensor q = unit_last_stride(q_in), k = unit_last_stride(k_in), v = unit_last_stride(v_in);
  const at::Tensor pad = padding_mask_contiguous(key_padding_mask);
  const transformer_fast::Problem p =
      transformer_fast::make_problem(q, k, v, attn_mask, pad, is_causal, scale, dropout_p, seed);
  at::Tensor out = poisoned_in_rows_of(q_in, p.Dv, q.options());
  at::Tensor lse = poisoned({p.B, p.H, p.Nq}, q.options().dtype(at::kFloat));
  ck::run_forward(p, q, k, v, out, lse, static_cast<int>(tile), EmulatedLaunch{});
  return {out, lse};
}

// As transformer_fast's attention_backward, with query tile `dkdv_tile` for dK, dV and key tile
// `dq_tile` for dQ.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale, double dropout_p, int64_t seed,
    bool compute_dmask, int64_t dq_tile, int64_t dkdv_tile) {
  const at::Tensor q = unit_last_stride(q_in), k = unit_last_stride(k_in), v = unit_last_stride(v_in);
  const at::Tensor dout = unit_last_stride(dout_in), out = unit_last_stride(out_in);
  const at::Tensor pad = padding_mask_contiguous(key_padding_mask);
  const transformer_fast::Problem p =
      transformer_fast::make_problem(q, k, v, attn_mask, pad, is_causal, scale, dropout_p, seed);
  at::Tensor delta = poisoned({p.B, p.H, p.Nq}, q.options().dtype(at::kFloat));
  at::Tensor dq = poisoned_in_rows_of(q_in, p.D, q.options()), dk = poisoned_in_rows_of(k_in, p.D, k.options());
  at::Tensor dv = poisoned_in_rows_of(v_in, p.Dv, v.options());
  at::Tensor dmask = compute_dmask ? transformer_fast::new_dmask(p, q) : at::Tensor();
  ck::run_backward(p, dout, q, k, v, out, lse.contiguous(), delta, dq, dk, dv, dmask, static_cast<int>(dq_tile),
                   static_cast<int>(dkdv_tile), EmulatedLaunch{});
  return {dq, dk, dv, dmask};
}

}  // namespace tf_emulation

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &tf_emulation::forward);
  m.def("backward", &tf_emulation::backward);
}
