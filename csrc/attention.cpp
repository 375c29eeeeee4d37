// Softmax attention on the CPU: FlashAttention-2 style forward and backward.
//
// Queries and keys are processed in tiles with an online softmax, so nothing of size Nq x Nk is
// ever allocated: each thread owns a (BLOCK_M x BLOCK_N) score tile and an fp32 output
// accumulator. Tile products go through cpu_blas.h: fp32 through its AVX-512 register tiles
// (the scores against K^T and V^T packed once per call) where the CPU has AVX-512, else MKL;
// fp16 through MKL; bf16 through PyTorch's packed brgemm micro-kernel (AMX) with operands packed
// once per call, where the CPU has it (else MKL's bf16 gemm). bf16/fp16 tiles multiply in their
// own type into fp32. The softmax goes through at::vec. The contract (shapes, strides, masks, lse) is in
// transformer_fast/attention.py.
//
// Masked positions are never multiplied by zero: a key that no row of a tile may attend to is
// left out of the tile's value (and, in the backward, key) products, or its packed rows are
// zeroed, so NaN or inf stored in padded keys/values cannot reach the output or the gradients.

#include "cpu_capability.h"  // first: selects at::vec's ISA

#include "attention.h"
#include "cpu_blas.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#if defined(__AVX512BF16__)
#define TRANSFORMER_FAST_NATIVE_BF16_CONVERT 1
#endif
#endif

namespace transformer_fast {
namespace {

using cpu_blas::gemm;

// Per-thread tile buffers start on a cache line. With malloc's 16-byte alignment every 64-byte
// vector load and store of a tile row straddled two lines: the bf16 forward's row max alone cost
// as much as a fifth of its tile products (docs/design.md).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* ptr, std::size_t) { ::operator delete(ptr, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using TileBuffer = std::vector<T, CacheLineAllocator<T>>;

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Key-block status under the key padding mask.
enum : uint8_t { kNoPadding = 0, kSomePadding = 1, kAllPadding = 2 };

// Two float vectors -> 2 * Vec::size() values of T at out (bf16/fp16, rounded to nearest even).
// Where the CPU has AVX512-BF16, bf16 takes one instruction (vcvtne2ps2bf16; it flushes
// denormals, which only changes values below 1e-38); at::vec's conversion otherwise rounds with
// integer arithmetic, about six instructions, which perf showed as a fifth of the bf16 softmax.
template <typename T>
inline void store_converted(const Vec& lo, const Vec& hi, T* out) {
#if defined(TRANSFORMER_FAST_NATIVE_BF16_CONVERT)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    _mm512_storeu_si512(out, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(__m512(hi), __m512(lo))));
    return;
  }
#endif
  at::vec::convert_from_float<T>(lo, hi).store(out);
}

template <typename T>
inline void convert_row(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    constexpr int64_t kStep = 2 * Vec::size();
    int64_t c = 0;
    for (; c + kStep <= n; c += kStep) {
      store_converted(Vec::loadu(src + c), Vec::loadu(src + c + Vec::size()), dst + c);
    }
    for (; c < n; ++c) dst[c] = static_cast<T>(src[c]);
  }
}

// exp(x) for the softmax, to within 1 ulp, and 0 where the result would be below 2^-126 (as
// at::vec's exp_u20, measured at up to 3 ulp). With AVX-512: n = round(x / ln 2), r = x - n ln 2
// (ln 2 in two parts, so r is exact to ~1e-10), e^r from its Taylor polynomial of degree 7 (error
// below 1e-8 for |r| <= ln(2) / 2), scaled by 2^n with vscalefps: 14 instructions against
// exp_u20's 19, and the exp pass is most of the bf16 forward's own time. -inf gives 0; NaN stays
// NaN (a NaN input must show in the output, not vanish as a zero probability).
inline Vec exp_softmax(const Vec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 xv = x;
  const __m512 t = _mm512_max_ps(_mm512_set1_ps(-151.f), _mm512_mul_ps(xv, _mm512_set1_ps(1.44269504088896341f)));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xv);  // ln 2's first 16 bits: n * it is exact
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  // Denormal results would take microcode assists (slow): 0 instead. (NaN compares unordered:
  // kept.)
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(n, _mm512_set1_ps(-126.f), _CMP_NLT_UQ), p, n);
#else
  return Vec::blendv(x.exp_u20(), x, x.isnan());  // exp_u20 makes NaN inf
#endif
}

inline float row_max(const float* x, int64_t n) {
  // Four independent maxima: one chain of dependent vector max ops is latency-bound. The tail in
  // (partial) vectors as well, its missing lanes -inf.
  auto vmax = [](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); };
  Vec m0(kNegInf), m1(kNegInf), m2(kNegInf), m3(kNegInf);
  int64_t c = 0;
  for (; c + 4 * Vec::size() <= n; c += 4 * Vec::size()) {
    m0 = vmax(m0, Vec::loadu(x + c));
    m1 = vmax(m1, Vec::loadu(x + c + Vec::size()));
    m2 = vmax(m2, Vec::loadu(x + c + 2 * Vec::size()));
    m3 = vmax(m3, Vec::loadu(x + c + 3 * Vec::size()));
  }
  for (; c < n; c += Vec::size()) {
    const int64_t rest = std::min<int64_t>(Vec::size(), n - c);
    m0 = vmax(m0, Vec::set(Vec(kNegInf), Vec::loadu(x + c, rest), rest));
  }
  const Vec all = vmax(vmax(m0, m1), vmax(m2, m3));
  return at::vec::vec_reduce_all<float>([&](Vec& a, Vec& b) { return vmax(a, b); }, all);
}

// out <- exp(x * mult - shift) (out may be x, or a bf16/fp16 row); returns the sum of the fp32
// values. mult folds the softmax scale into the exponent where the tile product left it out.
template <typename T>
inline float exp_shift_sum(const float* x, int64_t n, float mult, float shift, T* out) {
  constexpr int64_t kStep = 2 * Vec::size();  // a bf16/fp16 vector holds two float vectors
  int64_t c = 0;
  Vec acc(0.f);
  const Vec vmult(mult), vshift(shift);
  for (; c + kStep <= n; c += kStep) {
    const Vec e0 = exp_softmax(at::vec::fmsub(Vec::loadu(x + c), vmult, vshift));
    const Vec e1 = exp_softmax(at::vec::fmsub(Vec::loadu(x + c + Vec::size()), vmult, vshift));
    if constexpr (std::is_same_v<T, float>) {
      e0.store(out + c);
      e1.store(out + c + Vec::size());
    } else {
      store_converted(e0, e1, out + c);
    }
    acc = acc + e0 + e1;
  }
  // The tail in partial vectors (a scalar std::exp loop here took 8% of a 304-key bf16 forward),
  // with the lanes past the row kept out of the sum.
  for (; c < n; c += Vec::size()) {
    const int64_t rest = std::min<int64_t>(Vec::size(), n - c);
    const Vec e = Vec::set(Vec(0.f), exp_softmax(at::vec::fmsub(Vec::loadu(x + c, rest), vmult, vshift)), rest);
    if constexpr (std::is_same_v<T, float>) {
      e.store(out + c, rest);
    } else {
      at::vec::convert_from_float<T>(e, Vec(0.f)).store(out + c, rest);
    }
    acc = acc + e;
  }
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
}

// a . b in fp32 with a vector of partial sums: its rounding error grows like n / 16 rather than n,
// as does that of dP, the BLAS product it is subtracted from in dS = P * (dP - delta). Where one
// key takes a row's whole probability, dP and delta are the same number in exact arithmetic, and
// a sequential sum here measurably raised the fp32 dQ error over the reference's.
template <typename T>
inline float dot_fp32(const T* a, const T* b, int64_t n) {
  Vec acc(0.f);
  int64_t c = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; c + Vec::size() <= n; c += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + c), Vec::loadu(b + c), acc);
  } else {
    using VecT = at::vec::Vectorized<T>;
    for (; c + VecT::size() <= n; c += VecT::size()) {
      auto [a0, a1] = at::vec::convert_to_float<T>(VecT::loadu(a + c));
      auto [b0, b1] = at::vec::convert_to_float<T>(VecT::loadu(b + c));
      acc = at::vec::fmadd(a1, b1, at::vec::fmadd(a0, b0, acc));
    }
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; c < n; ++c) sum += static_cast<float>(a[c]) * static_cast<float>(b[c]);
  return sum;
}

// dp <- p * (dp - delta), and exactly 0 where p == 0 (masked keys: dp may hold garbage there).
inline void ds_from_dp(const float* s, float* dp, int64_t n, float delta) {
  int64_t c = 0;
  const Vec vdelta(delta), zero(0.f);
  for (; c + Vec::size() <= n; c += Vec::size()) {
    const Vec pv = Vec::loadu(s + c);
    const Vec ds = pv * (Vec::loadu(dp + c) - vdelta);
    Vec::blendv(ds, zero, pv == zero).store(dp + c);
  }
  for (; c < n; ++c) dp[c] = s[c] == 0.f ? 0.f : s[c] * (dp[c] - delta);
}

// delta = sum_j P_j dP_j over a row's keys (0 terms where p == 0: dp may hold garbage there), in
// fp32 with a vector of partial sums. Where a row's keys fit one tile, this replaces dO . O: with O
// rounded to bf16/fp16, dO . O misses sum_j P_j dP_j by that rounding, which dominates dS where
// one key takes nearly all of a row's probability (dP_j and delta then nearly cancel).
inline float delta_from_tile(const float* s, const float* dp, int64_t n) {
  Vec acc(0.f);
  const Vec zero(0.f);
  int64_t c = 0;
  for (; c + Vec::size() <= n; c += Vec::size()) {
    const Vec pv = Vec::loadu(s + c);
    acc = acc + Vec::blendv(pv * Vec::loadu(dp + c), zero, pv == zero);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; c < n; ++c) sum += s[c] == 0.f ? 0.f : s[c] * dp[c];
  return sum;
}

// s <- P = exp(s * mult - lse) and dp <- dS = P * (dp - delta), for a row with no masked key.
inline void p_and_ds(float* s, float* dp, int64_t n, float mult, float lse, float delta) {
  const Vec vmult(mult), vlse(lse), vdelta(delta);
  int64_t c = 0;
  for (; c + Vec::size() <= n; c += Vec::size()) {
    const Vec pv = exp_softmax(at::vec::fmsub(Vec::loadu(s + c), vmult, vlse));
    pv.store(s + c);
    (pv * (Vec::loadu(dp + c) - vdelta)).store(dp + c);
  }
  if (c < n) {  // the tail as a partial vector, as at::vec::map does
    const int64_t rest = n - c;
    const Vec pv = exp_softmax(at::vec::fmsub(Vec::loadu(s + c, rest), vmult, vlse));
    pv.store(s + c, rest);
    (pv * (Vec::loadu(dp + c, rest) - vdelta)).store(dp + c, rest);
  }
}

inline void scale_row(float* x, int64_t n, float s) {
  at::vec::map([s](Vec a) { return a * Vec(s); }, x, x, n);
}

// Status of each key block of each batch under the padding mask: (B, ceil(Nk / block)).
std::vector<uint8_t> padding_status(const Problem& p, int64_t block) {
  const int64_t nblocks = (p.Nk + block - 1) / block;
  std::vector<uint8_t> status(p.B * nblocks, kNoPadding);
  if (p.pad == nullptr) return status;
  for (int64_t b = 0; b < p.B; ++b) {
    for (int64_t n = 0; n < nblocks; ++n) {
      const int64_t j0 = n * block, j1 = std::min(p.Nk, j0 + block);
      int64_t padded = 0;
      for (int64_t j = j0; j < j1; ++j) padded += p.pad[b * p.Nk + j];
      status[b * nblocks + n] = padded == 0 ? kNoPadding : padded == j1 - j0 ? kAllPadding : kSomePadding;
    }
  }
  return status;
}

template <typename mask_t>
void add_float_mask(const Problem& p, float* S, int64_t ldS, int64_t bm, int64_t bn, const mask_t* base,
                    int64_t i0, int64_t j0) {
  for (int64_t r = 0; r < bm; ++r) {
    const mask_t* m = base + (i0 + r) * p.msm + j0 * p.msn;
    float* s = S + r * ldS;
    if (p.msn == 1) {
      for (int64_t c = 0; c < bn; ++c) s[c] += static_cast<float>(m[c]);
    } else {
      for (int64_t c = 0; c < bn; ++c) s[c] += static_cast<float>(m[c * p.msn]);
    }
  }
}

// Applies attn_mask, causality and key padding to the scaled score tile S (rows i0.., keys j0..).
// The float mask is added first, so that the -inf of padding/causality overwrite whatever a
// garbage key or mask value produced. Returns whether any position may have been masked.
template <typename scalar_t>
bool apply_masks(const Problem& p, float* S, int64_t ldS, int64_t bm, int64_t bn, int64_t b, int64_t h,
                 int64_t i0, int64_t j0, uint8_t pad_status) {
  bool masked = false;
  if (p.mask != nullptr) {
    masked = true;
    const int64_t off = b * p.msb + h * p.msh;
    if (p.mask_is_bool) {
      const bool* base = static_cast<const bool*>(p.mask) + off;
      for (int64_t r = 0; r < bm; ++r) {
        const bool* m = base + (i0 + r) * p.msm + j0 * p.msn;
        float* s = S + r * ldS;
        for (int64_t c = 0; c < bn; ++c) s[c] = m[c * p.msn] ? s[c] : kNegInf;
      }
    } else {
      add_float_mask(p, S, ldS, bm, bn, static_cast<const scalar_t*>(p.mask) + off, i0, j0);
    }
  }
  if (p.causal && j0 + bn - 1 > i0) {  // some key lies right of the diagonal
    masked = true;
    for (int64_t r = 0; r < bm; ++r) {
      float* s = S + r * ldS;
      for (int64_t c = std::max<int64_t>(0, i0 + r - j0 + 1); c < bn; ++c) s[c] = kNegInf;
    }
  }
  if (pad_status == kSomePadding) {
    masked = true;
    const bool* pad = p.pad + b * p.Nk + j0;
    for (int64_t r = 0; r < bm; ++r) {
      float* s = S + r * ldS;
      for (int64_t c = 0; c < bn; ++c) s[c] = pad[c] ? kNegInf : s[c];
    }
  }
  return masked;
}

// The keys of a tile that some row uses: [lo, hi), and whether keys in between are unused.
struct UsedKeys {
  int64_t lo, hi;
  bool holes;
};

// From the column sums of a probability tile: a key is used iff its column is not all zero.
UsedKeys used_keys(const float* colsum, int64_t bn) {
  UsedKeys u{0, 0, false};
  int64_t lo = 0;
  while (lo < bn && colsum[lo] == 0.f) ++lo;
  int64_t hi = bn;
  while (hi > lo && colsum[hi - 1] == 0.f) --hi;
  u.lo = lo;
  u.hi = hi;
  for (int64_t c = lo; c < hi && !u.holes; ++c) u.holes = colsum[c] == 0.f;
  return u;
}

// rows [lo, hi) of a (rows, width) strided matrix into dst (ld = width), unused rows zeroed.
template <typename T>
void copy_used_rows(const T* src, int64_t ld, int64_t width, const float* colsum, int64_t lo, int64_t hi, T* dst) {
  for (int64_t c = lo; c < hi; ++c) {
    T* d = dst + (c - lo) * width;
    if (colsum[c] == 0.f) {
      std::fill(d, d + width, T(0));
    } else {
      std::memcpy(d, src + c * ld, width * sizeof(T));
    }
  }
}

// Rows of a strided operand to feed a tile product restricted to the used keys: either the
// operand itself from row lo, or a copy with the unused rows zeroed.
template <typename T>
inline const T* used_operand(const T* src, int64_t ld, int64_t width, const float* colsum, const UsedKeys& u,
                             T* scratch, int64_t* ld_out) {
  if (!u.holes) {
    *ld_out = ld;
    return src + u.lo * ld;
  }
  copy_used_rows(src, ld, width, colsum, u.lo, u.hi, scratch);
  *ld_out = width;
  return scratch;
}

// bf16/fp16: the tile products P V, dS K (over a tile's keys) and P^T dO, dS^T Q (over its query
// rows) take P and dS rounded to the inputs' dtype, a rounding as large as the result's own. Over
// many terms it averages out; over a handful it does not: fuzzing found gradients of 1-9 queries,
// or of queries with 1-3 keys, at 2-4x the reference's error. Tile products over at most this
// many terms take P and dS in fp32 instead, with the other operand's few rows converted to fp32.
// Not done in the packed products (no other products are mixed into brgemm's AMX tile state, and
// there at least 256 query rows share a block, so short products are rare), nor for rows with few
// keys inside a longer tile, such as a causal tile's first rows.
constexpr int64_t kShortReduction = 16;

// rows x width of a strided bf16/fp16 operand as fp32, packed (ld = width) into dst.
template <typename T>
const float* rows_as_float(const T* src, int64_t ld, int64_t rows, int64_t width, float* dst) {
  for (int64_t r = 0; r < rows; ++r) at::vec::convert(src + r * ld, dst + r * width, width);
  return dst;
}

// Tasks [0, n) handed out one at a time, in order, to whichever thread asks next.
class TaskQueue {
 public:
  explicit TaskQueue(int64_t n) : n_(n) {}
  bool pop(int64_t& task) {
    task = next_.fetch_add(1, std::memory_order_relaxed);
    return task < n_;
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t n_;
};

// Runs worker(queue) on each of at::parallel_for's threads, which take the tasks from one queue.
// at::parallel_for alone gives each thread one fixed share of the tasks; when one core runs
// slower for a while (common on a shared VM), the other then waits at the end of the call
// (forward+backward 4% faster this way; docs/design.md). Each task writes its own outputs,
// so which thread runs it does not change the result.
template <typename Worker>
void parallel_tasks(int64_t n, Worker&& worker) {
  TaskQueue queue(n);
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) { worker(queue); });
}

struct Blocks {
  int64_t m, n;
};

// Tile sizes (measured on 2 threads, fp32, D = 64, N = 2048; the alternatives measured are in
// docs/design.md). Forward: 256 x 512, as PyTorch's CPU flash attention, fewer query rows
// when that leaves too few tasks for the threads. Backward: 128 query rows (or the forward's, where
// fewer) by 512 keys in fp32, or 128 keys when causal (the diagonal's tiles are skipped more
// finely) and in bf16 (its packed products and transposes ran 7% faster on 128).
//
// The backward recomputes the scores S = scale * Q K^T and turns them into probabilities with
// the forward's log-sum-exp, so it must reproduce the forward's S bit for bit: MKL sums a
// product in an order that depends on the shape of the call, and a score that differs by one
// rounding (about 1e-5 for |S| ~ 50) skews exp(S - lse) by as much, which tripled the fp32
// gradient error for peaked softmaxes. So the forward computes S in the backward's tiles
// (score_tile's unit), at the same origins (the backward tile divides the forward's). (The
// forward's query tile depends on the thread count: a backward run with another thread count
// than its forward may get other tiles, which changes only the scores' rounding.)
Blocks forward_blocks(const Problem& p) {
  int64_t bm = 256;
  const int64_t min_tasks = 4 * at::get_num_threads();
  while (bm > 32 && p.B * p.H * ((p.Nq + bm - 1) / bm) < min_tasks) bm /= 2;
  return {std::min(bm, p.Nq), std::min<int64_t>(512, p.Nk)};
}

template <typename scalar_t>
Blocks backward_blocks(const Problem& p) {
  const int64_t bn = std::is_same_v<scalar_t, float> && !p.causal ? 512 : 128;
  return {std::min<int64_t>(128, forward_blocks(p).m), std::min<int64_t>(bn, p.Nk)};
}

// ---- Operands for the packed tile products of cpu_blas.h: bf16 (AMX), and fp32's K^T and V^T.
inline int64_t round_up_even(int64_t n) { return n + (n & 1); }

// Blocks of `block` rows of a (B, heads, N, W) tensor, each packed once as the B operand of a
// tile product: the block itself (K = its rows, rounded up to even with a zero row), or its
// transpose (K = W, which must be even).
template <typename scalar_t>
struct PackedBlocks {
  at::Tensor storage;
  int64_t n_blocks = 0, size = 0;
  scalar_t* at(int64_t bh, int64_t n) const { return storage.data_ptr<scalar_t>() + (bh * n_blocks + n) * size; }
};

template <typename scalar_t>
PackedBlocks<scalar_t> pack_blocks(const at::Tensor& t, int64_t block, bool transpose) {
  const int64_t heads = t.size(1), N = t.size(2), W = t.size(3);
  PackedBlocks<scalar_t> packed;
  packed.n_blocks = (N + block - 1) / block;
  packed.size = transpose ? cpu_blas::packed_size<scalar_t>(W, block)
                          : cpu_blas::packed_size<scalar_t>(round_up_even(block), W);
  packed.storage = at::empty({t.size(0) * heads * packed.n_blocks * packed.size}, t.options());
  const scalar_t* data = t.data_ptr<scalar_t>();
  at::parallel_for(0, t.size(0) * heads * packed.n_blocks, 1, [&](int64_t begin, int64_t end) {
    TileBuffer<scalar_t> scratch(std::is_same_v<scalar_t, float> ? 0 : round_up_even(block) * W);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / packed.n_blocks, n = task % packed.n_blocks;
      const int64_t j0 = n * block, rows = std::min(block, N - j0);
      const scalar_t* src = data + (bh / heads) * t.stride(0) + (bh % heads) * t.stride(1) + j0 * t.stride(2);
      scalar_t* dst = packed.at(bh, n);
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (transpose) {  // (fp32 packs only transposes: the score products' K^T and V^T)
          cpu_blas::pack_b_transposed(src, t.stride(2), rows, W, dst);
          continue;
        }
      }
      if (transpose) {
        at::from_blob(scratch.data(), {W, rows}, t.options())
            .copy_(at::from_blob(const_cast<scalar_t*>(src), {rows, W}, {t.stride(2), 1}, t.options()).t());
        cpu_blas::pack_b(scratch.data(), rows, W, rows, dst);
      } else if (rows % 2 == 0) {
        cpu_blas::pack_b(src, t.stride(2), rows, W, dst);
      } else {
        for (int64_t c = 0; c < rows; ++c) std::memcpy(scratch.data() + c * W, src + c * t.stride(2), W * sizeof(scalar_t));
        std::fill(scratch.data() + rows * W, scratch.data() + (rows + 1) * W, scalar_t(0));
        cpu_blas::pack_b(scratch.data(), W, rows + 1, W, dst);
      }
    }
  });
  return packed;
}

// The B operand of a product over the keys of a tile that leaves some unused (colsum 0): the
// (bn x width) key rows packed afresh with the unused rows zeroed, so that NaN or inf stored
// there cannot meet the zero probabilities. (Mixing in MKL's own AMX products instead would
// leave brgemm's tile state stale.)
template <typename scalar_t>
const scalar_t* pack_used_rows(const scalar_t* src, int64_t ld, int64_t width, const float* colsum, int64_t bn,
                               scalar_t* scratch, scalar_t* packed) {
  for (int64_t c = 0; c < round_up_even(bn); ++c) {
    scalar_t* dst = scratch + c * width;
    if (c < bn && colsum[c] != 0.f) {
      std::memcpy(dst, src + c * ld, width * sizeof(scalar_t));
    } else {
      std::fill(dst, dst + width, scalar_t(0));
    }
  }
  cpu_blas::pack_b(scratch, width, round_up_even(bn), width, packed);
  return packed;
}

// Row-major (rows x cols) tile -> its transpose (leading dimension ld_out), in at::vec's 32 x 32
// register blocks; a zero column pads an odd row count (the product's reduction dim must be even).
template <typename scalar_t>
void transpose_to(const scalar_t* src, int64_t ld_in, int64_t rows, int64_t cols, scalar_t* dst, int64_t ld_out) {
  constexpr int64_t kBlock = 32;
  for (int64_t r = 0; r < rows; r += kBlock) {
    for (int64_t c = 0; c < cols; c += kBlock) {
      at::vec::transpose_mxn<scalar_t>(src + r * ld_in + c, ld_in, dst + c * ld_out + r, ld_out,
                                       static_cast<int>(std::min(kBlock, rows - r)),
                                       static_cast<int>(std::min(kBlock, cols - c)));
    }
  }
  if (rows % 2) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ld_out + rows] = scalar_t(0);
  }
}

// Packing a block costs about as much as multiplying it by a few hundred rows: measured (bf16,
// Nk = 4096, 2 threads), the packed forward loses to MKL below ~256 query rows per key/value
// block (23x at Nq = 1, decoding) and wins from ~512 (1.4x at 2048). So packing needs that many
// rows to share each packed block: query rows (times the GQA group) for K and V, and for the
// backward's Q and dO also that many keys. TRANSFORMER_FAST_PACK_MIN_ROWS overrides the 256 (read
// per call; the tests use it to run both paths on small shapes).
inline bool packing_pays_off(int64_t rows_per_block) {
  const char* env = std::getenv("TRANSFORMER_FAST_PACK_MIN_ROWS");
  return rows_per_block >= (env != nullptr ? std::atoll(env) : 256);
}

// Whether the scores S = Q K^T go through K^T packed once per call (bf16/fp16: AMX brgemm; fp32:
// cpu_blas's register tiles, in panels). The forward and the backward decide it alike, so that
// the backward recomputes the forward's scores bit for bit (see score_tile).
template <typename scalar_t>
bool packed_scores(const Problem& p) {
  return cpu_blas::packed_products_available<scalar_t>() && p.D % 2 == 0 && packing_pays_off(p.Nq * (p.H / p.Hk));
}

// C = A B^T (unscaled) for a (bm x bn) tile, B also packed. bf16/fp16: one packed product. fp32:
// in units of unit.m x unit.n, each through the packed panels (register tiles) where it has at
// least cpu_blas::kRegisterMinDim rows and columns, else through MKL, which makes such small
// products more accurately (cpu_blas.h). The forward and the backward split the same rows and
// keys into the same units (see score_tile), so they choose alike for every score.
template <typename scalar_t>
void packed_nt_product(const Blocks& unit, int64_t bm, int64_t bn, int64_t K, const scalar_t* A, int64_t lda,
                       const scalar_t* b_rows, int64_t ldb, const scalar_t* b_packed, float* C, int64_t ldc) {
  if constexpr (!std::is_same_v<scalar_t, float>) {
    cpu_blas::packed_gemm(bm, bn, K, A, lda, b_packed, false, C, ldc);
  } else {
    for (int64_t r = 0; r < bm; r += unit.m) {
      for (int64_t c = 0; c < bn; c += unit.n) {
        const int64_t rows = std::min(unit.m, bm - r), cols = std::min(unit.n, bn - c);
        float* out = C + r * ldc + c;
        if (cpu_blas::register_tiles_suit(rows, cols)) {
          cpu_blas::packed_gemm(rows, cols, K, A + r * lda, lda, cpu_blas::packed_columns(b_packed, K, c), false, out,
                                ldc);
        } else {
          gemm(false, true, rows, cols, K, 1.f, A + r * lda, lda, b_rows + c * ldb, ldb, 0.f, out, ldc);
        }
      }
    }
  }
}

// S = scale * Q K^T for one (bm x bn) tile: MKL, or the packed product against K^T packed once.
// The packed products take no alpha, so there the scale is left for the exponent (returned: what
// S still has to be multiplied by) unless a float mask must be added to scaled scores (or
// scale <= 0, where max(s) * scale is not the scaled row's max): then it is applied here. MKL
// sums a product in an order that depends on the shape of the call, so its products are made in
// units of unit.m x unit.n (the backward's tiles; see backward_blocks): the forward and the
// backward then compute every score the same way. (The packed bf16 path rounds P to bf16, which
// is far coarser than a differently summed fp32 score.)
template <typename scalar_t>
float score_tile(const Problem& p, bool packed, const Blocks& unit, const scalar_t* qt, int64_t qsn,
                 const scalar_t* k_tile, int64_t ksn, const scalar_t* kt_packed, int64_t bm, int64_t bn, float* S,
                 int64_t ldS) {
  if (!packed) {
    for (int64_t r = 0; r < bm; r += unit.m) {
      for (int64_t c = 0; c < bn; c += unit.n) {
        gemm(false, true, std::min(unit.m, bm - r), std::min(unit.n, bn - c), p.D, p.scale, qt + r * qsn, qsn,
             k_tile + c * ksn, ksn, 0.f, S + r * ldS + c, ldS);
      }
    }
    return 1.f;
  }
  packed_nt_product(unit, bm, bn, p.D, qt, qsn, k_tile, ksn, kt_packed, S, ldS);
  if (p.scale > 0.f && (p.mask == nullptr || p.mask_is_bool)) return p.scale;
  for (int64_t r = 0; r < bm; ++r) scale_row(S + r * ldS, bn, p.scale);
  return 1.f;
}

// -------------------------------------------------------------------------------------------
// Forward
// -------------------------------------------------------------------------------------------
template <typename scalar_t>
void attention_fwd_kernel(const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          at::Tensor& out, at::Tensor& lse) {
  const Blocks blk = forward_blocks(p), score_unit = backward_blocks<scalar_t>(p);
  const int64_t BM = blk.m, BN = blk.n;
  const int64_t n_mblocks = (p.Nq + BM - 1) / BM;
  const int64_t n_nblocks = (p.Nk + BN - 1) / BN;
  const std::vector<uint8_t> pad_status = padding_status(p, BN);
  const int64_t group = p.H / p.Hk;

  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const scalar_t* k_data = k.data_ptr<scalar_t>();
  const scalar_t* v_data = v.data_ptr<scalar_t>();
  scalar_t* out_data = out.data_ptr<scalar_t>();
  float* lse_data = lse.data_ptr<float>();
  const int64_t qsb = q.stride(0), qsh = q.stride(1), qsn = q.stride(2);
  const int64_t ksb = k.stride(0), ksh = k.stride(1), ksn = k.stride(2);
  const int64_t vsb = v.stride(0), vsh = v.stride(1), vsn = v.stride(2);
  const int64_t D = p.D, Dv = p.Dv;
  constexpr bool kLowp = !std::is_same_v<scalar_t, float>;
  // Packed (AMX) products need an even reduction dim: D for Q K^T; the key count of P V is padded.
  // fp32 packs only K^T: its P V product needs no packing (cpu_blas::register_gemm).
  const bool packed = packed_scores<scalar_t>(p), packed_values = packed && kLowp;
  const PackedBlocks<scalar_t> packed_kt = packed ? pack_blocks<scalar_t>(k, BN, true) : PackedBlocks<scalar_t>();
  const PackedBlocks<scalar_t> packed_v =
      packed_values ? pack_blocks<scalar_t>(v, BN, false) : PackedBlocks<scalar_t>();
  const int64_t ldP = round_up_even(BN);  // P_lowp's row length: room for the zero pad column

  parallel_tasks(p.B * p.H * n_mblocks, [&](TaskQueue& tasks) {
    const cpu_blas::SerialGuard serial_blas;
    const cpu_blas::PackedProductsGuard packed_products(packed_values);
    TileBuffer<float> S(BM * BN), acc(BM * Dv), m(BM), l(BM), colsum(BN), drop(BN);
    TileBuffer<scalar_t> P_lowp(kLowp ? BM * ldP : 0), v_scratch(ldP * Dv);
    TileBuffer<scalar_t> v_packed(packed_values ? packed_v.size : 0);
    TileBuffer<float> v_float(kLowp ? kShortReduction * Dv : 0);
    for (int64_t task; tasks.pop(task);) {
      const int64_t mb = task % n_mblocks, bh = task / n_mblocks;
      const int64_t b = bh / p.H, h = bh % p.H, hk = h / group;
      const int64_t i0 = mb * BM, bm = std::min(BM, p.Nq - i0);
      const scalar_t* qt = q_data + b * qsb + h * qsh + i0 * qsn;
      const scalar_t* kb = k_data + b * ksb + hk * ksh;
      const scalar_t* vb = v_data + b * vsb + hk * vsh;
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(acc.begin(), acc.begin() + bm * Dv, 0.f);
      const int64_t key_end = p.causal ? std::min(p.Nk, i0 + bm) : p.Nk;  // keys beyond are masked for all rows
      for (int64_t j0 = 0, n = 0; j0 < key_end; j0 += BN, ++n) {
        const uint8_t status = pad_status[b * n_nblocks + n];
        if (status == kAllPadding) continue;
        const int64_t bn = std::min(BN, p.Nk - j0);
        const float s_scale = score_tile(p, packed, score_unit, qt, qsn, kb + j0 * ksn, ksn,
                                         packed ? packed_kt.at(b * p.Hk + hk, n) : nullptr, bm, bn, S.data(), BN);
        const bool masked = apply_masks<scalar_t>(p, S.data(), BN, bm, bn, b, h, i0, j0, status);
        if (masked) std::fill(colsum.begin(), colsum.begin() + bn, 0.f);
        // Unmasked tiles without dropout write P straight into the product's operand, unless the
        // tile is short enough for fp32 products (kShortReduction), which read P from S.
        const bool direct = kLowp && !masked && !p.dropout.active() && bn > kShortReduction;
        for (int64_t r = 0; r < bm; ++r) {
          float* s = S.data() + r * BN;
          scalar_t* p_row = kLowp ? P_lowp.data() + r * ldP : nullptr;
          const float m_old = m[r], m_new = std::max(m_old, row_max(s, bn) * s_scale);
          const float shift = m_new == kNegInf ? 0.f : m_new;  // all masked so far: exp(-inf) = 0
          const float row_sum = direct ? exp_shift_sum(s, bn, s_scale, shift, p_row)
                                       : exp_shift_sum(s, bn, s_scale, shift, s);
          // Rescale the row's sum and accumulator to the new maximum; nothing to do where there is
          // none yet (acc still 0) or it did not change: per-row costs add up when tiles are short.
          if (m_old != kNegInf && m_old != m_new) {
            const float alpha = std::exp(m_old - shift);
            l[r] *= alpha;
            scale_row(acc.data() + r * Dv, Dv, alpha);
          }
          l[r] += row_sum;
          m[r] = m_new;
          if (p.dropout.active()) {
            p.dropout.factors(p.dropout.row_key(bh, p.Nq, i0 + r), j0, bn, drop.data());
            for (int64_t c = 0; c < bn; ++c) s[c] *= drop[c];
          }
          if (masked) {
            for (int64_t c = 0; c < bn; ++c) colsum[c] += s[c];
          }
          if constexpr (kLowp) {
            if (!direct) convert_row(s, p_row, bn);
            if (bn % 2) p_row[bn] = scalar_t(0);  // meets the packed V's zero row
          }
        }
        UsedKeys used{0, bn, false};
        if (masked) used = used_keys(colsum.data(), bn);
        if (used.hi <= used.lo) continue;
        if (packed_values) {
          const scalar_t* vp = used.lo != 0 || used.hi != bn || used.holes
                                   ? pack_used_rows(vb + j0 * vsn, vsn, Dv, colsum.data(), bn, v_scratch.data(),
                                                    v_packed.data())
                                   : packed_v.at(b * p.Hk + hk, n);
          cpu_blas::packed_gemm(bm, Dv, round_up_even(bn), P_lowp.data(), ldP, vp, true, acc.data(), Dv);
          continue;
        }
        int64_t ldv;
        const scalar_t* vt = used_operand(vb + j0 * vsn, vsn, Dv, colsum.data(), used, v_scratch.data(), &ldv);
        if (kLowp && used.hi - used.lo <= kShortReduction) {  // fp32 P (in S: not direct) times fp32 V
          gemm(false, false, bm, Dv, used.hi - used.lo, 1.f, S.data() + used.lo, BN,
               rows_as_float(vt, ldv, used.hi - used.lo, Dv, v_float.data()), Dv, 1.f, acc.data(), Dv);
        } else if constexpr (kLowp) {
          gemm(false, false, bm, Dv, used.hi - used.lo, 1.f, P_lowp.data() + used.lo, ldP, vt, ldv, 1.f,
               acc.data(), Dv);
        } else {
          gemm(false, false, bm, Dv, used.hi - used.lo, 1.f, S.data() + used.lo, BN, vt, ldv, 1.f, acc.data(),
               Dv);
        }
      }
      scalar_t* o = out_data + (bh * p.Nq + i0) * Dv;
      for (int64_t r = 0; r < bm; ++r) {
        float* a = acc.data() + r * Dv;
        if (l[r] != 0.f) {  // (NaN too: a NaN score makes the row NaN, as it should)
          scale_row(a, Dv, 1.f / l[r]);
          lse_data[bh * p.Nq + i0 + r] = m[r] + std::log(l[r]);
        } else {  // no allowed key: 0, and exp(s - lse) = 0 in the backward
          std::fill(a, a + Dv, 0.f);
          lse_data[bh * p.Nq + i0 + r] = kInf;
        }
        convert_row(a, o + r * Dv, Dv);
      }
    }
  });
}

// -------------------------------------------------------------------------------------------
// Backward: one pass over (batch, key head, range of key blocks). Each task owns the dK, dV of
// its key blocks (summed over the group's query heads, GQA) and accumulates dQ into its own
// fp32 slice; the slices of the key-block ranges are summed in a fixed order afterwards, so the
// result does not depend on scheduling.
// -------------------------------------------------------------------------------------------
template <typename scalar_t>
void attention_bwd_kernel(const Problem& p, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq,
                          at::Tensor& dk, at::Tensor& dv, at::Tensor& dmask) {
  const Blocks blk = backward_blocks<scalar_t>(p);
  const int64_t BM = blk.m, BN = blk.n;
  const int64_t n_mblocks = (p.Nq + BM - 1) / BM;
  const int64_t n_nblocks = (p.Nk + BN - 1) / BN;
  const std::vector<uint8_t> pad_status = padding_status(p, BN);
  const int64_t group = p.H / p.Hk;
  const int64_t D = p.D, Dv = p.Dv;
  constexpr bool kLowp = !std::is_same_v<scalar_t, float>;

  const scalar_t* q_data = q.data_ptr<scalar_t>();
  const scalar_t* k_data = k.data_ptr<scalar_t>();
  const scalar_t* v_data = v.data_ptr<scalar_t>();
  const scalar_t* do_data = dout.data_ptr<scalar_t>();
  const scalar_t* o_data = out.data_ptr<scalar_t>();
  const float* lse_data = lse.data_ptr<float>();
  const int64_t qsb = q.stride(0), qsh = q.stride(1), qsn = q.stride(2);
  const int64_t ksb = k.stride(0), ksh = k.stride(1), ksn = k.stride(2);
  const int64_t vsb = v.stride(0), vsh = v.stride(1), vsn = v.stride(2);
  const int64_t dsb = dout.stride(0), dsh = dout.stride(1), dsn = dout.stride(2);
  const int64_t osb = out.stride(0), osh = out.stride(1), osn = out.stride(2);

  // delta_i = dO_i . O_i (= sum_j P_ij dP_ij, dropout included); rows whose keys fit one tile
  // take sum_j P_ij dP_ij from the tile instead (delta_from_tile).
  at::Tensor delta = at::empty({p.B, p.H, p.Nq}, q.options().dtype(at::kFloat));
  float* delta_data = delta.data_ptr<float>();
  if (n_nblocks > 1) at::parallel_for(0, p.B * p.H * p.Nq, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % p.Nq, bh = row / p.Nq, b = bh / p.H, h = bh % p.H;
      delta_data[row] = dot_fp32(do_data + b * dsb + h * dsh + i * dsn, o_data + b * osb + h * osh + i * osn, Dv);
    }
  });

  // Split the key blocks of each (batch, key head) into ranges when there are too few of them
  // to keep every thread busy.
  const int64_t units = p.B * p.Hk;
  const int64_t threads = at::get_num_threads();
  int64_t n_splits = 1;
  if (units < 4 * threads) n_splits = std::min(n_nblocks, (4 * threads + units - 1) / units);
  const int64_t blocks_per_split = (n_nblocks + n_splits - 1) / n_splits;
  n_splits = (n_nblocks + blocks_per_split - 1) / blocks_per_split;
  at::Tensor dq_acc = at::zeros({n_splits, p.B, p.H, p.Nq, D}, q.options().dtype(at::kFloat));
  float* dq_acc_data = dq_acc.data_ptr<float>();
  scalar_t* dk_data = dk.data_ptr<scalar_t>();
  scalar_t* dv_data = dv.data_ptr<scalar_t>();
  // dS out, (B, H, Nq, Nk) contiguous and zero-filled: the tiles skipped below have dS = 0.
  scalar_t* ds_data = dmask.defined() ? dmask.data_ptr<scalar_t>() : nullptr;

  // Packed products. bf16/fp16 (AMX): all five B operands packed once (K^T, V^T, K per key
  // block; Q, dO per query block); P^T and dS^T are written transposed. They take no alpha: the
  // softmax scale goes into the exponent (score_tile) and into the final dQ sum (dq_scale).
  // fp32: K^T and V^T only, for S and dP; the other three products need no packing.
  const bool packed =
      packed_scores<scalar_t>(p) && (!kLowp || (Dv % 2 == 0 && packing_pays_off(p.Nk)));
  const bool packed_updates = packed && kLowp;
  PackedBlocks<scalar_t> packed_kt, packed_vt, packed_k, packed_q, packed_do;
  if (packed) {
    packed_kt = pack_blocks<scalar_t>(k, BN, true);
    packed_vt = pack_blocks<scalar_t>(v, BN, true);
  }
  if (packed_updates) {
    packed_k = pack_blocks<scalar_t>(k, BN, false);
    packed_q = pack_blocks<scalar_t>(q, BM, false);
    packed_do = pack_blocks<scalar_t>(dout, BM, false);
  }
  const float dq_scale = packed_updates ? p.scale : 1.f;
  const int64_t ldP = round_up_even(BN), ldT = round_up_even(BM);

  parallel_tasks(units * n_splits, [&](TaskQueue& tasks) {
    const cpu_blas::SerialGuard serial_blas;
    const cpu_blas::PackedProductsGuard packed_products(packed_updates);
    TileBuffer<float> S(BM * BN), dP(BM * BN), drop(BM * BN), colsum(BN), dk_acc(BN * D), dv_acc(BN * Dv);
    TileBuffer<scalar_t> P_lowp(kLowp ? BM * ldP : 0), dS_lowp(kLowp ? BM * ldP : 0), k_scratch(ldP * D);
    TileBuffer<scalar_t> PT(packed_updates ? BN * ldT : 0), dST(packed_updates ? BN * ldT : 0),
        k_packed(packed_updates ? packed_k.size : 0);
    TileBuffer<float> q_float(kLowp ? kShortReduction * D : 0), do_float(kLowp ? kShortReduction * Dv : 0),
        k_float(kLowp ? kShortReduction * D : 0);
    for (int64_t task; tasks.pop(task);) {
      const int64_t split = task % n_splits, bhk = task / n_splits;
      const int64_t b = bhk / p.Hk, hk = bhk % p.Hk;
      const scalar_t* kb = k_data + b * ksb + hk * ksh;
      const scalar_t* vb = v_data + b * vsb + hk * vsh;
      const int64_t n_end = std::min(n_nblocks, (split + 1) * blocks_per_split);
      for (int64_t n = split * blocks_per_split; n < n_end; ++n) {
        const int64_t j0 = n * BN, bn = std::min(BN, p.Nk - j0);
        const uint8_t status = pad_status[b * n_nblocks + n];
        std::fill(dk_acc.begin(), dk_acc.end(), 0.f);
        std::fill(dv_acc.begin(), dv_acc.end(), 0.f);
        // Causal: query blocks whose last row is left of j0 see none of these keys.
        const int64_t mb_start = p.causal ? std::min(n_mblocks, j0 / BM) : 0;
        for (int64_t h = hk * group; h < (hk + 1) * group && status != kAllPadding; ++h) {
          const int64_t bh = b * p.H + h;
          for (int64_t mb = mb_start; mb < n_mblocks; ++mb) {
            const int64_t i0 = mb * BM, bm = std::min(BM, p.Nq - i0);
            if (p.causal && i0 + bm - 1 < j0) continue;
            const scalar_t* qt = q_data + b * qsb + h * qsh + i0 * qsn;
            const scalar_t* dot = do_data + b * dsb + h * dsh + i0 * dsn;
            const float* lse_t = lse_data + bh * p.Nq + i0;
            const float* delta_t = delta_data + bh * p.Nq + i0;
            const float s_scale = score_tile(p, packed, blk, qt, qsn, kb + j0 * ksn, ksn,
                                             packed ? packed_kt.at(bhk, n) : nullptr, bm, bn, S.data(), BN);
            const bool masked = apply_masks<scalar_t>(p, S.data(), BN, bm, bn, b, h, i0, j0, status);
            // An unmasked tile without dropout uses all its keys: P and dS are then made in one
            // pass after the dP product. Otherwise P comes first, to find the keys in use; so it
            // does where the row's keys fit this one tile, whose P and dP then give delta.
            const bool delta_from_p = n_nblocks == 1;
            const bool fused = !masked && !p.dropout.active() && !delta_from_p;
            UsedKeys used{0, bn, false};
            if (!fused) {
              if (masked) std::fill(colsum.begin(), colsum.begin() + bn, 0.f);
              // P = exp(S - lse) (0 on masked positions and on rows with no allowed key)
              for (int64_t r = 0; r < bm; ++r) {
                float* s = S.data() + r * BN;
                const Vec shift(lse_t[r]), mult(s_scale);
                at::vec::map([shift, mult](Vec x) { return exp_softmax(at::vec::fmsub(x, mult, shift)); }, s, s, bn);
                if (masked) {
                  for (int64_t c = 0; c < bn; ++c) colsum[c] += s[c];
                }
              }
              if (masked) used = used_keys(colsum.data(), bn);
              if (used.hi <= used.lo) continue;
            }
            // dP = dO V^T (garbage in unused keys is discarded below by a select, not a product)
            if (packed) {
              packed_nt_product(blk, bm, bn, Dv, dot, dsn, vb + j0 * vsn, vsn, packed_vt.at(bhk, n), dP.data(), BN);
            } else {
              gemm(false, true, bm, bn, Dv, 1.f, dot, dsn, vb + j0 * vsn, vsn, 0.f, dP.data(), BN);
            }
            // Pd = P * dropout factor -> dV += Pd^T dO; dS = P * (dP * factor - delta)
            for (int64_t r = 0; r < bm; ++r) {
              float* s = S.data() + r * BN;
              float* dp = dP.data() + r * BN;
              float* f = drop.data() + r * BN;
              if (p.dropout.active()) {
                p.dropout.factors(p.dropout.row_key(bh, p.Nq, i0 + r), j0, bn, f);
                for (int64_t c = 0; c < bn; ++c) dp[c] *= f[c];
              }
              if (fused) {
                p_and_ds(s, dp, bn, s_scale, lse_t[r], delta_t[r]);
              } else {
                ds_from_dp(s, dp, bn, delta_from_p ? delta_from_tile(s, dp, bn) : delta_t[r]);  // dP -> dS
              }
              if (ds_data != nullptr) convert_row(dp, ds_data + (bh * p.Nq + i0 + r) * p.Nk + j0, bn);
              if (p.dropout.active()) {
                for (int64_t c = 0; c < bn; ++c) s[c] *= f[c];
              }
              if constexpr (kLowp) {
                convert_row(s, P_lowp.data() + r * ldP, bn);
                convert_row(dp, dS_lowp.data() + r * ldP, bn);
                if (bn % 2) dS_lowp[r * ldP + bn] = scalar_t(0);  // meets the packed K's zero row
              }
            }
            if (packed_updates) {
              // dV += P^T dO, dK += dS^T Q (over all bn keys: unused ones have P = dS = 0 and
              // finite operands), dQ += dS K (unscaled; K's unused rows zeroed when there are any)
              transpose_to(P_lowp.data(), ldP, bm, bn, PT.data(), ldT);
              transpose_to(dS_lowp.data(), ldP, bm, bn, dST.data(), ldT);
              cpu_blas::packed_gemm(bn, Dv, round_up_even(bm), PT.data(), ldT, packed_do.at(bh, mb), true,
                                    dv_acc.data(), Dv);
              cpu_blas::packed_gemm(bn, D, round_up_even(bm), dST.data(), ldT, packed_q.at(bh, mb), true,
                                    dk_acc.data(), D);
              const scalar_t* kp = used.lo != 0 || used.hi != bn || used.holes
                                       ? pack_used_rows(kb + j0 * ksn, ksn, D, colsum.data(), bn, k_scratch.data(),
                                                        k_packed.data())
                                       : packed_k.at(bhk, n);
              float* dqt = dq_acc_data + ((split * p.B * p.H + bh) * p.Nq + i0) * D;
              cpu_blas::packed_gemm(bm, D, round_up_even(bn), dS_lowp.data(), ldP, kp, true, dqt, D);
              continue;
            }
            const int64_t nu = used.hi - used.lo;
            if (kLowp && bm <= kShortReduction) {  // fp32 P and dS (S, dP) times fp32 dO and Q rows
              gemm(true, false, nu, Dv, bm, 1.f, S.data() + used.lo, BN,
                   rows_as_float(dot, dsn, bm, Dv, do_float.data()), Dv, 1.f, dv_acc.data() + used.lo * Dv, Dv);
              gemm(true, false, nu, D, bm, 1.f, dP.data() + used.lo, BN, rows_as_float(qt, qsn, bm, D, q_float.data()),
                   D, 1.f, dk_acc.data() + used.lo * D, D);
            } else if constexpr (kLowp) {
              gemm(true, false, nu, Dv, bm, 1.f, P_lowp.data() + used.lo, ldP, dot, dsn, 1.f,
                   dv_acc.data() + used.lo * Dv, Dv);
              gemm(true, false, nu, D, bm, 1.f, dS_lowp.data() + used.lo, ldP, qt, qsn, 1.f,
                   dk_acc.data() + used.lo * D, D);
            } else {
              gemm(true, false, nu, Dv, bm, 1.f, S.data() + used.lo, BN, dot, dsn, 1.f, dv_acc.data() + used.lo * Dv,
                   Dv);
              gemm(true, false, nu, D, bm, 1.f, dP.data() + used.lo, BN, qt, qsn, 1.f, dk_acc.data() + used.lo * D,
                   D);
            }
            // dQ += scale * dS K over the used keys
            int64_t ldk;
            const scalar_t* kt = used_operand(kb + j0 * ksn, ksn, D, colsum.data(), used, k_scratch.data(), &ldk);
            float* dqt = dq_acc_data + ((split * p.B * p.H + bh) * p.Nq + i0) * D;
            if (kLowp && nu <= kShortReduction) {
              gemm(false, false, bm, D, nu, p.scale, dP.data() + used.lo, BN,
                   rows_as_float(kt, ldk, nu, D, k_float.data()), D, 1.f, dqt, D);
            } else if constexpr (kLowp) {
              gemm(false, false, bm, D, nu, p.scale, dS_lowp.data() + used.lo, ldP, kt, ldk, 1.f, dqt, D);
            } else {
              gemm(false, false, bm, D, nu, p.scale, dP.data() + used.lo, BN, kt, ldk, 1.f, dqt, D);
            }
          }
        }
        scalar_t* dkt = dk_data + ((b * p.Hk + hk) * p.Nk + j0) * D;
        scalar_t* dvt = dv_data + ((b * p.Hk + hk) * p.Nk + j0) * Dv;
        for (int64_t c = 0; c < bn; ++c) {
          scale_row(dk_acc.data() + c * D, D, p.scale);
          convert_row(dk_acc.data() + c * D, dkt + c * D, D);
          convert_row(dv_acc.data() + c * Dv, dvt + c * Dv, Dv);
        }
      }
    }
  });

  // dQ: the splits summed in order.
  scalar_t* dq_data = dq.data_ptr<scalar_t>();
  const int64_t rows = p.B * p.H * p.Nq;
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    TileBuffer<float> sum(D);
    for (int64_t row = begin; row < end; ++row) {
      std::memcpy(sum.data(), dq_acc_data + row * D, D * sizeof(float));
      for (int64_t s = 1; s < n_splits; ++s) {
        const float* part = dq_acc_data + (s * rows + row) * D;
        for (int64_t d = 0; d < D; ++d) sum[d] += part[d];
      }
      if (dq_scale != 1.f) scale_row(sum.data(), D, dq_scale);
      convert_row(sum.data(), dq_data + row * D, D);
    }
  });
}

void check_inputs(const char* fn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device(), fn, ": q, k, v must be on one device");
#if defined(TRANSFORMER_FAST_WITH_CUDA)
  TORCH_CHECK(q.device().is_cpu() || q.device().is_cuda(), fn, ": CPU or CUDA tensors expected, got ", q.device());
#else
  TORCH_CHECK(q.device().is_cpu(), fn, ": CPU tensors expected (this build has no CUDA kernels), got ", q.device());
#endif
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, fn, ": q, k, v must be 4-D");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), fn,
              ": q, k, v must share a dtype");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, fn, ": key heads must divide query heads");
}

// Calls fn(scalar_t{}) for the dtypes with kernels: fp32, bf16, fp16 (tiles accumulate in fp32).
template <typename Fn>
void dispatch_dtype(const char* fn_name, at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: return fn(float{});
    case at::kBFloat16: return fn(at::BFloat16{});
    case at::kHalf: return fn(at::Half{});
    default: TORCH_CHECK(false, fn_name, ": unsupported dtype ", dtype, " (float32, bfloat16, float16)");
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal, double scale, double dropout_p, int64_t seed) {
  check_inputs("attention_forward", q_in, k_in, v_in);
  const at::Tensor q = unit_last_stride(q_in), k = unit_last_stride(k_in), v = unit_last_stride(v_in);
  const at::Tensor pad = padding_mask_contiguous(key_padding_mask);
  const Problem p = make_problem(q, k, v, attn_mask, pad, is_causal, scale, dropout_p, seed);
  at::Tensor out = new_output({p.B, p.H, p.Nq, p.Dv}, q.options());
  at::Tensor lse = new_output({p.B, p.H, p.Nq}, q.options().dtype(at::kFloat));
  if (p.B * p.H * p.Nq == 0) return {out, lse};
  if (p.Nk == 0) {
    out.zero_();
    lse.fill_(kInf);
    return {out, lse};
  }
#if defined(TRANSFORMER_FAST_WITH_CUDA)
  if (q.is_cuda()) {
    attention_fwd_cuda(p, q, k, v, out, lse);
    return {out, lse};
  }
#endif
  dispatch_dtype("attention_forward", q.scalar_type(), [&](auto tag) {
    attention_fwd_kernel<decltype(tag)>(p, q, k, v, out, lse);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse_in,
    const std::optional<at::Tensor>& attn_mask, const std::optional<at::Tensor>& key_padding_mask,
    bool is_causal, double scale, double dropout_p, int64_t seed, bool compute_dmask) {
  check_inputs("attention_backward", q_in, k_in, v_in);
  const at::Tensor q = unit_last_stride(q_in), k = unit_last_stride(k_in), v = unit_last_stride(v_in);
  const at::Tensor dout = unit_last_stride(dout_in.to(q.scalar_type()));
  const at::Tensor out = unit_last_stride(out_in.to(q.scalar_type()));
  const at::Tensor lse = lse_in.to(at::kFloat).contiguous();
  const at::Tensor pad = padding_mask_contiguous(key_padding_mask);
  const Problem p = make_problem(q, k, v, attn_mask, pad, is_causal, scale, dropout_p, seed);
  at::Tensor dq = new_output(q.sizes(), q.options());
  at::Tensor dk = new_output(k.sizes(), k.options());
  at::Tensor dv = new_output(v.sizes(), v.options());
  // Zero-filled: the kernels write dS only where they visit (key blocks that are all padded or
  // above the causal diagonal are skipped).
  at::Tensor dmask = compute_dmask ? at::zeros({p.B, p.H, p.Nq, p.Nk}, q.options()) : at::Tensor();
  if (p.Nq == 0 || p.Nk == 0 || p.B * p.H == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv, dmask};
  }
#if defined(TRANSFORMER_FAST_WITH_CUDA)
  if (q.is_cuda()) {
    attention_bwd_cuda(p, dout, q, k, v, out, lse, dq, dk, dv, dmask);
    return {dq, dk, dv, dmask};
  }
#endif
  dispatch_dtype("attention_backward", q.scalar_type(), [&](auto tag) {
    attention_bwd_kernel<decltype(tag)>(p, dout, q, k, v, out, lse, dq, dk, dv, dmask);
  });
  return {dq, dk, dv, dmask};
}

}  // namespace transformer_fast

namespace transformer_fast {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale, double dropout_p, int64_t seed,
    bool compute_dmask) {
  auto [dq, dk, dv, dmask] = attention_backward(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal,
                                                scale, dropout_p, seed, compute_dmask);
  return {dq, dk, dv, dmask.defined() ? dmask : q.new_empty({0})};  // the op returns no None
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fast, CPU, m) {
  m.impl("attention_forward", &attention_forward);
  m.impl("attention_backward", &attention_backward_cpu);
}

}  // namespace transformer_fast
