// LayerNorm / RMSNorm with the residual add fused in, forward and backward, on CPU.
//
// Forward, per row: one pass over x (and the residual) writes h = x + residual and gathers the
// statistics; a second pass over h, which is still in L1/L2, writes y. Statistics are float32
// sums of values shifted near 0 within blocks of 1024 elements, blocks merged in double (Chan et
// al.), so a large common offset (mean 1e4, small variance) loses nothing to cancellation
// (RMSNorm: float32 sums of squares over 4 steps, added in double).
// Backward, per row: one pass gathers sum(g) and sum(g * xhat) (g = dy * weight) and the
// weight/bias gradient contributions; a second pass over the cached row writes dx. dweight/dbias
// are summed into one float32 buffer per block of rows, then reduced in block order: the result
// is deterministic for a fixed thread count. Within a block, rows are summed in chunks of
// kSumChunk, each chunk's sums added to the block's as it ends with Kahan's compensation, so a
// column's rounding error grows with kSumChunk, not with the block's thousands of rows (plain
// adds of the chunks gave 2.7x torch's error over 6,000 rows in one block; chunks of 64 left
// RMSNorm's over 64 rows at 1.8x, whose rows torch sums pairwise).

#include "cpu/cpu_capability.h"  // first: selects at::vec's ISA

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "cpu/layer_norm_rows.h"
#include "ops/layer_norm_ops.h"
#include "ops/op_utils.h"

namespace transformer_fast {
namespace {

using namespace cpu_norm;

constexpr int64_t kSumChunk = 16;  // rows per chunk of the weight/bias gradient sums

// weight/bias as float32 contiguous, zero-padded to a multiple of kStep (empty if absent).
at::Tensor padded_float(const std::optional<at::Tensor>& t, int64_t N, const char* name) {
  if (!t.has_value() || !t->defined()) return at::Tensor();
  TORCH_CHECK(t->dim() == 1 && t->size(0) == N, "layer_norm: ", name, " must have shape (", N, ",), got ",
              t->sizes());
  TORCH_CHECK(t->device().is_cpu(), "layer_norm: ", name, " must be a CPU tensor, got ", t->device());
  // Used in place when no padding or conversion is needed: the zero-fill and copy cost ~12 us per
  // parameter, which on 8 x 512 rows was most of the call (docs/design.md).
  if (N % kStep == 0 && t->scalar_type() == at::kFloat && t->is_contiguous()) return *t;
  const int64_t padded = (N + kStep - 1) / kStep * kStep;
  at::Tensor out = new_zeros({padded}, t->options().dtype(at::kFloat));
  out.narrow(0, 0, N).copy_(*t);
  return out;
}

void check_rows(const at::Tensor& t, const char* name, int64_t M, int64_t N, at::ScalarType dtype) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == M && t.size(1) == N, "layer_norm: ", name, " must have shape (", M,
              ", ", N, "), got ", t.sizes());
  TORCH_CHECK(t.device().is_cpu(), "layer_norm: ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "layer_norm: ", name, " must have dtype ", dtype, ", got ",
              t.scalar_type());
  // Without rows nothing is read (an empty tensor counts as contiguous whatever its strides).
  TORCH_CHECK(M == 0 || N <= 1 || t.stride(1) == 1, "layer_norm: ", name,
              " must have unit stride along the row, got strides ", t.strides());
}

// The (rows, width) matrix of a (..., width) tensor: a view where the leading dims flatten, else a copy.
at::Tensor rows_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() >= 1, "layer_norm: ", name, " must have at least one dimension");
  return t.dim() == 2 ? t : t.reshape({-1, t.size(-1)});
}

// Rows per parallel task: at least ~32K elements, so narrow rows are not scheduled one by one.
int64_t row_grain(int64_t N) { return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(N, 1)); }

template <typename T, bool kResidual, bool kRms>
void forward_impl(const at::Tensor& x, const at::Tensor& r, const at::Tensor& h, const at::Tensor& y,
                  const at::Tensor& w, const at::Tensor& b, const at::Tensor& mean, const at::Tensor& rstd,
                  double eps) {
  const int64_t M = x.size(0), N = x.size(1);
  const T* xp = x.const_data_ptr<T>();
  const T* rp = kResidual ? r.const_data_ptr<T>() : nullptr;
  T* hp = kResidual ? h.data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  const float* wp = w.defined() ? w.const_data_ptr<float>() : nullptr;
  const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
  float* meanp = kRms ? nullptr : mean.data_ptr<float>();
  float* rstdp = rstd.data_ptr<float>();
  const int64_t sx = x.stride(0), sr = kResidual ? r.stride(0) : 0, sh = kResidual ? h.stride(0) : 0,
                sy = y.stride(0);
  at::parallel_for(0, M, row_grain(N), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      forward_row<T, kResidual, kRms>(xp + i * sx, kResidual ? rp + i * sr : nullptr,
                                      kResidual ? hp + i * sh : nullptr, yp + i * sy, wp, bp, N,
                                      static_cast<float>(eps), kRms ? nullptr : meanp + i, rstdp + i);
    }
  });
}

template <typename T, bool kRms>
void backward_impl(const at::Tensor& dy, const at::Tensor& dh, const at::Tensor& h, const at::Tensor& w,
                   const at::Tensor& mean, const at::Tensor& rstd, const at::Tensor& dx, at::Tensor& dw_partial,
                   at::Tensor& db_partial, const at::Tensor& chunk_sums, int64_t num_blocks, float eps) {
  const int64_t M = h.size(0), N = h.size(1);
  const int64_t padded = (N + kStep - 1) / kStep * kStep;
  const T* dyp = dy.const_data_ptr<T>();
  const T* dhp = dh.defined() ? dh.const_data_ptr<T>() : nullptr;
  const T* hp = h.const_data_ptr<T>();
  T* dxp = dx.data_ptr<T>();
  const float* wp = w.defined() ? w.const_data_ptr<float>() : nullptr;
  const float* meanp = kRms ? nullptr : mean.const_data_ptr<float>();
  const float* rstdp = rstd.const_data_ptr<float>();
  float* dwp = dw_partial.defined() ? dw_partial.data_ptr<float>() : nullptr;
  float* dbp = db_partial.defined() ? db_partial.data_ptr<float>() : nullptr;
  const int64_t sdy = dy.stride(0), sdh = dh.defined() ? dh.stride(0) : 0, sh = h.stride(0), sdx = dx.stride(0);
  float* chunks = chunk_sums.defined() ? chunk_sums.data_ptr<float>() : nullptr;  // (num_blocks, 4, padded)
  // Block k owns rows [k*M/num_blocks, (k+1)*M/num_blocks), partial-sum row k and chunk rows 4k..4k+3
  // (dw's and db's chunk sums, then their compensations).
  at::parallel_for(0, num_blocks, 1, [&](int64_t block_begin, int64_t block_end) {
    for (int64_t k = block_begin; k < block_end; ++k) {
      const int64_t row_begin = k * M / num_blocks, row_end = (k + 1) * M / num_blocks;
      float* dw_acc = dwp != nullptr ? dwp + k * padded : nullptr;
      float* db_acc = dbp != nullptr ? dbp + k * padded : nullptr;
      const bool chunked = chunks != nullptr && row_end - row_begin > kSumChunk;
      float* dw_chunk = chunked && dw_acc != nullptr ? chunks + 4 * k * padded : nullptr;
      float* db_chunk = chunked && db_acc != nullptr ? chunks + (4 * k + 1) * padded : nullptr;
      float* compensation = chunked ? chunks + (4 * k + 2) * padded : nullptr;  // dw's, then db's
      if (chunked) std::fill_n(compensation, 2 * padded, 0.f);
      for (int64_t c = row_begin; c < row_end; c += kSumChunk) {
        if (dw_chunk != nullptr) std::fill_n(dw_chunk, padded, 0.f);
        if (db_chunk != nullptr) std::fill_n(db_chunk, padded, 0.f);
        for (int64_t i = c; i < std::min(row_end, c + kSumChunk); ++i) {
          backward_row<T, kRms>(dyp + i * sdy, dhp != nullptr ? dhp + i * sdh : nullptr, hp + i * sh,
                                dxp + i * sdx, wp, kRms ? 0.f : meanp[i], rstdp[i], N, eps,
                                dw_chunk != nullptr ? dw_chunk : dw_acc, db_chunk != nullptr ? db_chunk : db_acc);
        }
        for (auto [acc, chunk, lost] : {std::tuple{dw_acc, dw_chunk, compensation},
                                        std::tuple{db_acc, db_chunk, compensation + padded}}) {
          if (chunk == nullptr) continue;
          for (int64_t j = 0; j < padded; j += kVec) {  // Kahan: acc += chunk, carrying what rounding lost
            const Vec sum = Vec::loadu(acc + j), add = Vec::loadu(chunk + j) - Vec::loadu(lost + j);
            const Vec next = sum + add;
            ((next - sum) - add).store(lost + j);
            next.store(acc + j);
          }
        }
      }
    }
  });
}

#define LN_DISPATCH_TYPES(TYPE, NAME, ...)                                                            \
  [&] {                                                                                              \
    switch (TYPE) {                                                                                  \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }                             \
      case at::kBFloat16: { using scalar_t = at::BFloat16; return __VA_ARGS__(); }                   \
      case at::kHalf: { using scalar_t = at::Half; return __VA_ARGS__(); }                           \
      default: TORCH_CHECK(false, NAME, ": unsupported dtype ", TYPE, " (float32, bfloat16, float16)"); \
    }                                                                                                \
  }()

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(
    const at::Tensor& x_in, const std::optional<at::Tensor>& residual_in, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool is_rms) {
  const at::Tensor x = rows_of(x_in, "x");
  const std::optional<at::Tensor> residual =
      residual_in.has_value() && residual_in->defined() ? std::optional<at::Tensor>(rows_of(*residual_in, "residual"))
                                                        : std::nullopt;
  const int64_t M = x.size(0), N = x.size(1);
  TORCH_CHECK(N >= 1, "layer_norm_forward: the row width must be >= 1");
  check_rows(x, "x", M, N, x.scalar_type());
  const bool has_residual = residual.has_value() && residual->defined();
  if (has_residual) check_rows(*residual, "residual", M, N, x.scalar_type());
  TORCH_CHECK(!(is_rms && bias.has_value() && bias->defined()), "layer_norm_forward: RMSNorm takes no bias");
  const at::Tensor w = padded_float(weight, N, "weight"), b = padded_float(bias, N, "bias");
  const auto opts = x.options();
  at::Tensor y = new_output({M, N}, opts);
  at::Tensor h = has_residual ? new_output({M, N}, opts) : at::Tensor();
  at::Tensor mean = is_rms ? at::Tensor() : new_output({M}, opts.dtype(at::kFloat));
  at::Tensor rstd = new_output({M}, opts.dtype(at::kFloat));
  const at::Tensor r = has_residual ? *residual : at::Tensor();
  LN_DISPATCH_TYPES(x.scalar_type(), "layer_norm_forward", [&] {
    if (has_residual) {
      if (is_rms) forward_impl<scalar_t, true, true>(x, r, h, y, w, b, mean, rstd, eps);
      else forward_impl<scalar_t, true, false>(x, r, h, y, w, b, mean, rstd, eps);
    } else {
      if (is_rms) forward_impl<scalar_t, false, true>(x, r, h, y, w, b, mean, rstd, eps);
      else forward_impl<scalar_t, false, false>(x, r, h, y, w, b, mean, rstd, eps);
    }
  });
  if (x_in.dim() == 2) return {y, h, mean, rstd};
  return {y.view(x_in.sizes()), has_residual ? h.view(x_in.sizes()) : h, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& dy_in, const std::optional<at::Tensor>& dh_in, const at::Tensor& h_in,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& mean, const at::Tensor& rstd, double eps, bool is_rms) {
  (void)eps;
  const at::Tensor h = rows_of(h_in, "h"), dy = rows_of(dy_in, "dy");
  const std::optional<at::Tensor> dh =
      dh_in.has_value() && dh_in->defined() ? std::optional<at::Tensor>(rows_of(*dh_in, "dh")) : std::nullopt;
  const int64_t M = h.size(0), N = h.size(1);
  TORCH_CHECK(N >= 1, "layer_norm_backward: the row width must be >= 1");
  check_rows(h, "h", M, N, h.scalar_type());
  check_rows(dy, "dy", M, N, h.scalar_type());
  const bool has_dh = dh.has_value() && dh->defined();
  if (has_dh) check_rows(*dh, "dh", M, N, h.scalar_type());
  TORCH_CHECK(rstd.dim() == 1 && rstd.size(0) == M && rstd.scalar_type() == at::kFloat,
              "layer_norm_backward: rstd must be a float32 (", M, ",) tensor, got ", rstd.scalar_type(), " ",
              rstd.sizes());
  at::Tensor mean_c;
  if (!is_rms) {
    TORCH_CHECK(mean.has_value() && mean->defined() && mean->dim() == 1 && mean->size(0) == M &&
                    mean->scalar_type() == at::kFloat,
                "layer_norm_backward: mean must be a float32 (", M, ",) tensor");
    mean_c = mean->contiguous();
  }
  const at::Tensor rstd_c = rstd.contiguous();
  const at::Tensor w = padded_float(weight, N, "weight");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "layer_norm_backward: bias must have shape (", N, ",)");
  }
  const int64_t padded = (N + kStep - 1) / kStep * kStep;
  // A block of rows per thread, but at least ~32K elements per block: for small inputs a parallel
  // region costs more than the work.
  const int64_t num_blocks =
      std::max<int64_t>(1, std::min<int64_t>({M, at::get_num_threads(), M * N / (int64_t{1} << 15)}));
  const auto fopts = h.options().dtype(at::kFloat);
  // One block of rows that needs no padding: the kernel sums dweight/dbias straight into the
  // results (on tiny inputs the select/narrow views of a partial buffer were ~10% of the call).
  const bool direct = num_blocks == 1 && padded == N;
  auto partial_sums = [&](bool needed) {
    if (!needed) return at::Tensor();
    return direct ? new_zeros({N}, fopts) : new_zeros({num_blocks, padded}, fopts);
  };
  at::Tensor dw_partial = partial_sums(w.defined());
  at::Tensor db_partial = partial_sums(has_bias);
  const bool chunked = (w.defined() || has_bias) && (M + num_blocks - 1) / num_blocks > kSumChunk;
  const at::Tensor chunk_sums = chunked ? new_tensor({num_blocks, 4, padded}, fopts) : at::Tensor();
  at::Tensor dx = new_output({M, N}, h.options());
  const at::Tensor dh_t = has_dh ? *dh : at::Tensor();
  LN_DISPATCH_TYPES(h.scalar_type(), "layer_norm_backward", [&] {
    if (is_rms) backward_impl<scalar_t, true>(dy, dh_t, h, w, mean_c, rstd_c, dx, dw_partial, db_partial, chunk_sums,
                                                num_blocks, static_cast<float>(eps));
    else backward_impl<scalar_t, false>(dy, dh_t, h, w, mean_c, rstd_c, dx, dw_partial, db_partial, chunk_sums,
                                        num_blocks, static_cast<float>(eps));
  });
  // Final reduce over the blocks, in block order (one block: its row is the sum).
  auto reduce = [&](const at::Tensor& partial, at::ScalarType dtype) {
    if (direct) return partial.scalar_type() == dtype ? partial : partial.to(dtype);
    if (num_blocks == 1) return partial[0].narrow(0, 0, N).to(dtype);
    at::Tensor total = new_tensor({N}, fopts);
    const float* p = partial.const_data_ptr<float>();
    float* t = total.data_ptr<float>();
    at::parallel_for(0, N, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) t[j] = p[j];
      for (int64_t k = 1; k < num_blocks; ++k) {
        const float* row = p + k * padded;
        for (int64_t j = begin; j < end; ++j) t[j] += row[j];
      }
    });
    return total.to(dtype);
  };
  at::Tensor dweight, dbias;
  if (w.defined()) dweight = reduce(dw_partial, weight->scalar_type());
  if (has_bias) dbias = reduce(db_partial, bias->scalar_type());
  return {h_in.dim() == 2 ? dx : dx.view(h_in.sizes()), dweight, dbias};
}

}  // namespace transformer_fast

namespace transformer_fast {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_forward_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& residual, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool is_rms) {
  auto [y, h, mean, rstd] = layer_norm_forward(x, residual, weight, bias, eps, is_rms);
  return {y, or_empty(h, x), or_empty(mean, rstd), rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_cpu(
    const at::Tensor& dy, const std::optional<at::Tensor>& dh, const at::Tensor& h,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, const at::Tensor& mean,
    const at::Tensor& rstd, double eps, bool is_rms) {
  auto [dx, dweight, dbias] = layer_norm_backward(dy, dh, h, weight, bias, is_rms ? std::nullopt : std::optional(mean),
                                                  rstd, eps, is_rms);
  return {dx, or_empty(dweight, h), or_empty(dbias, h)};
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fast, CPU, m) {
  m.impl("layer_norm_forward", &layer_norm_forward_cpu);
  m.impl("layer_norm_backward", &layer_norm_backward_cpu);
}

}  // namespace transformer_fast
