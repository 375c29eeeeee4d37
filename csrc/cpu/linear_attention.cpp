// Linear attention (Katharopoulos et al. 2020) with phi(x) = elu(x) + 1 on CPU: forward and backward,
// causal and not. The contract is in transformer_fast/linear_attention.py.
//
// Per (batch, head), with phi applied to q and k, padded keys loaded as zero rows (their memory is
// never read, so NaN there cannot leak) and V' = [V, 1] (the ones column makes every product that
// builds the numerator also build the denominator):
//   S' = sum_j phi(k_j)^T v'_j (D x (Dv+1)) = [S, z],   n'_i = phi(q_i) S' = [numerator, denominator - eps].
// Causal: the sequence is cut into chunks of kCausalChunk tokens; a chunk's output is its masked
// C x C block phi(Q_c) phi(K_c)^T V'_c plus phi(Q_c) S'_(before the chunk), then S' += phi(K_c)^T V'_c.
// Nothing of size N x D x Dv is ever formed; the state is float32 (float64 for float64 inputs),
// summed in float64 across chunks (StateSum).
// A carried state is the recurrence's starting value: S' starts from [S0, z0] instead of zero, and
// the final state is S' after the last chunk (non-causal: after the last key).
//
// Backward, with g_i = dout_i, den_i = n'_i[Dv] + eps, out_i = n_i / den_i:
//   G'_i = [g_i / den_i, -(g_i . out_i) / den_i]         (d numerator, d denominator)
//   dW_ij = G'_i . v'_j  for the allowed (i, j)           (d phi(q_i).phi(k_j))
//   d phi(q_i) = sum_j dW_ij phi(k_j) = S'_(i) G'_i       (S'_(i): the state the forward used for row i)
//   d phi(k_j) = sum_i dW_ij phi(q_i) = R'_(j) v'_j,  dv_j = R'_(j)[:, :Dv]^T phi(k_j)
// with the reverse-direction state R'_(j) = dS'_F + sum_{allowed i} phi(q_i)^T G'_i, where dS'_F =
// [dS_F, dz_F] is the gradient arriving at the final state (every unpadded key is in it). The causal
// form does the intra-chunk (C x C) parts in a forward sweep (which also yields G'), and the
// inter-chunk parts with R' in a reverse sweep. The initial state's gradient is R' once every row
// is in it: dS'0 = dS'_F + sum_i phi(q_i)^T G'_i. d x = d phi(x) * elu'(x), and elu'(x) = min(phi(x), 1).

#include "cpu/cpu_capability.h"  // first: selects at::vec's ISA

#include "cpu/cpu_blas.h"
#include "ops/linear_attention_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

namespace transformer_fast {
namespace {

constexpr int64_t kCausalChunk = 64;   // tokens per chunk of the causal form (16..128 time alike)
constexpr int64_t kChunk = 256;        // rows per block of the non-causal form (only bounds buffers)
constexpr int64_t kColumnRows = 16;    // rows per partial sum of a state's last column (StateSum)

// Row-major c (m x n, row stride ldc) = op(a) op(b) + beta * c (see cpu_blas::gemm).
template <typename acc_t>
void matmul(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const acc_t* a, int64_t lda,
            const acc_t* b, int64_t ldb, acc_t beta, acc_t* c, int64_t ldc) {
  cpu_blas::gemm<acc_t>(trans_a, trans_b, m, n, k, acc_t(1), a, lda, b, ldb, beta, c, ldc);
}

// x <- phi(x) = elu(x) + 1 = (x > 0 ? x + 1 : exp(x)).
template <typename acc_t>
void apply_feature_map(acc_t* x, int64_t n) {
  using Vec = at::vec::Vectorized<acc_t>;
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    Vec v = Vec::loadu(x + i);
    Vec::blendv(v.exp_u20(), v + Vec(acc_t(1)), v > Vec(acc_t(0))).store(x + i);
  }
  for (; i < n; ++i) x[i] = x[i] > 0 ? x[i] + acc_t(1) : std::exp(x[i]);
}

// (batch, head) slices of a (B, H, N, width) tensor with a unit last-dim stride.
template <typename scalar_t>
struct Heads {
  const scalar_t* data;
  int64_t stride_b, stride_h, stride_n;
  explicit Heads(const at::Tensor& t)
      : data(t.const_data_ptr<scalar_t>()), stride_b(t.stride(0)), stride_h(t.stride(1)), stride_n(t.stride(2)) {}
  const scalar_t* head(int64_t b, int64_t h) const { return data + b * stride_b + h * stride_h; }
};

// A state given per (batch, head) as S (B, H, D, Dv) and z (B, H, D), any strides; either may be
// absent (zero). load() writes head (b, h) as S' = [S, z] (D x (Dv + 1)).
template <typename acc_t>
struct StateHeads {
  const acc_t* S = nullptr;
  const acc_t* z = nullptr;
  int64_t S_b = 0, S_h = 0, S_d = 0, S_e = 0, z_b = 0, z_h = 0, z_d = 0;
  StateHeads(const at::Tensor& S_t, const at::Tensor& z_t) {
    if (S_t.defined()) {
      S = S_t.const_data_ptr<acc_t>();
      S_b = S_t.stride(0), S_h = S_t.stride(1), S_d = S_t.stride(2), S_e = S_t.stride(3);
    }
    if (z_t.defined()) {
      z = z_t.const_data_ptr<acc_t>();
      z_b = z_t.stride(0), z_h = z_t.stride(1), z_d = z_t.stride(2);
    }
  }
  void load(int64_t b, int64_t h, int64_t D, int64_t Dv, acc_t* dst) const {
    const int64_t E = Dv + 1;
    for (int64_t d = 0; d < D; ++d) {
      acc_t* row = dst + d * E;
      if (S != nullptr) {
        const acc_t* src = S + b * S_b + h * S_h + d * S_d;
        for (int64_t e = 0; e < Dv; ++e) row[e] = src[e * S_e];
      } else {
        std::fill(row, row + Dv, acc_t(0));
      }
      row[Dv] = z != nullptr ? z[b * z_b + h * z_h + d * z_d] : acc_t(0);
    }
  }
};

// S (D x Dv) and z (D), contiguous, from S' = [S, z] (D x (Dv + 1)).
template <typename acc_t>
void store_state(const acc_t* src, int64_t D, int64_t Dv, acc_t* S, acc_t* z) {
  const int64_t E = Dv + 1;
  for (int64_t d = 0; d < D; ++d) {
    std::copy(src + d * E, src + d * E + Dv, S + d * Dv);
    z[d] = src[d * E + Dv];
  }
}

// dst[r, :width] = src row r (as acc_t, through phi if feature_map) for r < rows; rows of padded
// keys are zeros and are not read. With ones_column, dst[r, width] = 1 (0 for a padded key).
template <typename scalar_t, typename acc_t>
void load_rows(const scalar_t* src, int64_t stride, int64_t rows, int64_t width, const bool* padded,
               bool feature_map, bool ones_column, acc_t* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    acc_t* d = dst + r * ld;
    const bool skip = padded != nullptr && padded[r];
    if (skip) {
      std::fill(d, d + width, acc_t(0));
    } else {
      const scalar_t* s = src + r * stride;
      for (int64_t c = 0; c < width; ++c) d[c] = static_cast<acc_t>(s[c]);
      if (feature_map) apply_feature_map(d, width);
    }
    if (ones_column) d[width] = skip ? acc_t(0) : acc_t(1);
  }
}

// dst row r = n'[r, :Dv] / (n'[r, Dv] + eps).
template <typename scalar_t, typename acc_t>
void store_normalized(const acc_t* n, int64_t rows, int64_t Dv, acc_t eps, scalar_t* dst) {
  const int64_t E = Dv + 1;
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t inv_den = acc_t(1) / (n[r * E + Dv] + eps);
    for (int64_t c = 0; c < Dv; ++c) dst[r * Dv + c] = static_cast<scalar_t>(n[r * E + c] * inv_den);
  }
}

// G'[r] = [g_r / den_r, -(g_r . out_r) / den_r] from n' (rows x E) and the upstream gradient rows.
template <typename scalar_t, typename acc_t, typename Vec = at::vec::Vectorized<acc_t>>
void gradient_of_normalization(const acc_t* n, const scalar_t* dout, int64_t dout_stride, int64_t rows,
                               int64_t Dv, acc_t eps, acc_t* G) {
  const int64_t E = Dv + 1;
  for (int64_t r = 0; r < rows; ++r) {
    const acc_t inv_den = acc_t(1) / (n[r * E + Dv] + eps);
    const scalar_t* g = dout + r * dout_stride;
    acc_t* Gr = G + r * E;
    for (int64_t c = 0; c < Dv; ++c) Gr[c] = static_cast<acc_t>(g[c]) * inv_den;
    // -(g . out) / den = -(g / den) . n / den
    Gr[Dv] = -at::vec::map2_reduce_all<acc_t>([](Vec x, Vec y) { return x * y; },
                                             [](Vec x, Vec y) { return x + y; }, Gr, n + r * E, Dv) * inv_den;
  }
}

// dst row r = grad[r] * elu'(x_r) = grad[r] * min(phi(x_r), 1) (grad is overwritten with it); zero
// for a padded row. Branch-free: the sign of x is random, a branch per element mispredicts.
template <typename scalar_t, typename acc_t>
void store_input_grad(acc_t* grad, const acc_t* phi, int64_t rows, int64_t width, const bool* padded,
                      scalar_t* dst) {
  using Vec = at::vec::Vectorized<acc_t>;
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* d = dst + r * width;
    if (padded != nullptr && padded[r]) {
      std::fill(d, d + width, scalar_t(0));
      continue;
    }
    acc_t* g = grad + r * width;
    const acc_t* p = phi + r * width;
    int64_t c = 0;
    for (; c + Vec::size() <= width; c += Vec::size()) {
      (Vec::loadu(g + c) * at::vec::minimum(Vec::loadu(p + c), Vec(acc_t(1)))).store(g + c);
    }
    for (; c < width; ++c) g[c] *= std::min(p[c], acc_t(1));
    for (c = 0; c < width; ++c) d[c] = static_cast<scalar_t>(g[c]);
  }
}

// dst row r = src row r (rows x width, row stride ld); zero for a padded row.
template <typename scalar_t, typename acc_t>
void store_value_grad(const acc_t* src, int64_t ld, int64_t rows, int64_t width, const bool* padded, scalar_t* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    scalar_t* d = dst + r * width;
    const bool skip = padded != nullptr && padded[r];
    for (int64_t c = 0; c < width; ++c) d[c] = skip ? scalar_t(0) : static_cast<scalar_t>(src[r * ld + c]);
  }
}

// Zeroes the strictly upper triangle (j > i) of a rows x rows block with row stride ld.
template <typename acc_t>
void keep_lower_triangle(acc_t* a, int64_t rows, int64_t ld) {
  for (int64_t i = 0; i < rows; ++i) std::fill(a + i * ld + i + 1, a + i * ld + rows, acc_t(0));
}

// A state S' (D x E) that sums X^T Y over many rows into a float64 total, from which S' (acc_t)
// is refreshed: each add's product comes from one gemm, but its last column (z = sum_j phi(k_j),
// or the reverse state's g column) is summed apart, in acc_t partials of kColumnRows rows, as
// torch's cascaded sums do. A gemm sums its k-loop sequentially, and z, a sum of positive terms,
// carried that rounding: in float32 as it grew, the final z was 2-6x the error of torch's
// summation from 200 to 20k keys (S, with values of mixed signs, within the rule). Leaving the
// last column out of the gemm also spares its one-column tail (register_tile<6, 1>: 8.7% -> 6.6%
// of a causal forward's profile, the rest in the other E-wide products).
template <typename acc_t>
struct StateSum {
  std::vector<double> total;
  std::vector<acc_t> part;

  // Starts the sum from S' (D x E), as loaded into S.
  void start(const acc_t* S, int64_t D, int64_t E) {
    total.assign(S, S + D * E);
    part.resize(D * E + D);
  }

  // S' += X^T Y for X (rows x D, row stride D) and Y (rows x E, row stride E); S = S' in acc_t.
  void add(const acc_t* X, const acc_t* Y, int64_t rows, int64_t D, int64_t E, acc_t* S) {
    using Vec = at::vec::Vectorized<acc_t>;
    acc_t* column = part.data() + D * E;
    matmul(true, false, D, E - 1, rows, X, D, Y, E, acc_t(0), part.data(), E);  // all but the last column
    for (int64_t r0 = 0; r0 < rows; r0 += kColumnRows) {
      std::fill(column, column + D, acc_t(0));
      for (int64_t r = r0; r < std::min(rows, r0 + kColumnRows); ++r) {
        const Vec y(Y[r * E + E - 1]);
        at::vec::map2([y](Vec c, Vec x) { return at::vec::fmadd(x, y, c); }, column, column, X + r * D, D);
      }
      for (int64_t d = 0; d < D; ++d) total[d * E + E - 1] += static_cast<double>(column[d]);
    }
    for (int64_t d = 0; d < D; ++d) {
      double* t = total.data() + d * E;
      const acc_t* p = part.data() + d * E;
      acc_t* s = S + d * E;
      for (int64_t e = 0; e < E - 1; ++e) {
        t[e] += static_cast<double>(p[e]);
        s[e] = static_cast<acc_t>(t[e]);
      }
      s[E - 1] = static_cast<acc_t>(t[E - 1]);
    }
  }
};

struct Sizes {
  int64_t B, H, Nq, Nk, D, Dv;
};

// What a head's sweep starts from and leaves: the state it starts from (the initial state in the
// forward, the final state's gradient in the reverse sweep) and, where wanted, where the state it
// ends with goes (S, z; nullptr: not wanted).
template <typename acc_t>
struct HeadState {
  const StateHeads<acc_t>& start;
  int64_t b, h;
  acc_t* end_S;
  acc_t* end_z;
};

// The whole non-causal state S' (D x E) += phi(K)^T V' over all keys, chunk by chunk (Kc, Vc:
// chunk buffers; padded keys load as zeros).
template <typename scalar_t, typename acc_t>
void accumulate_state(const Sizes& s, const scalar_t* k, int64_t sk, const scalar_t* v, int64_t sv,
                      const bool* padded, acc_t* Kc, acc_t* Vc, acc_t* S, StateSum<acc_t>& sum) {
  const int64_t D = s.D, Dv = s.Dv, E = Dv + 1, C = kChunk;
  sum.start(S, D, E);
  for (int64_t j0 = 0; j0 < s.Nk; j0 += C) {
    const int64_t rows = std::min(C, s.Nk - j0);
    const bool* pad = padded ? padded + j0 : nullptr;
    load_rows(k + j0 * sk, sk, rows, D, pad, true, false, Kc, D);
    load_rows(v + j0 * sv, sv, rows, Dv, pad, false, true, Vc, E);
    sum.add(Kc, Vc, rows, D, E, S);  // S' += phi(K)^T V'
  }
}

template <typename scalar_t, typename acc_t>
void forward_head(const Sizes& s, const scalar_t* q, int64_t sq, const scalar_t* k, int64_t sk, const scalar_t* v,
                  int64_t sv, const bool* padded, bool is_causal, acc_t eps, scalar_t* out, const HeadState<acc_t>& st,
                  std::vector<acc_t>& ws, StateSum<acc_t>& sum) {
  const int64_t D = s.D, Dv = s.Dv, E = Dv + 1;
  const int64_t C = is_causal ? kCausalChunk : kChunk;
  ws.resize(2 * C * D + 2 * C * E + C * C + D * E);
  acc_t* Qc = ws.data();
  acc_t* Kc = Qc + C * D;
  acc_t* Vc = Kc + C * D;
  acc_t* Nc = Vc + C * E;
  acc_t* A = Nc + C * E;
  acc_t* S = A + C * C;
  st.start.load(st.b, st.h, D, Dv, S);
  if (!is_causal) {
    accumulate_state(s, k, sk, v, sv, padded, Kc, Vc, S, sum);
    if (st.end_S != nullptr) store_state(S, D, Dv, st.end_S, st.end_z);
    for (int64_t i0 = 0; i0 < s.Nq; i0 += C) {
      const int64_t rows = std::min(C, s.Nq - i0);
      load_rows(q + i0 * sq, sq, rows, D, static_cast<const bool*>(nullptr), true, false, Qc, D);
      matmul(false, false, rows, E, D, Qc, D, S, E, acc_t(0), Nc, E);  // n' = phi(Q) S'
      store_normalized(Nc, rows, Dv, eps, out + i0 * Dv);
    }
    return;
  }
  sum.start(S, D, E);
  for (int64_t i0 = 0; i0 < s.Nq; i0 += C) {
    const int64_t rows = std::min(C, s.Nq - i0);
    const bool* pad = padded ? padded + i0 : nullptr;
    load_rows(q + i0 * sq, sq, rows, D, static_cast<const bool*>(nullptr), true, false, Qc, D);
    load_rows(k + i0 * sk, sk, rows, D, pad, true, false, Kc, D);
    load_rows(v + i0 * sv, sv, rows, Dv, pad, false, true, Vc, E);
    matmul(false, true, rows, rows, D, Qc, D, Kc, D, acc_t(0), A, C);  // A = phi(Q_c) phi(K_c)^T
    keep_lower_triangle(A, rows, C);
    matmul(false, false, rows, E, rows, A, C, Vc, E, acc_t(0), Nc, E);  // n' = A V'_c
    matmul(false, false, rows, E, D, Qc, D, S, E, acc_t(1), Nc, E);     //    + phi(Q_c) S'
    store_normalized(Nc, rows, Dv, eps, out + i0 * Dv);
    sum.add(Kc, Vc, rows, D, E, S);                                     // S' += phi(K_c)^T V'_c
  }
  if (st.end_S != nullptr) store_state(S, D, Dv, st.end_S, st.end_z);
}

template <typename scalar_t, typename acc_t>
void backward_head_noncausal(const Sizes& s, const scalar_t* dout, int64_t sg, const scalar_t* q, int64_t sq,
                             const scalar_t* k, int64_t sk, const scalar_t* v, int64_t sv, const bool* padded,
                             acc_t eps, scalar_t* dq, scalar_t* dk, scalar_t* dv, const HeadState<acc_t>& initial,
                             const HeadState<acc_t>& reverse, std::vector<acc_t>& ws, StateSum<acc_t>& sum) {
  const int64_t D = s.D, Dv = s.Dv, E = Dv + 1, C = kChunk;
  ws.resize(2 * C * D + 2 * C * E + 2 * D * E);
  acc_t* X = ws.data();      // phi(Q) or phi(K) block
  acc_t* dX = X + C * D;     // its gradient
  acc_t* Y = dX + C * D;     // V' block, or G'
  acc_t* Nc = Y + C * E;     // n', or dv block
  acc_t* S = Nc + C * E;
  acc_t* R = S + D * E;
  initial.start.load(initial.b, initial.h, D, Dv, S);
  reverse.start.load(reverse.b, reverse.h, D, Dv, R);
  accumulate_state(s, k, sk, v, sv, padded, X, Y, S, sum);
  sum.start(R, D, E);
  for (int64_t i0 = 0; i0 < s.Nq; i0 += C) {
    const int64_t rows = std::min(C, s.Nq - i0);
    load_rows(q + i0 * sq, sq, rows, D, static_cast<const bool*>(nullptr), true, false, X, D);
    matmul(false, false, rows, E, D, X, D, S, E, acc_t(0), Nc, E);  // n' = phi(Q) S'
    gradient_of_normalization(Nc, dout + i0 * sg, sg, rows, Dv, eps, Y);
    matmul(false, true, rows, D, E, Y, E, S, E, acc_t(0), dX, D);   // d phi(Q) = G' S'^T
    store_input_grad(dX, X, rows, D, static_cast<const bool*>(nullptr), dq + i0 * D);
    sum.add(X, Y, rows, D, E, R);                                   // R' += phi(Q)^T G'
  }
  if (reverse.end_S != nullptr) store_state(R, D, Dv, reverse.end_S, reverse.end_z);  // dS'0 = R'
  for (int64_t j0 = 0; j0 < s.Nk; j0 += C) {
    const int64_t rows = std::min(C, s.Nk - j0);
    const bool* pad = padded ? padded + j0 : nullptr;
    load_rows(k + j0 * sk, sk, rows, D, pad, true, false, X, D);
    load_rows(v + j0 * sv, sv, rows, Dv, pad, false, true, Y, E);
    matmul(false, true, rows, D, E, Y, E, R, E, acc_t(0), dX, D);   // d phi(K) = V' R'^T
    store_input_grad(dX, X, rows, D, pad, dk + j0 * D);
    matmul(false, false, rows, Dv, D, X, D, R, E, acc_t(0), Nc, Dv);  // dv = phi(K) R
    store_value_grad(Nc, Dv, rows, Dv, pad, dv + j0 * Dv);
  }
}

template <typename scalar_t, typename acc_t>
void backward_head_causal(const Sizes& s, const scalar_t* dout, int64_t sg, const scalar_t* q, int64_t sq,
                          const scalar_t* k, int64_t sk, const scalar_t* v, int64_t sv, const bool* padded,
                          acc_t eps, scalar_t* dq, scalar_t* dk, scalar_t* dv, const HeadState<acc_t>& initial,
                          const HeadState<acc_t>& reverse, std::vector<acc_t>& ws, StateSum<acc_t>& sum) {
  const int64_t N = s.Nq, D = s.D, Dv = s.Dv, E = Dv + 1, C = kCausalChunk;
  // Whole-sequence buffers (linear in N): phi(Q), phi(K), V', G', d phi(K), dv; then per-chunk scratch.
  ws.resize(3 * N * D + 2 * N * E + N * Dv + 2 * C * C + C * E + C * D + D * E);
  acc_t* Q = ws.data();
  acc_t* K = Q + N * D;
  acc_t* V = K + N * D;
  acc_t* G = V + N * E;
  acc_t* dK = G + N * E;
  acc_t* dV = dK + N * D;
  acc_t* A = dV + N * Dv;
  acc_t* dW = A + C * C;
  acc_t* Nc = dW + C * C;
  acc_t* dQc = Nc + C * E;
  acc_t* S = dQc + C * D;  // S' in the forward sweep, R' in the reverse one
  load_rows(q, sq, N, D, static_cast<const bool*>(nullptr), true, false, Q, D);
  load_rows(k, sk, N, D, padded, true, false, K, D);
  load_rows(v, sv, N, Dv, padded, false, true, V, E);
  initial.start.load(initial.b, initial.h, D, Dv, S);
  sum.start(S, D, E);
  for (int64_t i0 = 0; i0 < N; i0 += C) {
    const int64_t rows = std::min(C, N - i0);
    const acc_t* Qc = Q + i0 * D;
    const acc_t* Kc = K + i0 * D;
    const acc_t* Vc = V + i0 * E;
    acc_t* Gc = G + i0 * E;
    matmul(false, true, rows, rows, D, Qc, D, Kc, D, acc_t(0), A, C);  // A = phi(Q_c) phi(K_c)^T
    keep_lower_triangle(A, rows, C);
    matmul(false, false, rows, E, rows, A, C, Vc, E, acc_t(0), Nc, E);  // n' = A V'_c + phi(Q_c) S'
    matmul(false, false, rows, E, D, Qc, D, S, E, acc_t(1), Nc, E);
    gradient_of_normalization(Nc, dout + i0 * sg, sg, rows, Dv, eps, Gc);
    matmul(false, true, rows, rows, E, Gc, E, Vc, E, acc_t(0), dW, C);  // dW = G'_c V'_c^T
    keep_lower_triangle(dW, rows, C);
    matmul(false, false, rows, D, rows, dW, C, Kc, D, acc_t(0), dQc, D);  // d phi(Q_c) = dW phi(K_c)
    matmul(false, true, rows, D, E, Gc, E, S, E, acc_t(1), dQc, D);       //   + G'_c S'^T
    store_input_grad(dQc, Qc, rows, D, static_cast<const bool*>(nullptr), dq + i0 * D);
    matmul(true, false, rows, D, rows, dW, C, Qc, D, acc_t(0), dK + i0 * D, D);   // d phi(K_c) = dW^T phi(Q_c)
    matmul(true, false, rows, Dv, rows, A, C, Gc, E, acc_t(0), dV + i0 * Dv, Dv);  // dv_c = A^T G'_c
    sum.add(Kc, Vc, rows, D, E, S);  // S' += phi(K_c)^T V'_c
  }
  acc_t* R = S;
  reverse.start.load(reverse.b, reverse.h, D, Dv, R);
  sum.start(R, D, E);
  for (int64_t i0 = N > 0 ? ((N - 1) / C) * C : -1; i0 >= 0; i0 -= C) {
    const int64_t rows = std::min(C, N - i0);
    matmul(false, true, rows, D, E, V + i0 * E, E, R, E, acc_t(1), dK + i0 * D, D);    // d phi(K_c) += V'_c R'^T
    matmul(false, false, rows, Dv, D, K + i0 * D, D, R, E, acc_t(1), dV + i0 * Dv, Dv);  // dv_c += phi(K_c) R
    sum.add(Q + i0 * D, G + i0 * E, rows, D, E, R);                                   // R' += phi(Q_c)^T G'_c
  }
  if (reverse.end_S != nullptr) store_state(R, D, Dv, reverse.end_S, reverse.end_z);  // dS'0 = R'
  store_input_grad(dK, K, N, D, padded, dk);
  store_value_grad(dV, Dv, N, Dv, padded, dv);
}

// Shapes, dtypes and layouts the kernels rely on; the public function has already checked the
// user's arguments, so these guard direct calls of the extension.
void check_inputs(const char* fn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const std::optional<at::Tensor>& key_padding_mask, bool is_causal) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, fn, ": q, k, v must be (B, H, N, D), got ",
              q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), fn, ": CPU tensors only");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), fn,
              ": q, k, v must share a dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == q.size(1) && v.size(1) == q.size(1) &&
                  k.size(3) == q.size(3) && v.size(2) == k.size(2),
              fn, ": inconsistent shapes q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(!is_causal || q.size(2) == k.size(2), fn, ": causal needs equal query and key lengths, got ",
              q.size(2), " and ", k.size(2));
  if (key_padding_mask.has_value()) {
    const at::Tensor& m = *key_padding_mask;
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 2 && m.size(0) == q.size(0) && m.size(1) == k.size(2), fn,
                ": key_padding_mask must be a bool (B, Nk) = (", q.size(0), ", ", k.size(2), ") tensor, got ",
                m.scalar_type(), " ", m.sizes());
  }
}

// The state's dtype: float32, float64 for float64 inputs.
at::ScalarType state_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// A state tensor (S: (B, H, D, Dv), z: (B, H, D)) in the state's dtype on the CPU; an undefined
// tensor where absent.
at::Tensor checked_state(const char* fn, const char* name, const std::optional<at::Tensor>& t,
                         at::IntArrayRef shape, at::ScalarType dtype) {
  if (!t.has_value()) return at::Tensor();
  TORCH_CHECK(t->sizes() == shape && t->scalar_type() == dtype && t->device().is_cpu(), fn, ": ", name,
              " must be a ", dtype, " CPU tensor of shape ", shape, ", got ", t->scalar_type(), " ", t->device(), " ",
              t->sizes());
  return *t;
}

// A view with a unit last-dim stride (a copy only if the last dim is strided).
at::Tensor unit_last_stride(const at::Tensor& t) {
  return (t.size(-1) <= 1 || t.stride(-1) == 1) ? t : t.contiguous();
}

template <typename scalar_t>
using acc_type_for = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> linear_attention_forward(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double eps,
    const std::optional<at::Tensor>& initial_S, const std::optional<at::Tensor>& initial_z, bool output_final_state) {
  constexpr const char* fn = "linear_attention_forward";
  check_inputs(fn, q_in, k_in, v_in, key_padding_mask, is_causal);
  TORCH_CHECK(initial_S.has_value() == initial_z.has_value(), fn, ": initial_S and initial_z come together");
  const at::Tensor q = unit_last_stride(q_in), k = unit_last_stride(k_in), v = unit_last_stride(v_in);
  const Sizes s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  const auto state_options = q.options().dtype(state_dtype(q));
  const at::Tensor S0 = checked_state(fn, "initial_S", initial_S, {s.B, s.H, s.D, s.Dv}, state_dtype(q));
  const at::Tensor z0 = checked_state(fn, "initial_z", initial_z, {s.B, s.H, s.D}, state_dtype(q));
  at::Tensor out = new_output({s.B, s.H, s.Nq, s.Dv}, q.options());
  at::Tensor final_S = output_final_state ? new_output({s.B, s.H, s.D, s.Dv}, state_options)
                                          : new_tensor({0}, state_options);
  at::Tensor final_z = output_final_state ? new_output({s.B, s.H, s.D}, state_options) : new_tensor({0}, state_options);
  if (s.B * s.H == 0) return {out, final_S, final_z};
  const at::Tensor mask = key_padding_mask.has_value() ? key_padding_mask->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "linear_attention_forward", [&] {
    using acc_t = acc_type_for<scalar_t>;
    const Heads<scalar_t> qh(q), kh(k), vh(v);
    const StateHeads<acc_t> start(S0, z0);
    const bool* mask_ptr = mask.defined() ? mask.const_data_ptr<bool>() : nullptr;
    scalar_t* out_ptr = out.mutable_data_ptr<scalar_t>();
    acc_t* S_ptr = output_final_state ? final_S.mutable_data_ptr<acc_t>() : nullptr;
    acc_t* z_ptr = output_final_state ? final_z.mutable_data_ptr<acc_t>() : nullptr;
    at::parallel_for(0, s.B * s.H, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> ws;
      StateSum<acc_t> sum;
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / s.H, h = bh % s.H;
        const HeadState<acc_t> st{start, b, h, S_ptr ? S_ptr + bh * s.D * s.Dv : nullptr,
                                  z_ptr ? z_ptr + bh * s.D : nullptr};
        forward_head<scalar_t, acc_t>(s, qh.head(b, h), qh.stride_n, kh.head(b, h), kh.stride_n, vh.head(b, h),
                                      vh.stride_n, mask_ptr ? mask_ptr + b * s.Nk : nullptr, is_causal,
                                      static_cast<acc_t>(eps), out_ptr + bh * s.Nq * s.Dv, st, ws, sum);
      }
    });
  });
  return {out, final_S, final_z};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> linear_attention_backward(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double eps,
    const std::optional<at::Tensor>& initial_S, const std::optional<at::Tensor>& initial_z,
    const std::optional<at::Tensor>& grad_final_S, const std::optional<at::Tensor>& grad_final_z) {
  constexpr const char* fn = "linear_attention_backward";
  check_inputs(fn, q_in, k_in, v_in, key_padding_mask, is_causal);
  TORCH_CHECK(dout_in.dim() == 4 && dout_in.size(0) == q_in.size(0) && dout_in.size(1) == q_in.size(1) &&
                  dout_in.size(2) == q_in.size(2) && dout_in.size(3) == v_in.size(3),
              "linear_attention_backward: dout must be (B, H, Nq, Dv), got ", dout_in.sizes());
  TORCH_CHECK(initial_S.has_value() == initial_z.has_value(), fn, ": initial_S and initial_z come together");
  const at::Tensor q = unit_last_stride(q_in), k = unit_last_stride(k_in), v = unit_last_stride(v_in);
  const at::Tensor dout = unit_last_stride(dout_in.to(q.scalar_type()));
  const Sizes s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  const auto dtype = state_dtype(q);
  const at::Tensor S0 = checked_state(fn, "initial_S", initial_S, {s.B, s.H, s.D, s.Dv}, dtype);
  const at::Tensor z0 = checked_state(fn, "initial_z", initial_z, {s.B, s.H, s.D}, dtype);
  const at::Tensor dS_final = checked_state(fn, "grad_final_S", grad_final_S, {s.B, s.H, s.D, s.Dv}, dtype);
  const at::Tensor dz_final = checked_state(fn, "grad_final_z", grad_final_z, {s.B, s.H, s.D}, dtype);
  const bool has_initial = initial_S.has_value();
  const auto state_options = q.options().dtype(dtype);
  at::Tensor dq = new_output(q.sizes(), q.options());
  at::Tensor dk = new_output(k.sizes(), k.options());
  at::Tensor dv = new_output(v.sizes(), v.options());
  at::Tensor dS0 = has_initial ? new_output({s.B, s.H, s.D, s.Dv}, state_options) : new_tensor({0}, state_options);
  at::Tensor dz0 = has_initial ? new_output({s.B, s.H, s.D}, state_options) : new_tensor({0}, state_options);
  if (s.B * s.H == 0) return {dq, dk, dv, dS0, dz0};
  const at::Tensor mask = key_padding_mask.has_value() ? key_padding_mask->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "linear_attention_backward", [&] {
    using acc_t = acc_type_for<scalar_t>;
    const Heads<scalar_t> gh(dout), qh(q), kh(k), vh(v);
    const StateHeads<acc_t> forward_start(S0, z0), reverse_start(dS_final, dz_final);
    const bool* mask_ptr = mask.defined() ? mask.const_data_ptr<bool>() : nullptr;
    scalar_t* dq_ptr = dq.mutable_data_ptr<scalar_t>();
    scalar_t* dk_ptr = dk.mutable_data_ptr<scalar_t>();
    scalar_t* dv_ptr = dv.mutable_data_ptr<scalar_t>();
    acc_t* dS0_ptr = has_initial ? dS0.mutable_data_ptr<acc_t>() : nullptr;
    acc_t* dz0_ptr = has_initial ? dz0.mutable_data_ptr<acc_t>() : nullptr;
    at::parallel_for(0, s.B * s.H, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> ws;
      StateSum<acc_t> sum;
      for (int64_t bh = begin; bh < end; ++bh) {
        const int64_t b = bh / s.H, h = bh % s.H;
        const HeadState<acc_t> initial{forward_start, b, h, nullptr, nullptr};
        const HeadState<acc_t> reverse{reverse_start, b, h, dS0_ptr ? dS0_ptr + bh * s.D * s.Dv : nullptr,
                                       dz0_ptr ? dz0_ptr + bh * s.D : nullptr};
        const auto kernel = is_causal ? backward_head_causal<scalar_t, acc_t> : backward_head_noncausal<scalar_t, acc_t>;
        kernel(s, gh.head(b, h), gh.stride_n, qh.head(b, h), qh.stride_n, kh.head(b, h), kh.stride_n, vh.head(b, h),
               vh.stride_n, mask_ptr ? mask_ptr + b * s.Nk : nullptr, static_cast<acc_t>(eps),
               dq_ptr + bh * s.Nq * s.D, dk_ptr + bh * s.Nk * s.D, dv_ptr + bh * s.Nk * s.Dv, initial, reverse, ws,
               sum);
      }
    });
  });
  return {dq, dk, dv, dS0, dz0};
}

}  // namespace transformer_fast

namespace transformer_fast {

TORCH_LIBRARY_IMPL(transformer_fast, CPU, m) {
  m.impl("linear_attention_forward", &linear_attention_forward);
  m.impl("linear_attention_backward", &linear_attention_backward);
}

}  // namespace transformer_fast
