// LayerNorm/RMSNorm's dispatcher layer: the public op's argument checks, the autograd formula of
// layer_norm_forward (its backward is the layer_norm_backward op) and the autocast kernels.
#include "op_utils.h"
#include "ops.h"

#include <torch/autograd.h>

#include <cmath>
#include <limits>

namespace transformer_fast {

using LayerNormForwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, double, bool);
using LayerNormBackwardSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&, double, bool);
using LayerNormBackwardCompositeSig = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double,
    bool);
TRANSFORMER_FAST_OP(layer_norm_forward, LayerNormForwardSig)
TRANSFORMER_FAST_OP(layer_norm_backward, LayerNormBackwardSig)
TRANSFORMER_FAST_OP(layer_norm_backward_composite, LayerNormBackwardCompositeSig)

namespace {

// (rows, width) with a unit stride along the width: a view where the strides allow it (a slice
// along a leading dim does), else a copy.
at::Tensor as_rows(const at::Tensor& t, const c10::SymInt& width) {
  if (t.dim() == 2 && t.sym_size(1) == width && (width <= 1 || t.sym_stride(1) == 1)) return t;
  const at::Tensor rows = t.reshape_symint({-1, width});
  return rows.sym_size(1) <= 1 || rows.sym_stride(1) == 1 ? rows : rows.contiguous();
}

double machine_epsilon(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: return static_cast<double>(std::numeric_limits<c10::Half>::epsilon());
    case at::kBFloat16: return static_cast<double>(std::numeric_limits<c10::BFloat16>::epsilon());
    case at::kDouble: return std::numeric_limits<double>::epsilon();
    default: return std::numeric_limits<float>::epsilon();
  }
}

class LayerNormFunction : public torch::autograd::Function<LayerNormFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const std::optional<at::Tensor>& residual,
                                                const std::optional<at::Tensor>& weight,
                                                const std::optional<at::Tensor>& bias, double eps, bool is_rms) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [y, h, mean, rstd] = layer_norm_forward_op().call(x, residual, weight, bias, eps, is_rms);
    const bool has_residual = residual.has_value();
    // Only the statistics are saved besides the normalised input (never a normalised copy).
    ctx->save_for_backward({has_residual ? h : x, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()),
                            mean, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["is_rms"] = is_rms;
    ctx->saved_data["has_residual"] = has_residual;
    ctx->mark_non_differentiable({mean, rstd});
    // The statistics never get a gradient: no zero tensors are made for them (undefined grads are
    // handled in backward), which measurably costs a small call's backward.
    ctx->set_materialize_grads(false);
    return {y, h, mean, rstd};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& h = saved[0];
    const auto optional = [](const at::Tensor& t) { return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt; };
    const auto weight = optional(saved[1]), bias = optional(saved[2]);
    const double eps = ctx->saved_data["eps"].toDouble();
    const bool is_rms = ctx->saved_data["is_rms"].toBool(), has_residual = ctx->saved_data["has_residual"].toBool();
    const at::Tensor dy = with_unit_last_stride(grads[0].defined() ? grads[0] : at::zeros_like(h));
    const bool has_dh = has_residual && grads[1].defined();
    at::Tensor dx, dweight, dbias;
    if (at::GradMode::is_enabled()) {  // create_graph=True: a second derivative will be taken
      // Through the saved h (x + residual, this op's own output) torch reaches x and the residual.
      std::tie(dx, dweight, dbias) = layer_norm_backward_composite_op().call(dy, h, weight, bias, eps, is_rms);
      if (has_dh) dx = dx + grads[1];
    } else {
      const std::optional<at::Tensor> dh =
          has_dh ? std::optional<at::Tensor>(with_unit_last_stride(grads[1])) : std::nullopt;
      std::tie(dx, dweight, dbias) = layer_norm_backward_op().call(dy, dh, h, weight, bias, saved[3], saved[4], eps, is_rms);
    }
    return {dx, has_residual ? dx : at::Tensor(), weight ? dweight : at::Tensor(), bias ? dbias : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_autograd(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool is_rms) {
  if (!requires_grad(x, residual, weight, bias)) {  // nothing to record: no autograd node
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return layer_norm_forward_op().call(x, residual, weight, bias, eps, is_rms);
  }
  auto r = LayerNormFunction::apply(x, residual, weight, bias, eps, is_rms);
  return {r[0], r[1], r[2], r[3]};
}

template <c10::DeviceType device>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_autocast(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool is_rms) {
  const auto no_autocast = autocast_off();
  const auto cast = device == c10::DeviceType::CUDA ? std::optional<at::ScalarType>(at::kFloat) : std::nullopt;
  return layer_norm_forward_op().call(autocast_arg(cast, x, device), autocast_arg(cast, residual, device),
                                      autocast_arg(cast, weight, device), autocast_arg(cast, bias, device), eps,
                                      is_rms);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_autocast(
    const at::Tensor& dy, const std::optional<at::Tensor>& dh, const at::Tensor& h,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& mean,
    const at::Tensor& rstd, double eps, bool is_rms) {
  const auto no_autocast = autocast_off();
  return layer_norm_backward_op().call(dy, dh, h, weight, bias, mean, rstd, eps, is_rms);
}

// The backward op is never differentiated itself (second derivatives go through
// layer_norm_backward_composite): its autograd kernel steps below autograd, and refuses inputs that would
// need a graph rather than return a result without one.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_autograd(
    const at::Tensor& dy, const std::optional<at::Tensor>& dh, const at::Tensor& h,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& mean,
    const at::Tensor& rstd, double eps, bool is_rms) {
  TORCH_CHECK_NOT_IMPLEMENTED(!requires_grad(dy, dh, h, weight, bias), "transformer_fast::layer_norm_backward is not differentiable; "
                              "differentiate the forward op with create_graph=True instead");
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return layer_norm_backward_op().call(dy, dh, h, weight, bias, mean, rstd, eps, is_rms);
}

}  // namespace

LayerNormArgs layer_norm_args(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                              const std::optional<at::Tensor>& weight_in, const std::optional<at::Tensor>& bias_in,
                              std::optional<double> eps_in, const std::optional<at::Tensor>& residual_in,
                              bool is_rms) {
  const char* name = is_rms ? "rms_norm" : "layer_norm";
  check_floating("input", input);
  const auto input_shape = input.sym_sizes();
  const int64_t n = static_cast<int64_t>(normalized_shape.size());
  bool ends_with = n > 0 && input.dim() >= n;
  for (int64_t i = 0; ends_with && i < n; ++i) ends_with = input_shape[input.dim() - n + i] == normalized_shape[i];
  TORCH_CHECK_VALUE(ends_with, name, ": input of shape ", shape_str(input_shape),
                    " does not end with normalized_shape ", shape_str(normalized_shape));
  if (residual_in.has_value()) {
    check_floating("residual", *residual_in);
    check_same_device("residual", *residual_in, "input", input);
    TORCH_CHECK_VALUE(residual_in->sym_sizes() == input_shape, name, ": residual must have the input's shape ",
                      shape_str(input_shape), ", got ", shape_str(residual_in->sym_sizes()));
  }
  if (weight_in.has_value()) check_floating("weight", *weight_in);
  if (bias_in.has_value()) check_floating("bias", *bias_in);
  const auto device = input.device().type();
  const auto cast = autocast_norm(device);
  at::Tensor x = autocast_arg(cast, input, device);
  std::optional<at::Tensor> residual = autocast_arg(cast, residual_in, device);
  std::optional<at::Tensor> weight = autocast_arg(cast, weight_in, device), bias = autocast_arg(cast, bias_in, device);
  if (residual.has_value() && residual->scalar_type() != x.scalar_type()) {  // promotes, as input + residual does
    const auto common = at::promote_types(x.scalar_type(), residual->scalar_type());
    x = x.to(common);
    residual = residual->to(common);
  }
  for (const auto& [pname, p] : {std::pair<const char*, std::optional<at::Tensor>*>{"weight", &weight}, {"bias", &bias}}) {
    if (!p->has_value()) continue;
    TORCH_CHECK_VALUE((*p)->sym_sizes() == normalized_shape, name, ": ", pname,
                      " must have shape normalized_shape = ", shape_str(normalized_shape), ", got ",
                      shape_str((*p)->sym_sizes()));
    check_same_device(pname, **p, "input", x);
    TORCH_CHECK_TYPE((*p)->scalar_type() == x.scalar_type() || (*p)->scalar_type() == at::kFloat, name, ": ", pname,
                     " must have the input's dtype ", dtype_name(x.scalar_type()), " or torch.float32, got ",
                     dtype_name((*p)->scalar_type()));
  }
  // rms_norm's default eps: the machine epsilon of the dtype it computes in, as torch's.
  const double eps = eps_in.has_value() ? *eps_in : machine_epsilon(x.scalar_type());
  TORCH_CHECK_VALUE(eps >= 0, name, ": eps must be >= 0, got ", eps);

  c10::SymInt width = 1;
  for (const auto& s : normalized_shape) width = width * s;
  if (width == 0) return {x, residual, std::nullopt, std::nullopt, eps, true};
  if (n > 1) {
    if (weight.has_value()) weight = weight->reshape_symint({width});
    if (bias.has_value()) bias = bias->reshape_symint({width});
  }
  return {as_rows(x, width), residual.has_value() ? std::optional<at::Tensor>(as_rows(*residual, width)) : std::nullopt,
          weight, bias, eps, false};
}

std::tuple<at::Tensor, at::Tensor> layer_norm(const at::Tensor& input, c10::SymIntArrayRef normalized_shape,
                                              const std::optional<at::Tensor>& weight,
                                              const std::optional<at::Tensor>& bias, std::optional<double> eps,
                                              const std::optional<at::Tensor>& residual, bool is_rms) {
  const LayerNormArgs a = layer_norm_args(input, normalized_shape, weight, bias, eps, residual, is_rms);
  if (a.rows_empty) {  // rows of no elements: empty outputs, as torch.nn.functional.layer_norm gives
    const at::Tensor h = a.residual.has_value() ? a.x + *a.residual : a.x;
    return {h.clone(), a.residual.has_value() ? h : a.x.new_empty({0})};
  }
  auto [y, h, mean, rstd] = layer_norm_forward_op().call(a.x, a.residual, a.weight, a.bias, a.eps, is_rms);
  if (input.dim() == 2 && normalized_shape.size() == 1) return {y, h};
  const auto shape = input.sym_sizes();
  return {y.view_symint(shape), a.residual.has_value() ? h.view_symint(shape) : h};
}

TORCH_LIBRARY_IMPL(transformer_fast, CompositeImplicitAutograd, m) {
  m.impl("layer_norm", &layer_norm);
}

TORCH_LIBRARY_IMPL(transformer_fast, Autograd, m) {
  m.impl("layer_norm_backward", &layer_norm_backward_autograd);
  m.impl("layer_norm_forward", &layer_norm_forward_autograd);
}

TORCH_LIBRARY_IMPL(transformer_fast, AutocastCPU, m) {
  m.impl("layer_norm_forward", &layer_norm_forward_autocast<c10::DeviceType::CPU>);
  m.impl("layer_norm_backward", &layer_norm_backward_autocast);
}

TORCH_LIBRARY_IMPL(transformer_fast, AutocastCUDA, m) {
  m.impl("layer_norm_forward", &layer_norm_forward_autocast<c10::DeviceType::CUDA>);
  m.impl("layer_norm_backward", &layer_norm_backward_autocast);
}

}  // namespace transformer_fast
