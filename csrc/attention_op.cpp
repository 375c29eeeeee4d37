// Softmax attention's dispatcher layer: the public op's argument checks, the autograd formula of
// attention_forward (its backward is the attention_backward op) and the autocast kernels.
#include "op_utils.h"
#include "ops.h"

#include <torch/autograd.h>

#include <cmath>

namespace transformer_fast {

using AttentionForwardSig = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, bool, double, double, int64_t);
using AttentionBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, bool, double, double,
    int64_t, bool);
using AttentionBackwardCompositeSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, bool, double);
TRANSFORMER_FAST_OP(attention_forward, AttentionForwardSig)
TRANSFORMER_FAST_OP(attention_backward, AttentionBackwardSig)
TRANSFORMER_FAST_OP(attention_backward_composite, AttentionBackwardCompositeSig)

AttentionArgs attention_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                             std::optional<double> scale, bool enable_gqa,
                             const std::optional<at::Tensor>& key_padding_mask) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"query", &query}, {"key", &key},
                                {"value", &value}}) {
    check_ndim(name, *t, t->dim() == 3 || t->dim() == 4, "3 or 4");
    check_floating(name, *t);
  }
  TORCH_CHECK_VALUE(query.dim() == key.dim() && key.dim() == value.dim(),
                    "query, key and value must have the same number of dimensions, got shapes ",
                    shape_str(query.sym_sizes()), ", ", shape_str(key.sym_sizes()), ", ", shape_str(value.sym_sizes()));
  AttentionArgs a;
  a.unbatched = query.dim() == 3;  // (H, N, D): one sequence
  const auto device = query.device().type();
  const auto cast = autocast_lower_precision(device);
  a.q = autocast_arg(cast, a.unbatched ? query.unsqueeze(0) : query, device);
  a.k = autocast_arg(cast, a.unbatched ? key.unsqueeze(0) : key, device);
  a.v = autocast_arg(cast, a.unbatched ? value.unsqueeze(0) : value, device);
  check_same_device("key", a.k, "query", a.q);
  check_same_dtype("key", a.k, "query", a.q);
  check_same_device("value", a.v, "query", a.q);
  check_same_dtype("value", a.v, "query", a.q);
  const c10::SymInt B = a.q.sym_size(0), H = a.q.sym_size(1), Nq = a.q.sym_size(2), D = a.q.sym_size(3);
  const c10::SymInt Hk = a.k.sym_size(1), Nk = a.k.sym_size(2);
  check_size("key", a.k, 0, B, "batch");
  check_size("value", a.v, 0, B, "batch");
  check_size("value", a.v, 1, Hk, "heads, as key");
  check_size("value", a.v, 2, Nk, "key length, as key");
  check_size("key", a.k, 3, D, "head dim, as query");
  TORCH_CHECK_VALUE(Hk == H || (enable_gqa && Hk > 0 && H % Hk == 0), "key has ", Hk, " heads and query ", H,
                    ": they must be equal, or pass enable_gqa=True with key heads dividing query heads");
  check_head_dim("query", D);
  check_head_dim("value", a.v.sym_size(3));
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p must be in [0, 1), got ", dropout_p);
  TORCH_CHECK_VALUE(!scale.has_value() || std::isfinite(*scale), "scale must be finite, got ", *scale);
  a.scale = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(D.guard_int(__FILE__, __LINE__)));

  if (attn_mask.has_value()) {
    const at::Tensor mask = autocast_arg(cast, *attn_mask, device);
    TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool || mask.scalar_type() == a.q.scalar_type(),
                     "attn_mask must be bool (True = attend) or have the query's dtype ",
                     dtype_name(a.q.scalar_type()), ", got ", dtype_name(mask.scalar_type()));
    check_same_device("attn_mask", mask, "query", a.q);
    const std::vector<c10::SymInt> shape{B, H, Nq, Nk};
    bool broadcasts = mask.dim() <= 4;
    for (int64_t i = 1; broadcasts && i <= mask.dim(); ++i) {
      const c10::SymInt& m = mask.sym_size(-i);
      broadcasts = m == 1 || m == shape[4 - i];
    }
    TORCH_CHECK_VALUE(broadcasts, "attn_mask of shape ", shape_str(mask.sym_sizes()),
                      " does not broadcast to (batch, heads, query_len, key_len) = ", shape_str(shape));
    a.attn_mask = mask.expand_symint(shape);  // a view: broadcast dims get stride 0
  }
  if (key_padding_mask.has_value()) {
    a.key_padding_mask = a.unbatched && key_padding_mask->dim() == 1 ? key_padding_mask->unsqueeze(0)
                                                                     : *key_padding_mask;
    check_key_padding_mask(a.key_padding_mask, B, Nk, a.q);
  }
  a.q = with_unit_last_stride(a.q);
  a.k = with_unit_last_stride(a.k);
  a.v = with_unit_last_stride(a.v);
  return a;
}

namespace {

// The autograd formula of attention_forward: the backward op, with the score gradient dS (the
// float mask's gradient) computed only when attn_mask requires grad.
class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
      bool is_causal, double scale, double dropout_p, int64_t seed) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, lse] =
        attention_forward_op().call(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed);
    ctx->save_for_backward({q, k, v, out, lse, attn_mask.value_or(at::Tensor()),
                            key_padding_mask.value_or(at::Tensor())});
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["seed"] = seed;
    ctx->mark_non_differentiable({lse});
    // The statistics never get a gradient: no zero tensors are made for them (undefined grads are
    // handled in backward), which measurably costs a small call's backward.
    ctx->set_materialize_grads(false);
    return {out, lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2];
    const auto optional = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
    const auto attn_mask = optional(saved[5]), key_padding_mask = optional(saved[6]);
    const bool is_causal = ctx->saved_data["is_causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble(), dropout_p = ctx->saved_data["dropout_p"].toDouble();
    // Input edges exist for the tensors given: attn_mask, when given, is the fourth.
    const bool mask_grad = attn_mask.has_value() && ctx->needs_input_grad(3);
    at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(saved[3]);
    at::Tensor dq, dk, dv, dmask;
    if (at::GradMode::is_enabled()) {  // create_graph=True: a second derivative will be taken
      TORCH_CHECK_NOT_IMPLEMENTED(dropout_p == 0.0,
                                  "transformer_fast.scaled_dot_product_attention: second derivatives "
                                  "(create_graph=True) are not supported with dropout_p > 0");
      std::tie(dq, dk, dv, dmask) = attention_backward_composite_op().call(dout, q, k, v, attn_mask,
                                                                           key_padding_mask, is_causal, scale);
    } else {
      std::tie(dq, dk, dv, dmask) =
          attention_backward_op().call(dout, q, k, v, saved[3], saved[4], attn_mask, key_padding_mask, is_causal,
                                       scale, dropout_p, ctx->saved_data["seed"].toInt(), mask_grad);
    }
    // Autograd sums dS over the mask's broadcast dims; no gradient for the padding mask or the scalars.
    return {dq, dk, dv, mask_grad ? dmask : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor> attention_forward_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale, double dropout_p,
    int64_t seed) {
  if (!requires_grad(q, k, v, attn_mask)) {  // nothing to record: no autograd node (~2 us)
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return attention_forward_op().call(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed);
  }
  auto result = AttentionFunction::apply(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed);
  return {result[0], result[1]};
}

// Called through the dispatcher (as torch.compile's graphs call them), the kernel ops cast their
// floating inputs as torch's SDPA does, then run with autocast off.
template <c10::DeviceType device>
std::tuple<at::Tensor, at::Tensor> attention_forward_autocast(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale, double dropout_p,
    int64_t seed) {
  const auto no_autocast = autocast_off();
  const auto cast = at::autocast::get_autocast_dtype(device);
  return attention_forward_op().call(autocast_arg(cast, q, device), autocast_arg(cast, k, device),
                                     autocast_arg(cast, v, device), autocast_arg(cast, attn_mask, device),
                                     key_padding_mask, is_causal, scale, dropout_p, seed);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_autocast(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale, double dropout_p, int64_t seed,
    bool compute_dmask) {
  const auto no_autocast = autocast_off();
  return attention_backward_op().call(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale,
                                      dropout_p, seed, compute_dmask);
}

// The backward op is never differentiated itself (second derivatives go through
// attention_backward_composite): its autograd kernel steps below autograd, and refuses inputs that would
// need a graph rather than return a result without one.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_autograd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale, double dropout_p, int64_t seed,
    bool compute_dmask) {
  TORCH_CHECK_NOT_IMPLEMENTED(!requires_grad(dout, q, k, v, attn_mask), "transformer_fast::attention_backward is not differentiable; "
                              "differentiate the forward op with create_graph=True instead");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return attention_backward_op().call(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, compute_dmask);
}

}  // namespace

at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                        bool is_causal, std::optional<double> scale, bool enable_gqa,
                                        const std::optional<at::Tensor>& key_padding_mask, int64_t seed) {
  const AttentionArgs a =
      attention_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask);
  const at::Tensor out = std::get<0>(
      attention_forward_op().call(a.q, a.k, a.v, a.attn_mask, a.key_padding_mask, is_causal, a.scale, dropout_p, seed));
  return a.unbatched ? out.squeeze(0) : out;
}

TORCH_LIBRARY_IMPL(transformer_fast, CompositeImplicitAutograd, m) {
  m.impl("scaled_dot_product_attention", &scaled_dot_product_attention);
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
