// Linear attention's dispatcher layer: the public op's argument checks, the autograd formula of
// linear_attention_forward (its backward is the linear_attention_backward op) and the autocast kernels.
#include "op_utils.h"
#include "ops.h"

#include <torch/autograd.h>

namespace transformer_fast {

using LinearAttentionForwardSig = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                             const std::optional<at::Tensor>&, bool, double);
using LinearAttentionBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, bool,
    double);
TRANSFORMER_FAST_OP(linear_attention_forward, LinearAttentionForwardSig)
TRANSFORMER_FAST_OP(linear_attention_backward, LinearAttentionBackwardSig)
TRANSFORMER_FAST_OP(linear_attention_backward_composite, LinearAttentionBackwardSig)

LinearAttentionArgs linear_attention_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                          bool is_causal, const std::optional<at::Tensor>& key_padding_mask,
                                          double eps) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"query", &query}, {"key", &key},
                                {"value", &value}}) {
    check_ndim(name, *t, t->dim() == 4, "4");
    check_floating(name, *t);
  }
  const auto device = query.device().type();
  const auto cast = autocast_lower_precision(device);
  LinearAttentionArgs a{autocast_arg(cast, query, device), autocast_arg(cast, key, device),
                        autocast_arg(cast, value, device), key_padding_mask};
  check_same_device("key", a.k, "query", a.q);
  check_same_dtype("key", a.k, "query", a.q);
  check_same_device("value", a.v, "query", a.q);
  check_same_dtype("value", a.v, "query", a.q);
  const c10::SymInt B = a.q.sym_size(0), H = a.q.sym_size(1), Nq = a.q.sym_size(2), D = a.q.sym_size(3);
  const c10::SymInt Nk = a.k.sym_size(2);
  check_size("key", a.k, 0, B, "batch");
  check_size("key", a.k, 1, H, "heads");
  check_size("key", a.k, 3, D, "head dim, as query");
  check_size("value", a.v, 0, B, "batch");
  check_size("value", a.v, 1, H, "heads");
  check_size("value", a.v, 2, Nk, "key length, as key");
  check_head_dim("query", D);
  check_head_dim("value", a.v.sym_size(3));
  TORCH_CHECK_VALUE(!is_causal || Nq == Nk, "causal linear attention needs equal query and key lengths, got ", Nq,
                    " and ", Nk);
  TORCH_CHECK_VALUE(eps > 0, "eps must be > 0 (it keeps the normaliser away from zero), got ", eps);
  check_key_padding_mask(a.key_padding_mask, B, Nk, a.q);
  a.q = with_unit_last_stride(a.q);
  a.k = with_unit_last_stride(a.k);
  a.v = with_unit_last_stride(a.v);
  return a;
}

namespace {

// The backward recomputes the state from q, k, v: nothing of size N x D x Dv is saved.
class LinearAttentionFunction : public torch::autograd::Function<LinearAttentionFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                            double eps) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor out = linear_attention_forward_op().call(q, k, v, key_padding_mask, is_causal, eps);
    ctx->save_for_backward({q, k, v, key_padding_mask.value_or(at::Tensor())});
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["eps"] = eps;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const std::optional<at::Tensor> mask = saved[3].defined() ? std::optional<at::Tensor>(saved[3]) : std::nullopt;
    const bool is_causal = ctx->saved_data["is_causal"].toBool();
    const double eps = ctx->saved_data["eps"].toDouble();
    const auto& op = at::GradMode::is_enabled() ? linear_attention_backward_composite_op()  // create_graph=True
                                                : linear_attention_backward_op();
    auto [dq, dk, dv] = op.call(grads[0], saved[0], saved[1], saved[2], mask, is_causal, eps);
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor linear_attention_forward_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                                             double eps) {
  if (!requires_grad(q, k, v)) {  // nothing to record: no autograd node
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return linear_attention_forward_op().call(q, k, v, key_padding_mask, is_causal, eps);
  }
  return LinearAttentionFunction::apply(q, k, v, key_padding_mask, is_causal, eps);
}

template <c10::DeviceType device>
at::Tensor linear_attention_forward_autocast(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const std::optional<at::Tensor>& key_padding_mask, bool is_causal,
                                             double eps) {
  const auto no_autocast = autocast_off();
  const auto cast = at::autocast::get_autocast_dtype(device);
  return linear_attention_forward_op().call(autocast_arg(cast, q, device), autocast_arg(cast, k, device),
                                            autocast_arg(cast, v, device), key_padding_mask, is_causal, eps);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention_backward_autocast(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double eps) {
  const auto no_autocast = autocast_off();
  return linear_attention_backward_op().call(dout, q, k, v, key_padding_mask, is_causal, eps);
}

// The backward op is never differentiated itself (second derivatives go through
// linear_attention_backward_composite): its autograd kernel steps below autograd, and refuses inputs that would
// need a graph rather than return a result without one.
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention_backward_autograd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double eps) {
  TORCH_CHECK_NOT_IMPLEMENTED(!requires_grad(dout, q, k, v), "transformer_fast::linear_attention_backward is not differentiable; "
                              "differentiate the forward op with create_graph=True instead");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return linear_attention_backward_op().call(dout, q, k, v, key_padding_mask, is_causal, eps);
}

}  // namespace

at::Tensor linear_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, bool is_causal,
                            const std::optional<at::Tensor>& key_padding_mask, double eps) {
  const LinearAttentionArgs a = linear_attention_args(query, key, value, is_causal, key_padding_mask, eps);
  return linear_attention_forward_op().call(a.q, a.k, a.v, a.key_padding_mask, is_causal, eps);
}

TORCH_LIBRARY_IMPL(transformer_fast, CompositeImplicitAutograd, m) {
  m.impl("linear_attention", &linear_attention);
}

TORCH_LIBRARY_IMPL(transformer_fast, Autograd, m) {
  m.impl("linear_attention_backward", &linear_attention_backward_autograd);
  m.impl("linear_attention_forward", &linear_attention_forward_autograd);
}

TORCH_LIBRARY_IMPL(transformer_fast, AutocastCPU, m) {
  m.impl("linear_attention_forward", &linear_attention_forward_autocast<c10::DeviceType::CPU>);
  m.impl("linear_attention_backward", &linear_attention_backward_autocast);
}

TORCH_LIBRARY_IMPL(transformer_fast, AutocastCUDA, m) {
  m.impl("linear_attention_forward", &linear_attention_forward_autocast<c10::DeviceType::CUDA>);
  m.impl("linear_attention_backward", &linear_attention_backward_autocast);
}

}  // namespace transformer_fast
