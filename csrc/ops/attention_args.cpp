// Softmax attention's public ops (CompositeImplicitAutograd): scaled_dot_product_attention and
// varlen_attn check their arguments once, apply torch's autocast rule, normalise the inputs to the
// kernel ops' contract (transformer_fast/attention.py) and call attention_forward through the
// dispatcher. Values inside index tensors (cu_seq_q, block_table, ...) are checked by the kernels
// that read them: reading them here would synchronise with a GPU.
#include "ops/attention_ops.h"
#include "ops/op_utils.h"

#include <cmath>
#include <limits>

namespace transformer_fast {
namespace {

void check_window(at::IntArrayRef window) {
  TORCH_CHECK_VALUE(window.size() == 2, "window_size must be a pair (left, right), got ", window.size(),
                    " values");
  TORCH_CHECK_VALUE(window[0] >= -1 && window[1] >= -1,
                    "window_size entries must be >= 0, or -1 for an unbounded side, got (", window[0], ", ",
                    window[1], ")");
}

// float32, or float64 for float64 inputs (which only the plain-torch backend runs).
at::ScalarType stats_dtype(const at::Tensor& q) { return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// (B, H) view of ALiBi slopes given as (H,) or (B, H), in stats_dtype.
at::Tensor alibi_view(const at::Tensor& slopes, const c10::SymInt& B, const c10::SymInt& H, const at::Tensor& ref) {
  check_floating("alibi_slopes", slopes);
  check_same_device("alibi_slopes", slopes, "query", ref);
  // The slopes are fixed in the models that use them (BLOOM, MPT): no kernel computes their
  // gradient, and a slope tensor that asks for one is refused rather than left without it.
  TORCH_CHECK_NOT_IMPLEMENTED(!requires_grad(slopes),
                              "alibi_slopes requires grad, but the attention kernels compute no gradient for "
                              "the slopes; pass alibi_slopes.detach()");
  const bool per_head = slopes.dim() == 1 && slopes.sym_size(0) == H;
  const bool per_batch = slopes.dim() == 2 && slopes.sym_size(0) == B && slopes.sym_size(1) == H;
  TORCH_CHECK_VALUE(per_head || per_batch, "alibi_slopes must have shape (heads,) = (", H,
                    ",) or (batch, heads) = (", B, ", ", H, "), got ", shape_str(slopes.sym_sizes()));
  const at::Tensor converted = slopes.to(stats_dtype(ref));
  return per_head ? converted.unsqueeze(0).expand_symint({B, H}) : converted;
}

// The extras shared by both public ops, into a.x (the kernel ops' form).
void set_extras(AttentionArgs& a, const c10::SymInt& B, const c10::SymInt& H, at::OptionalIntArrayRef window_size,
                std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
                const std::optional<at::Tensor>& sinks) {
  // The kernels compute in float32 but for float64 inputs, where a scale beyond float32's range
  // would be inf (NaN outputs).
  const bool in_float32 = stats_dtype(a.q) == at::kFloat;
  constexpr double kFloat32Max = std::numeric_limits<float>::max();
  TORCH_CHECK_VALUE(!in_float32 || std::abs(a.scale) <= kFloat32Max,
                    "scale must be within float32's range, |scale| <= ", kFloat32Max, ", for ",
                    dtype_name(a.q.scalar_type()), " inputs (the kernels compute in float32), got ", a.scale);
  if (window_size.has_value()) {
    check_window(*window_size);
    a.x.window_left = (*window_size)[0];
    a.x.window_right = (*window_size)[1];
  }
  if (softcap.has_value()) {
    TORCH_CHECK_VALUE(std::isfinite(*softcap) && *softcap > 0.0, "softcap must be a positive finite number or None, got ",
                      *softcap);
    // A softcap at or above 2^127 caps nothing float32 holds (softcap * tanh(s / softcap) = s to
    // float32 precision for |s| < 2^115), and the Triton kernels' softcap * log2(e) would overflow:
    // in float32 it means no capping.
    a.x.softcap = in_float32 && *softcap >= 0x1p127 ? 0.0 : *softcap;
  }
  if (alibi_slopes.has_value()) a.x.alibi_slopes = alibi_view(*alibi_slopes, B, H, a.q);
  if (sinks.has_value()) {
    check_floating("sinks", *sinks);
    check_same_device("sinks", *sinks, "query", a.q);
    TORCH_CHECK_VALUE(sinks->dim() == 1 && sinks->sym_size(0) == H, "sinks must have shape (heads,) = (", H,
                      ",), got ", shape_str(sinks->sym_sizes()));
    a.x.sinks = sinks->to(stats_dtype(a.q)).contiguous();  // differentiable: the gradient returns in sinks' dtype
  }
}

void check_heads(const c10::SymInt& H, const c10::SymInt& Hk, bool enable_gqa) {
  TORCH_CHECK_VALUE(Hk == H || (enable_gqa && Hk > 0 && H % Hk == 0), "key has ", Hk, " heads and query ", H,
                    ": they must be equal, or pass enable_gqa=True with key heads dividing query heads");
}

double resolved_scale(std::optional<double> scale, const c10::SymInt& D) {
  TORCH_CHECK_VALUE(!scale.has_value() || std::isfinite(*scale), "scale must be finite, got ", *scale);
  return scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(D.guard_int(__FILE__, __LINE__)));
}

void check_dropout(double dropout_p) {
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p must be in [0, 1), got ", dropout_p);
}

// A 1-D or 2-D int32 index tensor on the query's device.
void check_index(const char* name, const at::Tensor& t, int64_t ndim, const at::Tensor& ref) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, name, " must be an int32 tensor, got dtype ",
                   dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == ndim, name, " must have ", ndim, " dimension", ndim == 1 ? "" : "s", ", got shape ",
                    shape_str(t.sym_sizes()));
  check_same_device(name, t, "query", ref);
}

// The dropout seed of a public op's call: the one given, else one drawn from torch's default CPU
// generator (so torch.manual_seed makes runs repeatable, and torch.compile traces the draw into its
// graph); None without dropout.
std::optional<at::Tensor> call_seed(double dropout_p, const std::optional<at::Tensor>& seed) {
  if (dropout_p == 0.0 || seed.has_value()) return seed;
  return at::randint(int64_t{1} << 62, {}, at::TensorOptions().dtype(at::kLong));
}

}  // namespace

AttentionArgs attention_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                             std::optional<double> scale, bool enable_gqa,
                             const std::optional<at::Tensor>& key_padding_mask, at::OptionalIntArrayRef window_size,
                             std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
                             const std::optional<at::Tensor>& sinks) {
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
  check_heads(H, Hk, enable_gqa);
  check_head_dim("query", D);
  check_head_dim("value", a.v.sym_size(3));
  check_dropout(dropout_p);
  a.scale = resolved_scale(scale, D);

  if (attn_mask.has_value()) {
    const at::Tensor mask = autocast_arg(cast, *attn_mask, device);
    // Float masks in float32 are accepted with any query dtype, as torch's SDPA does; the kernels
    // add them in float32.
    const auto mask_dtype = mask.scalar_type();
    TORCH_CHECK_TYPE(mask_dtype == at::kBool || mask_dtype == a.q.scalar_type() || mask_dtype == at::kFloat,
                     "attn_mask must be bool (True = attend), float32 or have the query's dtype ",
                     dtype_name(a.q.scalar_type()), ", got ", dtype_name(mask_dtype));
    check_same_device("attn_mask", mask, "query", a.q);
    const std::vector<c10::SymInt> shape{B, H, Nq, Nk};
    bool broadcasts = mask.dim() <= 4;
    for (int64_t i = 1; broadcasts && i <= mask.dim(); ++i) {
      const c10::SymInt& m = mask.sym_size(-i);
      broadcasts = m == 1 || m == shape[4 - i];
    }
    TORCH_CHECK_VALUE(broadcasts, "attn_mask of shape ", shape_str(mask.sym_sizes()),
                      " does not broadcast to (batch, heads, query_len, key_len) = ", shape_str(shape));
    // A bf16/fp16 mask that requires grad and is broadcast: autograd sums dS over the broadcast dims.
    // It does so in float32, as torch's math does, from a float32 mask (its dS is float32), and not
    // from dS rounded to the mask's dtype (up to 1.5 units in the last place, where torch's errs 0.5).
    const bool reduced_grad = mask.requires_grad() && at::GradMode::is_enabled() &&
                              (mask_dtype == at::kBFloat16 || mask_dtype == at::kHalf) &&
                              mask.sym_numel() != B * H * Nq * Nk;
    a.attn_mask = (reduced_grad ? mask.to(at::kFloat) : mask).expand_symint(shape);  // broadcast dims: stride 0
  }
  if (key_padding_mask.has_value()) {
    a.key_padding_mask = a.unbatched && key_padding_mask->dim() == 1 ? key_padding_mask->unsqueeze(0)
                                                                     : *key_padding_mask;
    check_key_padding_mask(a.key_padding_mask, B, Nk, a.q);
  }
  set_extras(a, B, H, window_size, softcap, alibi_slopes, sinks);
  a.q = with_unit_last_stride(a.q);
  a.k = with_unit_last_stride(a.k);
  a.v = with_unit_last_stride(a.v);
  return a;
}

at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const std::optional<at::Tensor>& attn_mask, double dropout_p,
                                        bool is_causal, std::optional<double> scale, bool enable_gqa,
                                        const std::optional<at::Tensor>& key_padding_mask,
                                        const std::optional<at::Tensor>& seed,
                                        at::OptionalIntArrayRef window_size, std::optional<double> softcap,
                                        const std::optional<at::Tensor>& alibi_slopes,
                                        const std::optional<at::Tensor>& sinks) {
  const AttentionArgs a = attention_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                         key_padding_mask, window_size, softcap, alibi_slopes, sinks);
  const at::Tensor out = std::get<0>(call_attention_forward(a, is_causal, dropout_p, call_seed(dropout_p, seed)));
  return a.unbatched ? out.squeeze(0) : out;
}

AttentionArgs varlen_args(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const at::Tensor& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k, int64_t max_q,
                          int64_t max_k, std::optional<double> scale, at::IntArrayRef window_size, bool enable_gqa,
                          const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& block_table,
                          std::optional<int64_t> num_splits, std::optional<double> softcap,
                          const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& sinks,
                          double dropout_p) {
  const bool paged = block_table.has_value();
  const char* kv_dims = paged ? "4 (pages, page_size, kv_heads, head_dim)" : "3 (total_k, kv_heads, head_dim)";
  check_ndim("query", query, query.dim() == 3, "3 (total_q, heads, head_dim)");
  check_ndim("key", key, key.dim() == (paged ? 4 : 3), kv_dims);
  check_ndim("value", value, value.dim() == (paged ? 4 : 3), kv_dims);
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"query", &query}, {"key", &key},
                                {"value", &value}}) {
    check_floating(name, *t);
  }
  AttentionArgs a;
  const auto device = query.device().type();
  const auto cast = autocast_lower_precision(device);
  a.q = autocast_arg(cast, query, device);
  a.k = autocast_arg(cast, key, device);
  a.v = autocast_arg(cast, value, device);
  check_same_device("key", a.k, "query", a.q);
  check_same_dtype("key", a.k, "query", a.q);
  check_same_device("value", a.v, "query", a.q);
  check_same_dtype("value", a.v, "query", a.q);
  const int64_t head_dim = paged ? 3 : 2, rows_dims = paged ? 2 : 1;
  const c10::SymInt H = a.q.sym_size(1), D = a.q.sym_size(2), Hk = a.k.sym_size(head_dim - 1);
  for (int64_t d = 0; d < rows_dims + 1; ++d) {
    check_size("value", a.v, d, a.k.sym_size(d), d == rows_dims ? "kv heads, as key" : "rows, as key");
  }
  check_size("key", a.k, head_dim, D, "head dim, as query");
  check_heads(H, Hk, enable_gqa);
  check_head_dim("query", D);
  check_head_dim("value", a.v.sym_size(head_dim));
  check_dropout(dropout_p);
  a.scale = resolved_scale(scale, D);

  check_index("cu_seq_q", cu_seq_q, 1, a.q);
  TORCH_CHECK_VALUE(cu_seq_q.sym_size(0) >= 1, "cu_seq_q must hold batch + 1 >= 1 offsets, got shape ",
                    shape_str(cu_seq_q.sym_sizes()));
  const c10::SymInt B = cu_seq_q.sym_size(0) - 1;
  if (cu_seq_k.has_value()) {
    check_index("cu_seq_k", *cu_seq_k, 1, a.q);
    check_size("cu_seq_k", *cu_seq_k, 0, cu_seq_q.sym_size(0), "batch + 1, as cu_seq_q");
  } else {
    TORCH_CHECK_VALUE(paged, "cu_seq_k may be None only with a paged cache (block_table)");
  }
  if (seqused_k.has_value()) {
    check_index("seqused_k", *seqused_k, 1, a.q);
    check_size("seqused_k", *seqused_k, 0, B, "batch");
  }
  if (paged) {
    check_index("block_table", *block_table, 2, a.q);
    check_size("block_table", *block_table, 0, B, "batch");
    TORCH_CHECK_VALUE(seqused_k.has_value(), "block_table needs seqused_k (the keys used in each sequence's pages)");
  }
  TORCH_CHECK_VALUE(max_q >= 0 && max_k >= 0, "max_q and max_k must be >= 0, got ", max_q, " and ", max_k);
  TORCH_CHECK_VALUE(!num_splits.has_value() || *num_splits >= 1, "num_splits must be >= 1 or None, got ",
                    num_splits.value_or(0));
  a.x.cu_seq_q = cu_seq_q;
  a.x.cu_seq_k = cu_seq_k;
  a.x.seqused_k = seqused_k;
  a.x.block_table = block_table;
  a.x.max_q = max_q;
  a.x.max_k = max_k;
  a.x.num_splits = num_splits.value_or(0);
  set_extras(a, B, H, window_size, softcap, alibi_slopes, sinks);
  a.q = with_unit_last_stride(a.q);
  a.k = with_unit_last_stride(a.k);
  a.v = with_unit_last_stride(a.v);
  return a;
}

std::tuple<at::Tensor, at::Tensor> varlen_attn(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& cu_seq_q,
    const std::optional<at::Tensor>& cu_seq_k, int64_t max_q, int64_t max_k, bool return_lse,
    std::optional<double> scale, at::IntArrayRef window_size, bool enable_gqa,
    const std::optional<at::Tensor>& seqused_k, const std::optional<at::Tensor>& block_table,
    std::optional<int64_t> num_splits, std::optional<double> softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, double dropout_p, const std::optional<at::Tensor>& seed) {
  const AttentionArgs a = varlen_args(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size,
                                      enable_gqa, seqused_k, block_table, num_splits, softcap, alibi_slopes, sinks,
                                      dropout_p);
  auto [out, lse] = call_attention_forward(a, false, dropout_p, call_seed(dropout_p, seed));
  return {out, return_lse ? lse : lse.new_empty({0})};
}

TORCH_LIBRARY_IMPL(transformer_fast, CompositeImplicitAutograd, m) {
  m.impl("scaled_dot_product_attention", &scaled_dot_product_attention);
  m.impl("varlen_attn", &varlen_attn);
}

}  // namespace transformer_fast
