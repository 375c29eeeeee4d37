// Linear attention's dispatcher layer: the public op's argument checks, the autograd formula of
// linear_attention_forward (its backward is the linear_attention_backward op) and the autocast kernels.
#include "ops/linear_attention_ops.h"
#include "ops/named_backend.h"
#include "ops/op_utils.h"

#include <torch/csrc/autograd/custom_function.h>

namespace transformer_fast {

using OptionalTensor = std::optional<at::Tensor>;
using LinearAttentionForwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensor&, bool, double, const OptionalTensor&,
    const OptionalTensor&, bool);
using LinearAttentionBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptionalTensor&, bool, double,
    const OptionalTensor&, const OptionalTensor&, const OptionalTensor&, const OptionalTensor&);
TRANSFORMER_FAST_OP(linear_attention_forward, LinearAttentionForwardSig)
TRANSFORMER_FAST_OP(linear_attention_backward, LinearAttentionBackwardSig)
TRANSFORMER_FAST_OP(linear_attention_backward_composite, LinearAttentionBackwardSig)

namespace {

// One tensor of the initial state: on the query's device, in the state's dtype (float32; float64
// for float64 inputs), of the given shape (any strides).
void check_state_tensor(const char* name, const at::Tensor& t, std::initializer_list<c10::SymInt> shape,
                        const char* dims, const at::Tensor& q) {
  const at::ScalarType dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must have dtype ", dtype_name(dtype), " (the state of ",
                   dtype_name(q.scalar_type()), " inputs), got ", dtype_name(t.scalar_type()));
  const c10::SymIntArrayRef expected(shape.begin(), shape.size());
  TORCH_CHECK_VALUE(t.sym_sizes() == expected, name, " must have shape ", dims, " = ", shape_str(expected), ", got ",
                    shape_str(t.sym_sizes()));
  check_same_device(name, t, "query", q);
}

}  // namespace

LinearAttentionArgs linear_attention_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                          bool is_causal, const OptionalTensor& key_padding_mask, double eps,
                                          const OptionalTensor& initial_S, const OptionalTensor& initial_z) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"query", &query}, {"key", &key},
                                {"value", &value}}) {
    check_ndim(name, *t, t->dim() == 4, "4");
    check_floating(name, *t);
  }
  const auto device = query.device().type();
  const auto cast = autocast_lower_precision(device);
  LinearAttentionArgs a{autocast_arg(cast, query, device), autocast_arg(cast, key, device),
                        autocast_arg(cast, value, device), key_padding_mask, initial_S, initial_z};
  check_same_device("key", a.k, "query", a.q);
  check_same_dtype("key", a.k, "query", a.q);
  check_same_device("value", a.v, "query", a.q);
  check_same_dtype("value", a.v, "query", a.q);
  const c10::SymInt B = a.q.sym_size(0), H = a.q.sym_size(1), Nq = a.q.sym_size(2), D = a.q.sym_size(3);
  const c10::SymInt Nk = a.k.sym_size(2), Dv = a.v.sym_size(3);
  check_size("key", a.k, 0, B, "batch");
  check_size("key", a.k, 1, H, "heads");
  check_size("key", a.k, 3, D, "head dim, as query");
  check_size("value", a.v, 0, B, "batch");
  check_size("value", a.v, 1, H, "heads");
  check_size("value", a.v, 2, Nk, "key length, as key");
  check_head_dim("query", D);
  check_head_dim("value", Dv);
  TORCH_CHECK_VALUE(!is_causal || Nq == Nk, "causal linear attention needs equal query and key lengths, got ", Nq,
                    " and ", Nk);
  TORCH_CHECK_VALUE(eps > 0, "eps must be > 0 (it keeps the normaliser away from zero), got ", eps);
  check_key_padding_mask(a.key_padding_mask, B, Nk, a.q);
  TORCH_CHECK_VALUE(initial_S.has_value() == initial_z.has_value(), "initial_state must hold both S and z, got ",
                    initial_S.has_value() ? "S without z" : "z without S");
  if (initial_S.has_value()) {
    check_state_tensor("initial_state.S", *initial_S, {B, H, D, Dv}, "(B, H, D, Dv)", a.q);
    check_state_tensor("initial_state.z", *initial_z, {B, H, D}, "(B, H, D)", a.q);
  }
  a.q = with_unit_last_stride(a.q);
  a.k = with_unit_last_stride(a.k);
  a.v = with_unit_last_stride(a.v);
  return a;
}

namespace {

// The backward recomputes the state from q, k, v and the initial state: nothing of size N x D x Dv
// is saved. Outputs (out, final S, final z); the final state is differentiable when it is asked
// for, and a gradient arriving there starts the backward's reverse-direction state.
class LinearAttentionFunction : public torch::autograd::Function<LinearAttentionFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q,
                                                const at::Tensor& k, const at::Tensor& v,
                                                const OptionalTensor& key_padding_mask, bool is_causal, double eps,
                                                const OptionalTensor& initial_S, const OptionalTensor& initial_z,
                                                bool output_final_state) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [out, S, z] = linear_attention_forward_op().call(q, k, v, key_padding_mask, is_causal, eps, initial_S,
                                                          initial_z, output_final_state);
    ctx->save_for_backward({q, k, v, key_padding_mask.value_or(at::Tensor()), initial_S.value_or(at::Tensor()),
                            initial_z.value_or(at::Tensor())});
    ctx->saved_data["is_causal"] = is_causal;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["backend"] = static_cast<int64_t>(named_backend());  // named_backend.h
    if (!output_final_state) ctx->mark_non_differentiable({S, z});
    ctx->set_materialize_grads(false);  // no zero tensors for outputs that get no gradient
    return {out, S, z};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto optional = [](const at::Tensor& t) { return t.defined() ? OptionalTensor(t) : std::nullopt; };
    const at::Tensor &q = saved[0], &v = saved[2];
    const bool is_causal = ctx->saved_data["is_causal"].toBool();
    const double eps = ctx->saved_data["eps"].toDouble();
    const NamedBackendGuard named(static_cast<int8_t>(ctx->saved_data["backend"].toInt()));
    // A loss on the final state alone leaves the output without a gradient.
    const at::Tensor dout =
        grads[0].defined()
            ? grads[0]
            : at::zeros_symint(c10::SymIntArrayRef({q.sym_size(0), q.sym_size(1), q.sym_size(2), v.sym_size(3)}),
                               q.options());
    const auto& op = at::GradMode::is_enabled() ? linear_attention_backward_composite_op()  // create_graph=True
                                                : linear_attention_backward_op();
    auto [dq, dk, dv, dS0, dz0] = op.call(dout, q, saved[1], v, optional(saved[3]), is_causal, eps, optional(saved[4]),
                                          optional(saved[5]), optional(grads[1]), optional(grads[2]));
    const bool has_initial = saved[4].defined();
    return {dq, dk, dv, at::Tensor(), at::Tensor(), at::Tensor(), has_initial ? dS0 : at::Tensor(),
            has_initial ? dz0 : at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention_forward_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptionalTensor& key_padding_mask,
    bool is_causal, double eps, const OptionalTensor& initial_S, const OptionalTensor& initial_z,
    bool output_final_state) {
  if (!requires_grad(q, k, v, initial_S, initial_z)) {  // nothing to record: no autograd node
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return linear_attention_forward_op().call(q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z,
                                              output_final_state);
  }
  auto r = LinearAttentionFunction::apply(q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z,
                                          output_final_state);
  return {r[0], r[1], r[2]};
}

// The state is never cast: it stays float32 whatever the autocast dtype of q, k, v.
template <c10::DeviceType device>
std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention_forward_autocast(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const OptionalTensor& key_padding_mask,
    bool is_causal, double eps, const OptionalTensor& initial_S, const OptionalTensor& initial_z,
    bool output_final_state) {
  const auto no_autocast = autocast_off();
  const auto cast = at::autocast::get_autocast_dtype(device);
  return linear_attention_forward_op().call(autocast_arg(cast, q, device), autocast_arg(cast, k, device),
                                            autocast_arg(cast, v, device), key_padding_mask, is_causal, eps,
                                            initial_S, initial_z, output_final_state);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_attention_backward_autocast(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const OptionalTensor& key_padding_mask, bool is_causal, double eps, const OptionalTensor& initial_S,
    const OptionalTensor& initial_z, const OptionalTensor& grad_final_S, const OptionalTensor& grad_final_z) {
  const auto no_autocast = autocast_off();
  return linear_attention_backward_op().call(dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z,
                                             grad_final_S, grad_final_z);
}

// The backward op is never differentiated itself (second derivatives go through
// linear_attention_backward_composite): its autograd kernel steps below autograd, and refuses inputs that would
// need a graph rather than return a result without one.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_attention_backward_autograd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const OptionalTensor& key_padding_mask, bool is_causal, double eps, const OptionalTensor& initial_S,
    const OptionalTensor& initial_z, const OptionalTensor& grad_final_S, const OptionalTensor& grad_final_z) {
  TORCH_CHECK_NOT_IMPLEMENTED(!requires_grad(dout, q, k, v, initial_S, initial_z, grad_final_S, grad_final_z),
                              "transformer_fast::linear_attention_backward is not differentiable; "
                              "differentiate the forward op with create_graph=True instead");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return linear_attention_backward_op().call(dout, q, k, v, key_padding_mask, is_causal, eps, initial_S, initial_z,
                                             grad_final_S, grad_final_z);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, bool is_causal,
    const OptionalTensor& key_padding_mask, double eps, const OptionalTensor& initial_S,
    const OptionalTensor& initial_z, bool output_final_state) {
  const LinearAttentionArgs a =
      linear_attention_args(query, key, value, is_causal, key_padding_mask, eps, initial_S, initial_z);
  return linear_attention_forward_op().call(a.q, a.k, a.v, a.key_padding_mask, is_causal, eps, a.initial_S,
                                            a.initial_z, output_final_state);
}

TORCH_LIBRARY_IMPL(transformer_fast, CompositeImplicitAutograd, m) {
  m.impl("linear_attention", &linear_attention);
}

TORCH_LIBRARY_IMPL(transformer_fast, Autograd, m) {
  m.impl("linear_attention_backward", &linear_attention_backward_autograd);
  m.impl("linear_attention_forward", &linear_attention_forward_autograd);
}

TORCH_LIBRARY_IMPL(transformer_fast, BackendSelect, m) {
  m.impl("linear_attention_forward",
         TORCH_FN(BackendChoice<LinearAttentionForwardSig>::kernel<&linear_attention_forward_op>));
  m.impl("linear_attention_backward",
         TORCH_FN(BackendChoice<LinearAttentionBackwardSig>::kernel<&linear_attention_backward_op>));
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
