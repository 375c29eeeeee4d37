// The softmax-attention kernel ops' arguments beyond q, k, v and the dense masks, gathered once
// by every entry point (CPU, CUDA) and by the public ops' checks.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace transformer_fast {

// The kernel ops' arguments beyond q, k, v and the dense masks (schemas.cpp; their meaning is the
// contract in transformer_fast/attention.py): a sliding window, soft-capping, ALiBi, sinks, packed
// variable-length sequences (with a paged key/value cache), the decoding split and the query
// position offset (a block of a longer sequence: context parallelism).
struct AttentionExtras {
  int64_t window_left = -1, window_right = -1;  // -1: unbounded
  double softcap = 0.0;                         // 0: none
  std::optional<at::Tensor> alibi_slopes;       // (B, H) float32 view
  std::optional<at::Tensor> sinks;              // (H,) float32
  std::optional<at::Tensor> cu_seq_q, cu_seq_k, seqused_k, block_table;  // int32; cu_seq_q: packed mode
  int64_t max_q = 0, max_k = 0;
  int64_t num_splits = 0;  // 0: the kernel chooses; 1: never split
  // Query i sits at key position i + Nk - Nq + query_offset (the window's and ALiBi's alignment).
  int64_t query_offset = 0;
  bool packed() const { return cu_seq_q.has_value(); }
  // Whether anything beyond the dense masks is asked for (the decoding split is a kernel's choice).
  bool any() const {
    return window_left >= 0 || window_right >= 0 || softcap != 0.0 || alibi_slopes.has_value() ||
           sinks.has_value() || packed();
  }
};

// The query offset's range, the same in every backend: positions stay within 32-bit integers in
// the GPU kernels (kernels/attention.py).
constexpr int64_t kMaxQueryOffset = int64_t{1} << 30;

inline void check_query_offset(const char* fn, int64_t query_offset) {
  TORCH_CHECK_VALUE(query_offset >= -kMaxQueryOffset && query_offset <= kMaxQueryOffset, fn,
                    ": query_offset must be in [-2^30, 2^30], got ", query_offset);
}

inline AttentionExtras make_extras(at::IntArrayRef window, double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                   const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& cu_seq_q,
                                   const std::optional<at::Tensor>& cu_seq_k,
                                   const std::optional<at::Tensor>& seqused_k,
                                   const std::optional<at::Tensor>& block_table, int64_t max_q, int64_t max_k,
                                   int64_t num_splits, int64_t query_offset) {
  TORCH_CHECK(window.size() == 2, "window must have two entries (left, right), got ", window.size());
  AttentionExtras x;
  x.window_left = window[0];
  x.window_right = window[1];
  x.softcap = softcap;
  x.alibi_slopes = alibi_slopes;
  x.sinks = sinks;
  x.cu_seq_q = cu_seq_q;
  x.cu_seq_k = cu_seq_k;
  x.seqused_k = seqused_k;
  x.block_table = block_table;
  x.max_q = max_q;
  x.max_k = max_k;
  x.num_splits = num_splits;
  x.query_offset = query_offset;
  return x;
}

}  // namespace transformer_fast
