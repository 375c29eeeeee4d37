// LayerNorm/RMSNorm's dispatcher layer: the public op's argument checks, the autograd formula of
// layer_norm_forward (its backward is the layer_norm_backward op) and the autocast kernels.
#include "ops/autograd_node.h"
#include "ops/layer_norm_ops.h"
#include "ops/named_backend.h"
#include "ops/op_utils.h"

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

// t with the normalised dims as one last dim of `width` elements and a unit stride along it: t itself
// (or a copy with a unit last stride) where one dim is normalised, else a view or a copy. Leading
// dims are kept, so that autograd records no view for the usual one-dim case.
at::Tensor normalised_last(const at::Tensor& t, const c10::SymInt& width, int64_t normalized_dims) {
  if (normalized_dims == 1) return with_unit_last_stride(t);
  std::vector<c10::SymInt> shape(t.sym_sizes().begin(), t.sym_sizes().end() - normalized_dims);
  shape.push_back(width);
  return with_unit_last_stride(t.reshape_symint(shape));
}

// rms_norm's default eps: the machine epsilon of the type it computes in, as torch's (float32 for
// bf16/fp16 input, though torch's documentation says the input's dtype).
double default_rms_eps(at::ScalarType dtype) {
  return dtype == at::kDouble ? std::numeric_limits<double>::epsilon() : std::numeric_limits<float>::epsilon();
}

// The autograd node of layer_norm_forward: its backward is the layer_norm_backward op. Next edges:
// x, residual, weight, bias (empty where absent); inputs: the gradients of y and, with a residual,
// of h. Only the statistics are saved besides the normalised input (never a normalised copy).
struct LayerNormBackward : public torch::autograd::Node {
  std::string name() const override { return "transformer_fast::LayerNormBackward"; }
  void release_variables() override {
    std::lock_guard<std::mutex> lock(mutex_);
    h_.reset_data();
    weight_.reset_data();
    bias_.reset_data();
    mean_.reset_data();
    rstd_.reset_data();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    // h is this node's own output where there is a residual (x + residual), else the input x.
    const at::Tensor h = has_residual ? h_.unpack(getptr()) : h_.unpack();
    const auto weight = defined_or_none(weight_.unpack()), bias = defined_or_none(bias_.unpack());
    const bool has_dh = has_residual && grads[1].defined();
    torch::autograd::variable_list result(4);
    if (!grads[0].defined() && !has_dh) return result;
    const NamedBackendGuard named(backend);
    const at::Tensor dy = with_unit_last_stride(grads[0].defined() ? grads[0] : at::zeros_like(h));
    at::Tensor dx, dweight, dbias;
    if (at::GradMode::is_enabled()) {  // create_graph=True: a second derivative will be taken
      // Through the saved h (x + residual, this op's own output) torch reaches x and the residual.
      std::tie(dx, dweight, dbias) = layer_norm_backward_composite_op().call(dy, h, weight, bias, eps, is_rms);
      if (has_dh) dx = dx + grads[1];
    } else {
      const std::optional<at::Tensor> dh =
          has_dh ? std::optional<at::Tensor>(with_unit_last_stride(grads[1])) : std::nullopt;
      std::tie(dx, dweight, dbias) =
          layer_norm_backward_op().call(dy, dh, h, weight, bias, mean_.unpack(), rstd_.unpack(), eps, is_rms);
    }
    result[0] = dx;
    if (has_residual) result[1] = dx;
    if (weight.has_value()) result[2] = dweight;
    if (bias.has_value()) result[3] = dbias;
    return result;
  }

  torch::autograd::SavedVariable h_, weight_, bias_, mean_, rstd_;
  double eps = 0.0;
  bool is_rms = false, has_residual = false;
  int8_t backend = named_backend();  // the forward's (named_backend.h)
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_autograd(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool is_rms) {
  at::Tensor y, h, mean, rstd;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    std::tie(y, h, mean, rstd) = layer_norm_forward_op().call(x, residual, weight, bias, eps, is_rms);
  }
  if (!requires_grad(x, residual, weight, bias)) return {y, h, mean, rstd};  // nothing to record
  const bool has_residual = residual.has_value();
  auto node = make_node<LayerNormBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x, residual, weight, bias));
  node->eps = eps;
  node->is_rms = is_rms;
  node->has_residual = has_residual;
  torch::autograd::set_history(y, node);
  if (has_residual) torch::autograd::set_history(h, node);
  node->h_ = torch::autograd::SavedVariable(has_residual ? h : x, /*is_output=*/has_residual);
  node->weight_ = saved(weight);
  node->bias_ = saved(bias);
  node->mean_ = torch::autograd::SavedVariable(mean, false);
  node->rstd_ = torch::autograd::SavedVariable(rstd, false);
  return {y, h, mean, rstd};
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
    // torch's rms_norm takes a weight of any floating dtype (its product is taken in the float type
    // the normalisation computes in): such a weight (D elements) is converted to that type.
    if (is_rms && (*p)->scalar_type() != x.scalar_type() && (*p)->scalar_type() != at::kFloat) {
      **p = (*p)->to(at::promote_types(x.scalar_type(), at::kFloat));
    }
    TORCH_CHECK_TYPE((*p)->scalar_type() == x.scalar_type() || (*p)->scalar_type() == at::kFloat, name, ": ", pname,
                     " must have the input's dtype ", dtype_name(x.scalar_type()),
                     x.scalar_type() == at::kFloat ? "" : " or torch.float32", ", got ", dtype_name((*p)->scalar_type()));
  }
  const double eps = eps_in.has_value() ? *eps_in : default_rms_eps(x.scalar_type());
  TORCH_CHECK_VALUE(eps >= 0, name, ": eps must be >= 0, got ", eps);

  c10::SymInt width = 1;
  for (const auto& s : normalized_shape) width = width * s;
  if (width == 0) return {x, residual, std::nullopt, std::nullopt, eps, true};
  if (n > 1) {
    if (weight.has_value()) weight = weight->reshape_symint({width});
    if (bias.has_value()) bias = bias->reshape_symint({width});
  }
  return {normalised_last(x, width, n),
          residual.has_value() ? std::optional<at::Tensor>(normalised_last(*residual, width, n)) : std::nullopt, weight,
          bias, eps, false};
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
  if (normalized_shape.size() == 1) return {y, h};
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

TORCH_LIBRARY_IMPL(transformer_fast, BackendSelect, m) {
  m.impl("layer_norm_forward", TORCH_FN(BackendChoice<LayerNormForwardSig>::kernel<&layer_norm_forward_op>));
  m.impl("layer_norm_backward", TORCH_FN(BackendChoice<LayerNormBackwardSig>::kernel<&layer_norm_backward_op>));
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
