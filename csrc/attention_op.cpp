// Softmax attention's dispatcher layer: the autograd formula of attention_forward (its backward is
// the attention_backward op; the sinks' gradient is formed here from the saved statistics) and the
// autocast kernels of both kernel ops. The public ops' checks are in attention_args.cpp.
#include "op_utils.h"
#include "ops.h"

#include <torch/autograd.h>

#include <array>

namespace transformer_fast {

using OptTensor = std::optional<at::Tensor>;
using AttentionForwardSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&, bool, double, double,
    int64_t, at::IntArrayRef, double, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&,
    const OptTensor&, const OptTensor&, int64_t, int64_t, int64_t);
using AttentionBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const OptTensor&, const OptTensor&, bool, double, double, int64_t, bool, at::IntArrayRef, double,
    const OptTensor&, const OptTensor&, const OptTensor&, int64_t, int64_t);
using AttentionBackwardCompositeSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
    bool, double, at::IntArrayRef, double, const OptTensor&, const OptTensor&, const OptTensor&, const OptTensor&);
TRANSFORMER_FAST_OP(attention_forward, AttentionForwardSig)
TRANSFORMER_FAST_OP(attention_backward, AttentionBackwardSig)
TRANSFORMER_FAST_OP(attention_backward_composite, AttentionBackwardCompositeSig)

namespace {

OptTensor optional(const at::Tensor& t) { return t.defined() ? OptTensor(t) : std::nullopt; }

// d loss / d sinks[h] = -sum over the rows of head h of P_sink * delta, with P_sink = exp(sinks[h] -
// lse) each row's sink probability and delta = dO . O (the kernels' delta): the sink takes
// probability from every key in proportion, and has no value. (H,), in lse's dtype.
at::Tensor sinks_gradient(const at::Tensor& dout, const at::Tensor& out, const at::Tensor& lse,
                          const at::Tensor& sinks, bool packed) {
  // delta and P_sink per row: dense (B, H, Nq); packed (H, Tq) (out is (Tq, H, Dv)).
  at::Tensor delta = (dout.to(lse.scalar_type()) * out.to(lse.scalar_type())).sum(-1);
  if (packed) delta = delta.t();
  const at::Tensor sink = packed ? sinks.unsqueeze(1) : sinks.view({1, -1, 1});
  const at::Tensor weighted = at::exp(sink - lse) * delta;
  return packed ? -weighted.sum(1) : -weighted.sum({0, 2});
}

// The autograd formula of attention_forward: the backward op, with the score gradient dS (the
// float mask's gradient) computed only when attn_mask requires grad, and the sinks' gradient.
// The window is passed as two ints (the node keeps them in saved_data).
class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const OptTensor& attn_mask, const OptTensor& key_padding_mask, bool is_causal, double scale, double dropout_p,
      int64_t seed, int64_t window_left, int64_t window_right, double softcap, const OptTensor& alibi_slopes,
      const OptTensor& sinks, const OptTensor& cu_seq_q, const OptTensor& cu_seq_k, const OptTensor& seqused_k,
      const OptTensor& block_table, int64_t max_q, int64_t max_k, int64_t num_splits) {
    TORCH_CHECK_NOT_IMPLEMENTED(!seqused_k.has_value() && !block_table.has_value(),
                                "varlen_attn: seqused_k and block_table are inference-only (no backward); call it "
                                "under torch.no_grad() or with inputs that do not require grad");
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    const std::array<int64_t, 2> window{window_left, window_right};
    auto [out, lse] = attention_forward_op().call(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
                                                  seed, window, softcap, alibi_slopes, sinks, cu_seq_q, cu_seq_k,
                                                  seqused_k, block_table, max_q, max_k, num_splits);
    const auto tensor = [](const OptTensor& t) { return t.value_or(at::Tensor()); };
    ctx->save_for_backward({q, k, v, out, lse, tensor(attn_mask), tensor(key_padding_mask), tensor(alibi_slopes),
                            tensor(sinks), tensor(cu_seq_q), tensor(cu_seq_k)});
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["seed"] = seed;
    ctx->saved_data["window_left"] = window_left;
    ctx->saved_data["window_right"] = window_right;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["max_q"] = max_q;
    ctx->saved_data["max_k"] = max_k;
    // Input edges exist for the tensors given, in argument order: q, k, v, then attn_mask, the
    // padding mask and the ALiBi slopes where given; then sinks.
    ctx->saved_data["sinks_edge"] = static_cast<int64_t>(3 + attn_mask.has_value() +
                                                         key_padding_mask.has_value() + alibi_slopes.has_value());
    ctx->mark_non_differentiable({lse});
    // The statistics never get a gradient: no zero tensors are made for them (undefined grads are
    // handled in backward), which measurably costs a small call's backward.
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const OptTensor attn_mask = optional(saved[5]), key_padding_mask = optional(saved[6]);
    const OptTensor alibi_slopes = optional(saved[7]), sinks = optional(saved[8]);
    const OptTensor cu_seq_q = optional(saved[9]), cu_seq_k = optional(saved[10]);
    const bool is_causal = ctx->saved_data["is_causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble(), dropout_p = ctx->saved_data["dropout_p"].toDouble();
    const double softcap = ctx->saved_data["softcap"].toDouble();
    const std::array<int64_t, 2> window{ctx->saved_data["window_left"].toInt(),
                                        ctx->saved_data["window_right"].toInt()};
    const int64_t max_q = ctx->saved_data["max_q"].toInt(), max_k = ctx->saved_data["max_k"].toInt();
    const bool mask_grad = attn_mask.has_value() && ctx->needs_input_grad(3);  // attn_mask is the fourth edge
    const bool sinks_grad = sinks.has_value() && ctx->needs_input_grad(ctx->saved_data["sinks_edge"].toInt());
    const at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
    at::Tensor dq, dk, dv, dmask, dsinks;
    if (at::GradMode::is_enabled()) {  // create_graph=True: a second derivative will be taken
      TORCH_CHECK_NOT_IMPLEMENTED(dropout_p == 0.0,
                                  "transformer_fast attention: second derivatives (create_graph=True) are not "
                                  "supported with dropout_p > 0");
      std::tie(dq, dk, dv, dmask, dsinks) =
          attention_backward_composite_op().call(dout, q, k, v, attn_mask, key_padding_mask, is_causal, scale, window,
                                                 softcap, alibi_slopes, sinks, cu_seq_q, cu_seq_k);
    } else {
      std::tie(dq, dk, dv, dmask) = attention_backward_op().call(
          dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p,
          ctx->saved_data["seed"].toInt(), mask_grad, window, softcap, alibi_slopes, cu_seq_q, cu_seq_k, max_q, max_k);
      if (sinks_grad) dsinks = sinks_gradient(dout, out, lse, *sinks, cu_seq_q.has_value());
    }
    // Autograd sums dS over the mask's broadcast dims. One entry per forward argument.
    torch::autograd::variable_list result(21);
    result[0] = dq;
    result[1] = dk;
    result[2] = dv;
    if (mask_grad) result[3] = dmask;
    if (sinks_grad) result[13] = dsinks;
    return result;
  }
};

std::tuple<at::Tensor, at::Tensor> attention_forward_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& attn_mask,
    const OptTensor& key_padding_mask, bool is_causal, double scale, double dropout_p, int64_t seed,
    at::IntArrayRef window, double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks,
    const OptTensor& cu_seq_q, const OptTensor& cu_seq_k, const OptTensor& seqused_k, const OptTensor& block_table,
    int64_t max_q, int64_t max_k, int64_t num_splits) {
  if (!requires_grad(q, k, v, attn_mask, sinks)) {  // nothing to record: no autograd node (~2 us)
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return attention_forward_op().call(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed,
                                       window, softcap, alibi_slopes, sinks, cu_seq_q, cu_seq_k, seqused_k,
                                       block_table, max_q, max_k, num_splits);
  }
  TORCH_CHECK_VALUE(window.size() == 2, "window must have two entries, got ", window.size());
  auto result = AttentionFunction::apply(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed,
                                         window[0], window[1], softcap, alibi_slopes, sinks, cu_seq_q, cu_seq_k,
                                         seqused_k, block_table, max_q, max_k, num_splits);
  return {result[0], result[1]};
}

// Called through the dispatcher (as torch.compile's graphs call them), the kernel ops cast their
// floating inputs as torch's SDPA does (the float32 ALiBi slopes and sinks stay float32), then run
// with autocast off.
template <c10::DeviceType device>
std::tuple<at::Tensor, at::Tensor> attention_forward_autocast(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptTensor& attn_mask,
    const OptTensor& key_padding_mask, bool is_causal, double scale, double dropout_p, int64_t seed,
    at::IntArrayRef window, double softcap, const OptTensor& alibi_slopes, const OptTensor& sinks,
    const OptTensor& cu_seq_q, const OptTensor& cu_seq_k, const OptTensor& seqused_k, const OptTensor& block_table,
    int64_t max_q, int64_t max_k, int64_t num_splits) {
  const auto no_autocast = autocast_off();
  const auto cast = at::autocast::get_autocast_dtype(device);
  return attention_forward_op().call(autocast_arg(cast, q, device), autocast_arg(cast, k, device),
                                     autocast_arg(cast, v, device), autocast_arg(cast, attn_mask, device),
                                     key_padding_mask, is_causal, scale, dropout_p, seed, window, softcap,
                                     alibi_slopes, sinks, cu_seq_q, cu_seq_k, seqused_k, block_table, max_q, max_k,
                                     num_splits);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_autocast(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const OptTensor& attn_mask, const OptTensor& key_padding_mask, bool is_causal,
    double scale, double dropout_p, int64_t seed, bool compute_dmask, at::IntArrayRef window, double softcap,
    const OptTensor& alibi_slopes, const OptTensor& cu_seq_q, const OptTensor& cu_seq_k, int64_t max_q,
    int64_t max_k) {
  const auto no_autocast = autocast_off();
  return attention_backward_op().call(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale,
                                      dropout_p, seed, compute_dmask, window, softcap, alibi_slopes, cu_seq_q,
                                      cu_seq_k, max_q, max_k);
}

// The backward op is never differentiated itself (second derivatives go through
// attention_backward_composite): its autograd kernel steps below autograd, and refuses inputs that would
// need a graph rather than return a result without one.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_autograd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const OptTensor& attn_mask, const OptTensor& key_padding_mask, bool is_causal,
    double scale, double dropout_p, int64_t seed, bool compute_dmask, at::IntArrayRef window, double softcap,
    const OptTensor& alibi_slopes, const OptTensor& cu_seq_q, const OptTensor& cu_seq_k, int64_t max_q,
    int64_t max_k) {
  TORCH_CHECK_NOT_IMPLEMENTED(!requires_grad(dout, q, k, v, attn_mask),
                              "transformer_fast::attention_backward is not differentiable; differentiate the "
                              "forward op with create_graph=True instead");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return attention_backward_op().call(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale,
                                      dropout_p, seed, compute_dmask, window, softcap, alibi_slopes, cu_seq_q,
                                      cu_seq_k, max_q, max_k);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> call_attention_forward(const AttentionArgs& a, bool is_causal, double dropout_p,
                                                          int64_t seed) {
  const AttentionExtras& x = a.x;
  const std::array<int64_t, 2> window{x.window_left, x.window_right};
  return attention_forward_op().call(a.q, a.k, a.v, a.attn_mask, a.key_padding_mask, is_causal, a.scale, dropout_p,
                                     seed, window, x.softcap, x.alibi_slopes, x.sinks, x.cu_seq_q, x.cu_seq_k,
                                     x.seqused_k, x.block_table, x.max_q, x.max_k, x.num_splits);
}

TORCH_LIBRARY_IMPL(transformer_fast, Autograd, m) {
  m.impl("attention_backward", &attention_backward_autograd);
  m.impl("attention_forward", &attention_forward_autograd);
}

TORCH_LIBRARY_IMPL(transformer_fast, AutocastCPU, m) {
  m.impl("attention_forward", &attention_forward_autocast<c10::DeviceType::CPU>);
  m.impl("attention_backward", &attention_backward_autocast);
}

TORCH_LIBRARY_IMPL(transformer_fast, AutocastCUDA, m) {
  m.impl("attention_forward", &attention_forward_autocast<c10::DeviceType::CUDA>);
  m.impl("attention_backward", &attention_backward_autocast);
}

}  // namespace transformer_fast
