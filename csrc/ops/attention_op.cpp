// Softmax attention's dispatcher layer: the autograd node of attention_forward (its backward is the
// attention_backward op; the sinks' gradient is formed here from lse and the op's delta) and the
// autocast kernels of both kernel ops. The public ops' checks are in attention_args.cpp.
#include "ops/attention_ops.h"
#include "ops/autograd_node.h"
#include "ops/named_backend.h"
#include "ops/op_utils.h"

#include <array>

namespace transformer_fast {

using AttentionForwardSig = AttentionForwardCall::Signature;
using AttentionBackwardSig = AttentionBackwardCall::Signature;
using AttentionBackwardCompositeSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
    bool, double, at::IntArrayRef, double, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
    int64_t);
TRANSFORMER_FAST_OP(attention_forward, AttentionForwardSig)
TRANSFORMER_FAST_OP(attention_backward, AttentionBackwardSig)
TRANSFORMER_FAST_OP(attention_backward_composite, AttentionBackwardCompositeSig)

// d loss / d sinks[h] = -sum over the rows of head h of P_sink * delta, with P_sink = exp(sinks[h] -
// lse) each row's sink probability and delta = sum_j P_ij dP_ij: the sink takes probability from
// every key in proportion, and has no value. delta is the backward op's (compute_delta), summed from
// the kernels' fp32 P and dP: dO . O (its value in exact arithmetic) would carry O's rounding to
// the query's dtype, and P's before P @ V, into every row of the sum. lse-shaped rows: dense
// (B, H, Nq), packed (H, Tq). (H,), in lse's dtype.
at::Tensor sinks_gradient(const at::Tensor& delta, const at::Tensor& lse, const at::Tensor& sinks, bool packed) {
  const at::Tensor sink = packed ? sinks.unsqueeze(1) : sinks.view({1, -1, 1});
  // P_sink = 1 where lse = sink (a row with no allowed key, or a +inf sink: exp(inf - inf) is NaN)
  const at::Tensor weighted = at::where(sink == lse, delta, at::exp(sink - lse) * delta);
  return packed ? -weighted.sum(1) : -weighted.sum(at::IntArrayRef{0, 2});
}

namespace {

// The autograd node of attention_forward: its backward is the attention_backward op, with the score
// gradient dS (the float mask's gradient) computed only when attn_mask needs a gradient, and the
// sinks' gradient. Next edges: q, k, v, attn_mask, sinks (empty where absent); input: the
// gradient of out (lse is not differentiable).
struct AttentionBackward : public torch::autograd::Node {
  std::string name() const override { return "transformer_fast::AttentionBackward"; }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto* t : {&q_, &k_, &v_, &out_, &lse_, &attn_mask_, &key_padding_mask_, &alibi_slopes_, &sinks_,
                    &cu_seq_q_, &cu_seq_k_}) {
      t->reset_data();
    }
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const at::Tensor q = q_.unpack(), k = k_.unpack(), v = v_.unpack(), out = out_.unpack(getptr());
    const at::Tensor lse = lse_.unpack();
    const OptTensor attn_mask = defined_or_none(attn_mask_.unpack());
    const OptTensor key_padding_mask = defined_or_none(key_padding_mask_.unpack());
    const OptTensor alibi_slopes = defined_or_none(alibi_slopes_.unpack()), sinks = defined_or_none(sinks_.unpack());
    const OptTensor cu_seq_q = defined_or_none(cu_seq_q_.unpack()), cu_seq_k = defined_or_none(cu_seq_k_.unpack());
    const bool mask_grad = attn_mask.has_value() && task_should_compute_output(3);
    const bool sinks_grad = sinks.has_value() && task_should_compute_output(4);
    torch::autograd::variable_list result(5);
    if (!grads[0].defined()) return result;
    const NamedBackendGuard named(backend);
    const at::Tensor& dout = grads[0];
    at::Tensor dmask, dsinks;
    if (at::GradMode::is_enabled()) {  // create_graph=True: a second derivative will be taken
      TORCH_CHECK_NOT_IMPLEMENTED(dropout_p == 0.0,
                                  "transformer_fast attention: second derivatives (create_graph=True) are not "
                                  "supported with dropout_p > 0");
      std::tie(result[0], result[1], result[2], dmask, dsinks) = attention_backward_composite_op().call(
          dout, q, k, v, attn_mask, key_padding_mask, is_causal, scale, window, softcap, alibi_slopes, sinks,
          cu_seq_q, cu_seq_k, query_offset);
    } else {
      at::Tensor delta;
      std::tie(result[0], result[1], result[2], dmask, delta) = attention_backward_op().call(
          dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, mask_grad, window,
          softcap, alibi_slopes, cu_seq_q, cu_seq_k, max_q, max_k, sinks_grad, sinks, query_offset);
      if (sinks_grad) dsinks = sinks_gradient(delta, lse, *sinks, cu_seq_q.has_value());
    }
    if (mask_grad) result[3] = dmask;  // autograd sums dS over the mask's broadcast dims
    if (sinks_grad) result[4] = dsinks;
    return result;
  }

  torch::autograd::SavedVariable q_, k_, v_, out_, lse_, attn_mask_, key_padding_mask_, alibi_slopes_, sinks_,
      cu_seq_q_, cu_seq_k_;
  bool is_causal = false;
  double scale = 1.0, dropout_p = 0.0, softcap = 0.0;
  OptTensor seed;  // a CPU scalar (op_utils.h, dropout_seed), None without dropout
  int64_t max_q = 0, max_k = 0, query_offset = 0;
  std::array<int64_t, 2> window{-1, -1};
  int8_t backend = named_backend();  // the forward's (named_backend.h)
};

std::tuple<at::Tensor, at::Tensor> attention_forward_autograd(const AttentionForwardCall& c) {
  const bool record = requires_grad(c.q, c.k, c.v, c.attn_mask, c.sinks);
  TORCH_CHECK_NOT_IMPLEMENTED(!record || (!c.seqused_k.has_value() && !c.block_table.has_value()),
                              "varlen_attn: seqused_k and block_table are inference-only (no backward); call it "
                              "under torch.no_grad() or with inputs that do not require grad");
  at::Tensor out, lse;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(out, lse) = call_op(attention_forward_op(), c);
  }
  if (!record) return {out, lse};  // nothing to record: no autograd node
  TORCH_CHECK_VALUE(c.window.size() == 2, "window must have two entries, got ", c.window.size());
  auto node = make_node<AttentionBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(c.q, c.k, c.v, c.attn_mask, c.sinks));
  torch::autograd::set_history(out, node);
  node->q_ = torch::autograd::SavedVariable(c.q, false);
  node->k_ = torch::autograd::SavedVariable(c.k, false);
  node->v_ = torch::autograd::SavedVariable(c.v, false);
  node->out_ = torch::autograd::SavedVariable(out, true);
  node->lse_ = torch::autograd::SavedVariable(lse, false);
  node->attn_mask_ = saved(c.attn_mask);
  node->key_padding_mask_ = saved(c.key_padding_mask);
  node->alibi_slopes_ = saved(c.alibi_slopes);
  node->sinks_ = saved(c.sinks);
  node->cu_seq_q_ = saved(c.cu_seq_q);
  node->cu_seq_k_ = saved(c.cu_seq_k);
  node->is_causal = c.is_causal;
  node->scale = c.scale;
  node->dropout_p = c.dropout_p;
  node->softcap = c.softcap;
  node->seed = c.seed;
  node->max_q = c.max_q;
  node->max_k = c.max_k;
  node->query_offset = c.query_offset;
  node->window = {c.window[0], c.window[1]};
  return {out, lse};
}

// Called through the dispatcher (as torch.compile's graphs call them), the kernel ops cast their
// floating inputs as torch's SDPA does (the float32 ALiBi slopes and sinks stay float32), then run
// with autocast off.
template <c10::DeviceType device>
std::tuple<at::Tensor, at::Tensor> attention_forward_autocast(const AttentionForwardCall& c) {
  const auto no_autocast = autocast_off();
  const auto dtype = at::autocast::get_autocast_dtype(device);
  const auto cast = [&](const auto& t) { return autocast_arg(dtype, t, device); };
  return c.forward([&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& attn_mask,
                       const auto&... rest) {
    return attention_forward_op().call(cast(q), cast(k), cast(v), cast(attn_mask), rest...);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_autocast(
    const AttentionBackwardCall& c) {
  const auto no_autocast = autocast_off();
  return call_op(attention_backward_op(), c);
}

// The backward op is never differentiated itself (second derivatives go through
// attention_backward_composite): its autograd kernel steps below autograd, and refuses inputs that would
// need a graph rather than return a result without one.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_autograd(
    const AttentionBackwardCall& c) {
  TORCH_CHECK_NOT_IMPLEMENTED(!requires_grad(c.dout, c.q, c.k, c.v, c.attn_mask),
                              "transformer_fast::attention_backward is not differentiable; differentiate the "
                              "forward op with create_graph=True instead");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return call_op(attention_backward_op(), c);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> call_attention_forward(const AttentionArgs& a, bool is_causal, double dropout_p,
                                                          const OptTensor& seed) {
  const AttentionExtras& x = a.x;
  const std::array<int64_t, 2> window{x.window_left, x.window_right};
  return attention_forward_op().call(a.q, a.k, a.v, a.attn_mask, a.key_padding_mask, is_causal, a.scale, dropout_p,
                                     seed, window, x.softcap, x.alibi_slopes, x.sinks, x.cu_seq_q, x.cu_seq_k,
                                     x.seqused_k, x.block_table, x.max_q, x.max_k, x.num_splits, x.query_offset);
}

TORCH_LIBRARY_IMPL(transformer_fast, Autograd, m) {
  m.impl("attention_backward", TORCH_FN(CallKernel<AttentionBackwardCall>::of<&attention_backward_autograd>));
  m.impl("attention_forward", TORCH_FN(CallKernel<AttentionForwardCall>::of<&attention_forward_autograd>));
}

TORCH_LIBRARY_IMPL(transformer_fast, BackendSelect, m) {
  m.impl("attention_forward", TORCH_FN(BackendChoice<AttentionForwardSig>::kernel<&attention_forward_op>));
  m.impl("attention_backward", TORCH_FN(BackendChoice<AttentionBackwardSig>::kernel<&attention_backward_op>));
}

TORCH_LIBRARY_IMPL(transformer_fast, AutocastCPU, m) {
  m.impl("attention_forward",
         TORCH_FN(CallKernel<AttentionForwardCall>::of<&attention_forward_autocast<c10::DeviceType::CPU>>));
  m.impl("attention_backward", TORCH_FN(CallKernel<AttentionBackwardCall>::of<&attention_backward_autocast>));
}

TORCH_LIBRARY_IMPL(transformer_fast, AutocastCUDA, m) {
  m.impl("attention_forward",
         TORCH_FN(CallKernel<AttentionForwardCall>::of<&attention_forward_autocast<c10::DeviceType::CUDA>>));
  m.impl("attention_backward", TORCH_FN(CallKernel<AttentionBackwardCall>::of<&attention_backward_autocast>));
}

}  // namespace transformer_fast
