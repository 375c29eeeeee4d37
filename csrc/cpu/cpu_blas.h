// Tile products on the CPU, shared by the kernel families.
//
// ATen's cpublas::gemm is not exported to extensions, so the BLAS that libtorch_cpu ships and
// exports (MKL on x86-64 wheels: sgemm_, dgemm_, cblas_gemm_bf16bf16f32, which is what
// cpublas::gemm calls inside PyTorch) is looked up at load time; where a symbol is missing the
// product goes through at::addmm_ on tensor views instead (slower: per-call overhead).
// TRANSFORMER_FAST_ATEN_GEMM=1 forces that fallback (for debugging). On AVX-512 CPUs, fp32
// products of 16 rows and columns or more are made here instead, in registers (register_gemm).
#pragma once

#include "cpu/cpu_capability.h"  // before any ATen header: at::vec's ISA

#include <ATen/ATen.h>

#include <ATen/cpu/Utils.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <dlfcn.h>
#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

namespace transformer_fast {
namespace cpu_blas {

template <typename T>
using fortran_gemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const T*, const T*,
                                 const int*, const T*, const int*, const T*, T*, const int*);
using bf16_gemm_fn = void (*)(int, int, int, int, int, int, float, const uint16_t*, int, const uint16_t*, int, float,
                              float*, int);
using mkl_set_num_threads_local_fn = int (*)(int);

struct Library {
  fortran_gemm_fn<float> sgemm = nullptr;
  fortran_gemm_fn<double> dgemm = nullptr;
  bf16_gemm_fn gemm_bf16bf16f32 = nullptr;
  mkl_set_num_threads_local_fn mkl_set_num_threads_local = nullptr;
  Library() {
    if (std::getenv("TRANSFORMER_FAST_ATEN_GEMM") != nullptr) return;
    sgemm = reinterpret_cast<fortran_gemm_fn<float>>(dlsym(RTLD_DEFAULT, "sgemm_"));
    dgemm = reinterpret_cast<fortran_gemm_fn<double>>(dlsym(RTLD_DEFAULT, "dgemm_"));
    gemm_bf16bf16f32 = reinterpret_cast<bf16_gemm_fn>(dlsym(RTLD_DEFAULT, "cblas_gemm_bf16bf16f32"));
    mkl_set_num_threads_local =
        reinterpret_cast<mkl_set_num_threads_local_fn>(dlsym(RTLD_DEFAULT, "MKL_Set_Num_Threads_Local"));
  }
};

inline const Library& library() {
  static const Library instance;
  return instance;
}

// Tells MKL, for the lifetime of the guard, that the calling thread runs its products alone.
// Inside at::parallel_for, MKL otherwise plans for the process's thread count and takes its
// copy-based sgemm path (packs both operands on every call); told 1 thread, it uses its
// no-copy kernels on tile sizes.
struct SerialGuard {
  mkl_set_num_threads_local_fn set_local = library().mkl_set_num_threads_local;
  int previous = set_local != nullptr ? set_local(1) : 0;
  SerialGuard() = default;
  ~SerialGuard() {
    if (set_local != nullptr) set_local(previous);  // 0 = back to the global setting
  }
  SerialGuard(const SerialGuard&) = delete;
  SerialGuard& operator=(const SerialGuard&) = delete;
};

// A row-major (rows x cols) matrix with leading dimension ld, optionally used transposed.
template <typename T>
at::Tensor as_matrix(const T* data, int64_t rows, int64_t cols, int64_t ld, bool trans) {
  at::Tensor t = at::from_blob(const_cast<T*>(data), {trans ? cols : rows, trans ? rows : cols}, {ld, 1},
                               at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value));
  return trans ? t.t() : t;
}

// Row-major C (M x N) = alpha * op(A) op(B) + beta * C, where op(A) is M x K and op(B) is K x N
// (a transposed operand is stored as its transpose); beta = 0 ignores C's contents. C is float
// for float/bf16/fp16 operands, double for double ones.
template <typename T>
using accumulate_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// fp32 products with one or two rows of C (a single key's dV row, a single query's output or dQ
// row) are made here: MKL takes its gemv path there, which adds the K products of each element
// one after another, so the error grows like K (and the tiles and heads accumulated on top
// through beta = 1 make K their total). Here each element is a sum of chunks of kChunk products
// (each chunk summed in registers, then added to the element's total), so the error grows like
// kChunk + K / kChunk. A single key's dV went from up to 3-4x the float64 reference's error to
// below it (fuzzing; docs/design.md).
constexpr int64_t kChunk = 16;

inline void few_rows_gemm(bool trans_a, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t kRows = 2, kVecs = 4, kWidth = kVecs * Vec::size();  // 2 x 64 outputs in registers
  const auto a_at = [&](int64_t r, int64_t t) { return trans_a ? A[t * lda + r] : A[r * lda + t]; };
  for (int64_t c0 = 0; c0 < N; c0 += kWidth) {
    int64_t count[kVecs];  // valid lanes of each vector of this strip
    for (int64_t v = 0; v < kVecs; ++v) count[v] = std::clamp<int64_t>(N - c0 - v * Vec::size(), 0, Vec::size());
    Vec total[kRows][kVecs];
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t v = 0; v < kVecs; ++v) total[r][v] = Vec(0.f);
    }
    for (int64_t t0 = 0; t0 < K; t0 += kChunk) {
      Vec chunk[kRows][kVecs];
      for (int64_t r = 0; r < kRows; ++r) {
        for (int64_t v = 0; v < kVecs; ++v) chunk[r][v] = Vec(0.f);
      }
      for (int64_t t = t0; t < std::min(K, t0 + kChunk); ++t) {
        const float* b = B + t * ldb + c0;
        const Vec a0(a_at(0, t)), a1(M > 1 ? a_at(1, t) : 0.f);
        for (int64_t v = 0; v < kVecs; ++v) {
          if (count[v] == 0) continue;
          const Vec bv = count[v] == Vec::size() ? Vec::loadu(b + v * Vec::size())
                                                 : Vec::loadu(b + v * Vec::size(), count[v]);
          chunk[0][v] = at::vec::fmadd(a0, bv, chunk[0][v]);
          chunk[1][v] = at::vec::fmadd(a1, bv, chunk[1][v]);
        }
      }
      for (int64_t r = 0; r < kRows; ++r) {
        for (int64_t v = 0; v < kVecs; ++v) total[r][v] = total[r][v] + chunk[r][v];
      }
    }
    for (int64_t r = 0; r < M; ++r) {
      for (int64_t v = 0; v < kVecs; ++v) {
        if (count[v] == 0) continue;
        float* out = C + r * ldc + c0 + v * Vec::size();
        Vec result = total[r][v] * Vec(alpha);
        if (beta != 0.f) result = at::vec::fmadd(Vec(beta), Vec::loadu(out, count[v]), result);
        result.store(out, count[v]);
      }
    }
  }
}

// Products with fewer rows or columns than this stay with MKL, which makes them as dot products
// (partial sums across vector lanes): more accurate than one FMA chain per element, e.g. a
// 2 x 64 x 256 product's error 4.5e-6 against 1.2e-5 (docs/design.md), and the fp32
// reference makes them the same way.
constexpr int64_t kRegisterMinDim = 16;
inline bool register_tiles_suit(int64_t M, int64_t N) { return M >= kRegisterMinDim && N >= kRegisterMinDim; }

#if defined(CPU_CAPABILITY_AVX512)
// fp32 products in registers (AVX-512): C = alpha * op(A) B (+ C), B row-major. A strip of 64
// columns of C is made 6 rows at a time: 24 vector accumulators; per step of k, 4 vectors of B's
// row k and 6 broadcast elements of A's column k feed 24 FMAs, so the FMA ports, not the loads,
// set the pace. A is read one element at a time, a(i, k) = A[i * a_row + k * a_col], so op(A) may
// be A or A^T at no cost, and neither operand is packed. MKL packs operands on every call, which
// cost it 15-20% on the attention's NN and TN tile products (128 x 512 x 64 and its transposes;
// docs/design.md). Every element of C is one chain of FMAs over k in order, added to C
// every kRegisterChunk steps: the same rounding whatever the shape of the call, so a score
// computed in the forward's tiles equals the backward's. (Shorter chunks cost speed: 32 made
// forward+backward 5% slower, 16 made it 16% slower.)
constexpr int64_t kRegisterRows = 6, kRegisterVecs = 4, kRegisterChunk = 128;

template <int MR, int NV>
inline void register_tile(int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B, int64_t ldb,
                          float alpha, bool accumulate, float* C, int64_t ldc, __mmask16 last_lanes) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    __m512 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      b[v] = v == NV - 1 ? _mm512_maskz_loadu_ps(last_lanes, B + k * ldb + 16 * v) : _mm512_loadu_ps(B + k * ldb + 16 * v);
    }
    const float* a = A + k * a_col;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 ai = _mm512_set1_ps(a[i * a_row]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(ai, b[v], acc[i][v]);
    }
  }
  const __m512 valpha = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* c = C + i * ldc + 16 * v;
      const __mmask16 lanes = v == NV - 1 ? last_lanes : static_cast<__mmask16>(0xFFFF);
      __m512 result = _mm512_mul_ps(acc[i][v], valpha);
      if (accumulate) result = _mm512_add_ps(result, _mm512_maskz_loadu_ps(lanes, c));
      _mm512_mask_storeu_ps(c, lanes, result);
    }
  }
}

template <int NV>
void register_tile_strip(int64_t M, int64_t K, const float* A, int64_t a_row, int64_t a_col, const float* B,
                         int64_t ldb, float alpha, bool accumulate, float* C, int64_t ldc, __mmask16 last_lanes) {
  constexpr int MR = kRegisterRows;
  int64_t i = 0;
  for (; i + MR <= M; i += MR) {
    register_tile<MR, NV>(K, A + i * a_row, a_row, a_col, B, ldb, alpha, accumulate, C + i * ldc, ldc, last_lanes);
  }
  const float* a = A + i * a_row;
  float* c = C + i * ldc;
  switch (M - i) {
    case 5: return register_tile<5, NV>(K, a, a_row, a_col, B, ldb, alpha, accumulate, c, ldc, last_lanes);
    case 4: return register_tile<4, NV>(K, a, a_row, a_col, B, ldb, alpha, accumulate, c, ldc, last_lanes);
    case 3: return register_tile<3, NV>(K, a, a_row, a_col, B, ldb, alpha, accumulate, c, ldc, last_lanes);
    case 2: return register_tile<2, NV>(K, a, a_row, a_col, B, ldb, alpha, accumulate, c, ldc, last_lanes);
    case 1: return register_tile<1, NV>(K, a, a_row, a_col, B, ldb, alpha, accumulate, c, ldc, last_lanes);
    default: return;
  }
}

inline void register_gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t a_row, int64_t a_col,
                          const float* B, int64_t ldb, bool accumulate, float* C, int64_t ldc) {
  constexpr int64_t kWidth = kRegisterVecs * 16;
  for (int64_t k0 = 0; k0 < K; k0 += kRegisterChunk) {
    const int64_t chunk = std::min(kRegisterChunk, K - k0);
    const bool add = accumulate || k0 > 0;
    for (int64_t j = 0; j < N; j += kWidth) {
      const int64_t width = std::min(kWidth, N - j), vecs = (width + 15) / 16;
      const __mmask16 last_lanes = static_cast<__mmask16>((1u << (width - 16 * (vecs - 1))) - 1);
      const float* a = A + k0 * a_col;
      const float* b = B + k0 * ldb + j;
      switch (vecs) {
        case 4: register_tile_strip<4>(M, chunk, a, a_row, a_col, b, ldb, alpha, add, C + j, ldc, last_lanes); break;
        case 3: register_tile_strip<3>(M, chunk, a, a_row, a_col, b, ldb, alpha, add, C + j, ldc, last_lanes); break;
        case 2: register_tile_strip<2>(M, chunk, a, a_row, a_col, b, ldb, alpha, add, C + j, ldc, last_lanes); break;
        default: register_tile_strip<1>(M, chunk, a, a_row, a_col, b, ldb, alpha, add, C + j, ldc, last_lanes); break;
      }
    }
  }
}
#endif

// A BLAS (and brgemm) wants each stored row of an operand to start at least a row length after
// the previous one: ld >= max(1, row length). Views torch allows break that: an expanded tensor
// (stride 0), overlapping windows (unfold, as_strided) give a row stride below the row length,
// and MKL then prints "Parameter N was incorrect" and skips the product. Such an operand is
// copied, rows x cols with ld = cols, into one of the calling thread's two scratch buffers (slot
// 0 for A, 1 for B: a product may need both), which the BLAS then reads. Valid strides copy
// nothing.
inline bool blas_takes(int64_t ld, int64_t row_length) { return ld >= std::max<int64_t>(1, row_length); }

template <typename T>
const T* compact_rows(const T* src, int64_t ld, int64_t rows, int64_t cols, int slot) {
  thread_local std::vector<T> scratch[2];
  std::vector<T>& buffer = scratch[slot];
  if (static_cast<int64_t>(buffer.size()) < rows * cols) buffer.resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(buffer.data() + r * cols, src + r * ld, cols * sizeof(T));
  return buffer.data();
}

// Whether this CPU multiplies T = bf16 (fp16) operands in hardware: AVX512-BF16 or AMX-BF16
// (AVX512-FP16 or AMX-FP16). Without it, MKL's bf16 gemm converts both operands to fp32 and packs
// them on every call, and torch's fp16 mm allocates converted copies (a bf16 forward on an AVX2
// AMD EPYC: 8% of its samples in MKL's conversion and 8% in its packing copies). There the
// operands are converted into the calling thread's fp32 scratch instead and multiplied by sgemm,
// which under SerialGuard copies nothing: the same fp32 products of the same values.
// TRANSFORMER_FAST_LOWP_GEMM=native or =float overrides the CPU's answer (read once per process).
template <typename T>
bool native_lowp_products() {
  static const bool native = [] {
    const char* env = std::getenv("TRANSFORMER_FAST_LOWP_GEMM");
    if (env != nullptr && (std::strcmp(env, "native") == 0 || std::strcmp(env, "float") == 0)) {
      return std::strcmp(env, "native") == 0;
    }
    const auto caps = at::cpu::get_cpu_capabilities();
    const auto has = [&caps](const char* name) {
      const auto it = caps.find(name);
      return it != caps.end() && it->second.isBool() && it->second.toBool();
    };
    return std::is_same_v<T, at::BFloat16> ? has("avx512_bf16") || has("amx_bf16")
                                           : has("avx512_fp16") || has("amx_fp16");
  }();
  return native;
}

// The (rows x cols) matrix src (leading dimension ld) as fp32 in the calling thread's scratch
// (slot 0 for A, 1 for B), with leading dimension cols.
template <typename T>
const float* rows_to_float(const T* src, int64_t ld, int64_t rows, int64_t cols, int slot) {
  thread_local std::vector<float> scratch[2];
  std::vector<float>& buffer = scratch[slot];
  if (static_cast<int64_t>(buffer.size()) < rows * cols) buffer.resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r) at::vec::convert(src + r * ld, buffer.data() + r * cols, cols);
  return buffer.data();
}

template <typename T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, accumulate_t<T> alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, accumulate_t<T> beta, accumulate_t<T>* C, int64_t ldc) {
  using acc_t = accumulate_t<T>;
  if (M == 0 || N == 0) return;
  if constexpr (std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>) {
    if (K > 0 && !native_lowp_products<T>()) {
      const int64_t a_rows = trans_a ? K : M, a_cols = trans_a ? M : K;
      const int64_t b_rows = trans_b ? N : K, b_cols = trans_b ? K : N;
      gemm<float>(trans_a, trans_b, M, N, K, alpha, rows_to_float(A, lda, a_rows, a_cols, 0), a_cols,
                  rows_to_float(B, ldb, b_rows, b_cols, 1), b_cols, beta, C, ldc);
      return;
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    if (M <= 2 && !trans_b && K > kChunk) {
      few_rows_gemm(trans_a, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
      return;
    }
#if defined(CPU_CAPABILITY_AVX512)
    if (!trans_b && K > 0 && (beta == 0.f || beta == 1.f) && register_tiles_suit(M, N)) {
      register_gemm(M, N, K, alpha, A, trans_a ? 1 : lda, trans_a ? lda : 1, B, ldb, beta == 1.f, C, ldc);
      return;
    }
#endif
  }
  if (K == 0) {
    for (int64_t r = 0; r < M; ++r) {
      for (int64_t c = 0; c < N; ++c) C[r * ldc + c] = beta == acc_t(0) ? acc_t(0) : beta * C[r * ldc + c];
    }
    return;
  }
  // The stride of a matrix stored as a single row is arbitrary; BLAS wants ld >= the row length.
  if ((trans_a ? K : M) == 1) lda = trans_a ? M : K;
  if ((trans_b ? N : K) == 1) ldb = trans_b ? K : N;
  if (M == 1) ldc = N;
  if (!blas_takes(lda, trans_a ? M : K)) {
    A = compact_rows(A, lda, trans_a ? K : M, trans_a ? M : K, 0);
    lda = trans_a ? M : K;
  }
  if (!blas_takes(ldb, trans_b ? K : N)) {
    B = compact_rows(B, ldb, trans_b ? N : K, trans_b ? K : N, 1);
    ldb = trans_b ? K : N;
  }
  const Library& lib = library();
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    const fortran_gemm_fn<T> fn = std::is_same_v<T, float> ? reinterpret_cast<fortran_gemm_fn<T>>(lib.sgemm)
                                                           : reinterpret_cast<fortran_gemm_fn<T>>(lib.dgemm);
    if (fn != nullptr) {
      // column-major: C^T (N x M) = op(B)^T op(A)^T
      const int m = N, n = M, k = K, ia = ldb, ib = lda, ic = ldc;
      const char ta = trans_b ? 'T' : 'N', tb = trans_a ? 'T' : 'N';
      fn(&ta, &tb, &m, &n, &k, &alpha, B, &ia, A, &ib, &beta, C, &ic);
      return;
    }
  }
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (lib.gemm_bf16bf16f32 != nullptr) {
      constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
      lib.gemm_bf16bf16f32(kRowMajor, trans_a ? kTrans : kNoTrans, trans_b ? kTrans : kNoTrans, M, N, K, alpha,
                           reinterpret_cast<const uint16_t*>(A), lda, reinterpret_cast<const uint16_t*>(B), ldb,
                           beta, C, ldc);
      return;
    }
  }
  at::Tensor a = as_matrix(A, M, K, lda, trans_a), b = as_matrix(B, K, N, ldb, trans_b);
  at::Tensor c = as_matrix(C, M, N, ldc, false);
  if constexpr (std::is_same_v<T, acc_t>) {
    c.addmm_(a, b, beta, alpha);
  } else {
    at::Tensor prod = at::mm(a.to(c.scalar_type()), b.to(c.scalar_type()));
    if (beta == acc_t(0)) {
      c.copy_(prod).mul_(alpha);
    } else {
      c.mul_(beta).add_(prod, alpha);
    }
  }
}

// ---- Packed tile products (AMX on CPUs that have it): at::native::cpublas::brgemm, the
// micro-kernel PyTorch's own CPU flash attention calls for bf16. Its B operand must be in VNNI
// order, [K/2][N][2] (each pair of K rows interleaved column by column, so K must be even), with
// leading dimension N: one call covers the whole tile. (Packing in 64-column strips through
// cpublas::pack and one call per strip, as before, spent 1.7x torch's time in the micro-kernel
// for the same products: perf, bf16 forward, N = 2048.)
// TRANSFORMER_FAST_NO_BRGEMM=1 turns the packed path off (the plain gemm above is used).
template <typename T>
bool packed_products_available() {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    static const bool available = std::getenv("TRANSFORMER_FAST_NO_BRGEMM") == nullptr;
    return available;
  }
#endif
#if defined(CPUBLAS_BRGEMM_BF16BF16F32)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    static const bool available =
        std::getenv("TRANSFORMER_FAST_NO_BRGEMM") == nullptr && at::native::cpublas::could_pack(at::kBFloat16);
    return available;
  }
#endif
  return false;
}

// fp32 (AVX-512): B in panels of kPanel columns, each (K x kPanel) row-major, for register_gemm.
// Used for the products whose B is a transposed operand (K^T in the scores): register_gemm wants
// B's rows contiguous, and a panel keeps a strip's K rows together (rows of a 512-column K^T lie
// 2 KB apart, which maps them onto the same few L1 sets).
constexpr int64_t kPanel = 64;

// The packed fp32 B from column c on (c a multiple of kPanel), itself a packed operand.
inline const float* packed_columns(const float* B_packed, int64_t K, int64_t c) { return B_packed + c * K; }

// Elements of the packed form of a (K x N) B operand (bf16/fp16: K even).
template <typename T>
int64_t packed_size(int64_t K, int64_t N) {
  if constexpr (std::is_same_v<T, float>) return K * ((N + kPanel - 1) / kPanel) * kPanel;
  return K * N;
}

// Packs the row-major (K x N) matrix src (leading dimension ld) into dst: fp32 in panels (above);
// bf16/fp16 (K even) in VNNI order, dst[(k / 2) * 2N + 2n + k % 2] = src[k][n].
template <typename T>
void pack_b(const T* src, int64_t ld, int64_t K, int64_t N, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < N; j += kPanel) {
      const int64_t width = std::min(kPanel, N - j);
      for (int64_t k = 0; k < K; ++k) std::memcpy(dst + j * K + k * kPanel, src + k * ld + j, width * sizeof(float));
    }
    return;
  }
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (sizeof(T) == 2) {  // at::vec's AVX-512 2 x 32 register transposes
    at::vec::pack_vnni2(src, dst, ld, K, N);
    return;
  }
#endif
  for (int64_t k = 0; k < K; k += 2) {
    const T* row0 = src + k * ld;
    const T* row1 = row0 + ld;
    T* out = dst + k * N;
    for (int64_t n = 0; n < N; ++n) {
      out[2 * n] = row0[n];
      out[2 * n + 1] = row1[n];
    }
  }
}

// pack_b of the transpose of src, a row-major (N x K) matrix with leading dimension ld. fp32: each
// panel written in one transposing pass (at::vec's 16 x 16 register transposes). bf16/fp16 (K
// even): the VNNI order of src^T with packed_n >= N columns, the ones past N zero,
// dst[(k / 2) * 2 packed_n + 2n + k % 2] = src[n][k], is the transpose of src read as an
// (N x K/2) matrix of 32-bit pairs, made the same way where src's rows start on 4-byte
// boundaries; else through scratch (K x packed_n elements). (A torch copy_ of the transposed view
// took 15% of a bf16 forward at 128 keys, more than the packed products it fed.)
inline void pack_b_transposed(const float* src, int64_t ld, int64_t N, int64_t K, float* dst) {
  for (int64_t j = 0; j < N; j += kPanel) {
    at::vec::transpose_mxn<float>(src + j * ld, ld, dst + j * K, kPanel, static_cast<int>(std::min(kPanel, N - j)),
                                  static_cast<int>(K));
  }
}

template <typename T>
void pack_b_transposed(const T* src, int64_t ld, int64_t N, int64_t K, T* dst, T* scratch, int64_t packed_n) {
  static_assert(sizeof(T) == 2 && sizeof(float) == 4);
  if (ld % 2 == 0 && reinterpret_cast<uintptr_t>(src) % alignof(float) == 0) {
    // Moves bits only (register shuffles, no arithmetic), so any bf16/fp16 pair survives.
    at::vec::transpose_mxn<float>(reinterpret_cast<const float*>(src), ld / 2, reinterpret_cast<float*>(dst), packed_n,
                                  static_cast<int>(N), static_cast<int>(K / 2));
    for (int64_t k = 0; k < K && packed_n > N; k += 2) {
      std::fill(dst + k * packed_n + 2 * N, dst + (k + 2) * packed_n, T(0));
    }
    return;
  }
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) scratch[k * packed_n + n] = src[n * ld + k];
  }
  for (int64_t k = 0; k < K && packed_n > N; ++k) {
    std::fill(scratch + k * packed_n + N, scratch + (k + 1) * packed_n, T(0));
  }
  pack_b(scratch, packed_n, K, packed_n, dst);
}

// Row-major C (M x N) = A (M x K) B, or C += A B when accumulate; B packed by pack_b with the same
// K (even) and N. Only called where packed_products_available<T>().
template <typename T>
void packed_gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B_packed, bool accumulate,
                 float* C, int64_t ldc) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t j = 0; j < N; j += kPanel) {
      register_gemm(M, std::min(kPanel, N - j), K, 1.f, A, lda, 1, packed_columns(B_packed, K, j), kPanel, accumulate,
                    C + j, ldc);
    }
    return;
  }
#endif
#if defined(CPUBLAS_BRGEMM_BF16BF16F32)
  if (!blas_takes(lda, K)) {
    A = compact_rows(A, lda, M, K, 0);
    lda = K;
  }
  at::native::cpublas::brgemm(M, N, K, lda, N, ldc, accumulate, A, B_packed, C, /*is_vnni=*/true);
#else
  TORCH_CHECK(false, "packed tile products are not available in this PyTorch");
#endif
}

// Releases the calling thread's AMX tile state (if it used packed products) when it goes.
struct PackedProductsGuard {
  bool used;
  explicit PackedProductsGuard(bool used_) : used(used_) {}
  ~PackedProductsGuard() {
#if defined(CPUBLAS_BRGEMM_BF16BF16F32)
    if (used) at::native::cpublas::brgemm_release(/*is_vnni=*/true);
#endif
  }
  PackedProductsGuard(const PackedProductsGuard&) = delete;
  PackedProductsGuard& operator=(const PackedProductsGuard&) = delete;
};

}  // namespace cpu_blas
}  // namespace transformer_fast
