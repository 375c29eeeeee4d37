// One call of an attention kernel op as one object: its arguments by name, in the order of its
// schema (ops/schemas.cpp; their meaning is the contract in transformer_fast/attention.py). The op's
// dispatcher kernels are functions of it: CallKernel<Call>::of<&f> is the kernel, with the schema's
// signature, that gathers the arguments into a Call (by aggregate initialisation, in order) and runs
// f on it. So the argument list is written here and in the schema; a kernel, autograd or autocast
// function names only what it reads, and passes a call on with `forward`.
#pragma once

#include "ops/attention_extras.h"

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace transformer_fast {

using OptTensor = std::optional<at::Tensor>;

struct AttentionForwardCall {
  using Signature = std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&, bool, double,
      double, const OptTensor&, at::IntArrayRef, double, const OptTensor&, const OptTensor&, const OptTensor&,
      const OptTensor&, const OptTensor&, const OptTensor&, int64_t, int64_t, int64_t, int64_t);

  const at::Tensor &q, &k, &v;
  const OptTensor &attn_mask, &key_padding_mask;
  bool is_causal;
  double scale, dropout_p;
  const OptTensor& seed;
  at::IntArrayRef window;
  double softcap;
  const OptTensor &alibi_slopes, &sinks, &cu_seq_q, &cu_seq_k, &seqused_k, &block_table;
  int64_t max_q, max_k, num_splits, query_offset;

  // f(the arguments, in the schema's order).
  template <class F>
  decltype(auto) forward(F&& f) const {
    return f(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, window, softcap, alibi_slopes,
             sinks, cu_seq_q, cu_seq_k, seqused_k, block_table, max_q, max_k, num_splits, query_offset);
  }
  AttentionExtras extras() const {
    return make_extras(window, softcap, alibi_slopes, sinks, cu_seq_q, cu_seq_k, seqused_k, block_table, max_q,
                       max_k, num_splits, query_offset);
  }
};

// compute_dmask: also return dS (the float mask's gradient); compute_delta: also return each row's
// delta (the sinks' gradient needs it). sinks only tell the kernels what a row's P sum to.
struct AttentionBackwardCall {
  using Signature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const OptTensor&, const OptTensor&, bool, double, double, const OptTensor&, bool,
      at::IntArrayRef, double, const OptTensor&, const OptTensor&, const OptTensor&, int64_t, int64_t, bool,
      const OptTensor&, int64_t);

  const at::Tensor &dout, &q, &k, &v, &out, &lse;
  const OptTensor &attn_mask, &key_padding_mask;
  bool is_causal;
  double scale, dropout_p;
  const OptTensor& seed;
  bool compute_dmask;
  at::IntArrayRef window;
  double softcap;
  const OptTensor &alibi_slopes, &cu_seq_q, &cu_seq_k;
  int64_t max_q, max_k;
  bool compute_delta;
  const OptTensor& sinks;
  int64_t query_offset;

  template <class F>
  decltype(auto) forward(F&& f) const {
    return f(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, compute_dmask,
             window, softcap, alibi_slopes, cu_seq_q, cu_seq_k, max_q, max_k, compute_delta, sinks, query_offset);
  }
  AttentionExtras extras() const {
    return make_extras(window, softcap, alibi_slopes, sinks, cu_seq_q, cu_seq_k, std::nullopt, std::nullopt, max_q,
                       max_k, 0, query_offset);
  }
};

template <class Call, class Signature = typename Call::Signature>
struct CallKernel;

template <class Call, class Ret, class... Args>
struct CallKernel<Call, Ret(Args...)> {
  template <Ret (*Kernel)(const Call&)>
  static Ret of(Args... args) {
    return Kernel(Call{args...});
  }
};

// op.call(the call's arguments): the op through the dispatcher.
template <class Call, class Op>
auto call_op(const Op& op, const Call& c) {
  return c.forward([&](const auto&... args) { return op.call(args...); });
}

}  // namespace transformer_fast
