// CUDA launches of the C++ backend's softmax attention kernels (attention_cuda.cuh), on the
// current stream of the tensors' device. Built only where torch has CUDA (_build_config.py).

#include "cuda/attention_cuda.cuh"
#include "ops/attention_ops.h"
#include "ops/op_utils.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

namespace transformer_fast {
namespace {

using namespace cuda_kernels;

// The largest tile (32, 16 or 8) whose shared memory fits the device's per-block limit.
template <typename BytesOf>
int pick_tile(BytesOf bytes_of, int device, const char* what) {
  int limit = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  for (int tile = 32; tile >= 8; tile /= 2) {
    if (bytes_of(tile) <= static_cast<size_t>(limit)) return tile;
  }
  TORCH_CHECK(false, what, ": head dims too large for this GPU's shared memory (", limit, " bytes per block)");
  return 0;
}

struct CudaLaunch {
  cudaStream_t stream;
  template <typename... Params, typename... Args>
  void operator()(void (*kernel)(Params...), int64_t blocks, size_t shared_bytes, Args... args) const {
    if (shared_bytes > 48 * 1024) {  // the default limit; more needs an explicit opt-in
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(shared_bytes)));
    }
    kernel<<<static_cast<unsigned>(blocks), kThreads, shared_bytes, stream>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

void attention_fwd_cuda(const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        at::Tensor& out, at::Tensor& lse) {
  const c10::cuda::CUDAGuard guard(q.device());
  const int tile = pick_tile([&](int t) { return fwd_shared_bytes(p, t); }, q.get_device(), "attention_forward");
  run_forward(p, q, k, v, out, lse, tile, CudaLaunch{c10::cuda::getCurrentCUDAStream()});
}

void attention_bwd_cuda(const Problem& p, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq,
                        at::Tensor& dk, at::Tensor& dv, at::Tensor& dmask) {
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor delta = at::empty({p.B, p.H, p.Nq}, q.options().dtype(at::kFloat));
  const int dq_tile = pick_tile([&](int t) { return dq_shared_bytes(p, t); }, q.get_device(), "attention_backward");
  const int dkdv_tile =
      pick_tile([&](int t) { return dkdv_shared_bytes(p, t); }, q.get_device(), "attention_backward");
  run_backward(p, dout, q, k, v, out, lse, delta, dq, dk, dv, dmask, dq_tile, dkdv_tile,
               CudaLaunch{c10::cuda::getCurrentCUDAStream()});
}

}  // namespace

// The C++ CUDA kernels serve the dense masks only; with Triton (the CUDA path) every feature runs.
// The query offset moves only the window and ALiBi, so it changes nothing here (its range is checked
// as everywhere).
static void check_dense_only(const AttentionExtras& x, const char* fn) {
  check_query_offset(fn, x.query_offset);
  TORCH_CHECK_NOT_IMPLEMENTED(!x.any(), fn, ": the C++ CUDA attention kernels (the fallback where Triton is "
                              "missing) do not implement sliding windows, softcap, ALiBi, sinks or packed "
                              "sequences; install Triton to run them on CUDA tensors");
}

std::tuple<at::Tensor, at::Tensor> attention_forward_cuda(const AttentionForwardCall& c) {
  check_dense_only(c.extras(), "attention_forward");
  return attention_forward_entry(c10::DeviceType::CUDA, c.q, c.k, c.v, c.attn_mask, c.key_padding_mask, c.is_causal,
                                 c.scale, c.dropout_p, dropout_seed("attention_forward", c.seed, c.dropout_p),
                                 attention_fwd_cuda);
}

// compute_delta and sinks serve attention sinks, which these kernels do not take (the forward refuses them).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const AttentionBackwardCall& c) {
  AttentionExtras x = c.extras();
  x.sinks.reset();  // the forward's, which it refused: the backward only reads them to rescale rows
  check_dense_only(x, "attention_backward");
  TORCH_CHECK_NOT_IMPLEMENTED(!c.compute_delta, "attention_backward: the C++ CUDA kernels do not compute delta (it "
                              "serves attention sinks, which need the Triton kernels: install Triton)");
  auto [dq, dk, dv, dmask] = attention_backward_entry(c10::DeviceType::CUDA, c.dout, c.q, c.k, c.v, c.out, c.lse,
                                                      c.attn_mask, c.key_padding_mask, c.is_causal, c.scale,
                                                      c.dropout_p, dropout_seed("attention_backward", c.seed,
                                                                                c.dropout_p),
                                                      c.compute_dmask, attention_bwd_cuda);
  return {dq, dk, dv, dmask, at::Tensor()};
}

namespace {

// The attention_backward op's kernel for this device: attention_backward_cuda with the results a call does not
// produce as empty tensors (an op cannot return None).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda_kernel(
    const AttentionBackwardCall& c) {
  auto [dq, dk, dv, dmask, delta] = attention_backward_cuda(c);
  return {dq, dk, dv, or_empty(dmask, c.q), or_empty(delta, c.q)};
}

}  // namespace

// Registered on request rather than by TORCH_LIBRARY_IMPL: where Triton loads, its kernels hold the
// CUDA key, and a second registration for the key would override one of the two.
void register_cuda_kernels() {
  static torch::Library library(torch::Library::IMPL, "transformer_fast", c10::DispatchKey::CUDA, __FILE__,
                                __LINE__);
  static const bool registered = [] {
    library.impl("attention_forward", TORCH_FN(CallKernel<AttentionForwardCall>::of<&attention_forward_cuda>));
    library.impl("attention_backward",
                 TORCH_FN(CallKernel<AttentionBackwardCall>::of<&attention_backward_cuda_kernel>));
    return true;
  }();
  (void)registered;
}

}  // namespace transformer_fast
