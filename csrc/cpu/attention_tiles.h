// Softmax attention on the CPU: FlashAttention-2 style forward (attention_forward.cpp) and
// backward (attention_backward.cpp). This header holds what the two share: per-thread tile
// buffers, the rows of each sequence and head in the operands (dense, packed or paged), the tile
// sizes and the task queue that spreads tiles over threads, the packed operands and the score
// product. What is done to the scores after the product is attention_scores.h's.
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
#pragma once

#include "cpu/cpu_capability.h"  // first: selects at::vec's ISA

#include "cpu/attention_scores.h"
#include "cpu/attention_softmax.h"
#include "cpu/cpu_blas.h"
#include "ops/attention_problem.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/Utils.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace transformer_fast {
namespace cpu_attention {

using cpu_blas::gemm;

// Per-thread tile buffers start on a cache line. With malloc's 16-byte alignment every 64-byte
// vector load and store of a tile row straddled two lines: the bf16 forward's row max alone cost
// as much as a fifth of its tile products (docs/attention.md). They are not zero-filled (a decode
// call's 140 KB of them took 5% of its time): the kernels write what they read, and under
// TRANSFORMER_FAST_POISON=1 (as the extension loads) the buffers are NaN-filled, so that the tests
// catch a read of anything unwritten.
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    T* ptr = static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
    if (poison_scratch()) std::memset(static_cast<void*>(ptr), 0xFF, n * sizeof(T));  // NaN in every float type
    return ptr;
  }
  void deallocate(T* ptr, std::size_t) { ::operator delete(ptr, std::align_val_t(64)); }
  // std::vector<T>(n) value-initialises (zero-fills) its elements; this default-initialises them.
  template <typename U>
  void construct(U* ptr) noexcept {
    ::new (static_cast<void*>(ptr)) U;
  }
  template <typename U, typename... Args>
  void construct(U* ptr, Args&&... args) {
    ::new (static_cast<void*>(ptr)) U(std::forward<Args>(args)...);
  }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using TileBuffer = std::vector<T, CacheLineAllocator<T>>;

// The keys of a tile that some row uses: [lo, hi), and whether keys in between are unused.
struct UsedKeys {
  int64_t lo, hi;
  bool holes;
};

// From the column sums of a probability tile: a key is used iff its column is not all zero.
inline UsedKeys used_keys(const float* colsum, int64_t bn) {
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
// (forward+backward 2.6% and 4.0% faster in two A/B runs; docs/attention.md). Each task writes
// its own outputs, so which thread runs it does not change the result.
template <typename Worker>
void parallel_tasks(int64_t n, Worker&& worker) {
  TaskQueue queue(n);
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) { worker(queue); });
}

struct Blocks {
  int64_t m, n;
};

// Tile sizes (measured on 2 threads, fp32, D = 64, N = 2048; the alternatives measured are in
// docs/attention.md). Forward: 256 x 512, as PyTorch's CPU flash attention, fewer query rows
// when that leaves too few tasks for the threads; 256 keys in bf16/fp16 with a causal mask or a
// window, whose packed K^T blocks then end nearer the band (a query block computes the scores up
// to the end of the block holding its last allowed key). Backward: 128 query rows (or the forward's, where
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
// than its forward may get other tiles, which changes only the scores' rounding.) Packed
// sequences count their own query blocks; a sliding window takes 128-key backward tiles, as
// causal does, so that the forward's tiles (which start on a backward tile) hug the band.
inline int64_t query_blocks(const Problem& p, int64_t bm) {
  if (!p.packed()) return p.B * ((p.Nq + bm - 1) / bm);
  int64_t blocks = 0;
  for (int64_t b = 0; b < p.B; ++b) blocks += (p.q_len(b) + bm - 1) / bm;
  return blocks;
}

template <typename scalar_t>
Blocks forward_blocks(const Problem& p) {
  int64_t bm = 256;
  const int64_t min_tasks = 4 * at::get_num_threads();
  while (bm > 32 && p.H * query_blocks(p, bm) < min_tasks) bm /= 2;
  const int64_t bn = !std::is_same_v<scalar_t, float> && (p.causal || p.has_window()) ? 256 : 512;
  return {std::max<int64_t>(1, std::min(bm, p.Nq)), std::clamp<int64_t>(p.Nk, 1, bn)};
}

template <typename scalar_t>
Blocks backward_blocks(const Problem& p) {
  const int64_t bn = std::is_same_v<scalar_t, float> && !p.causal && !p.has_window() ? 512 : 128;
  return {std::min<int64_t>(128, forward_blocks<scalar_t>(p).m), std::clamp<int64_t>(p.Nk, 1, bn)};
}

// ---- The rows of the operands. A (sequence, head)'s rows of a dense (B, heads, N, W) tensor, a
// packed (rows, heads, W) one (the sequence's rows from its offset on) or a paged (pages,
// page_size, heads, W) cache (row j in page pages[j / page_size]).
template <typename T>
struct HeadRows {
  T* base = nullptr;  // row 0; paged: the head's row 0 of page 0
  int64_t stride = 0;  // between consecutive rows (of a page)
  const int32_t* pages = nullptr;
  int64_t page_size = 0, page_stride = 0;
  T* row(int64_t j) const {
    if (pages == nullptr) return base + j * stride;
    return base + pages[j / page_size] * page_stride + (j % page_size) * stride;
  }
  // Rows [j0, j0 + n) as a matrix: in place (leading dimension `stride`) unless they span pages,
  // then copied into scratch (leading dimension `width`).
  const T* block(int64_t j0, int64_t n, int64_t width, std::remove_const_t<T>* scratch, int64_t* ld) const {
    if (pages == nullptr || n == 0 || j0 / page_size == (j0 + n - 1) / page_size) {
      *ld = stride;
      return row(j0);
    }
    for (int64_t c = 0; c < n; ++c) std::memcpy(scratch + c * width, row(j0 + c), width * sizeof(T));
    *ld = width;
    return scratch;
  }
};

template <typename T>
struct Operand {
  T* data = nullptr;
  int64_t sb = 0, sh = 0, sn = 0;
  const int32_t* starts = nullptr;  // packed: each sequence's first row
  const int32_t* pages = nullptr;   // paged: block_table
  int64_t pages_per_seq = 0, page_size = 0, page_stride = 0;
  HeadRows<T> at(int64_t b, int64_t h) const {
    HeadRows<T> r;
    r.stride = sn;
    if (pages != nullptr) {
      r.base = data + h * sh;
      r.pages = pages + b * pages_per_seq;
      r.page_size = page_size;
      r.page_stride = page_stride;
    } else {
      r.base = data + b * sb + h * sh + (starts != nullptr ? starts[b] : 0) * sn;
    }
    return r;
  }
};

// A dense (B, heads, N, W) tensor, or a packed (rows, heads, W) one whose sequences start at the
// rows in `starts`.
template <typename T>
Operand<T> strided_operand(const at::Tensor& t, bool packed, const int32_t* starts) {
  Operand<T> o;
  o.data = static_cast<T*>(t.data_ptr());
  o.sh = t.stride(1);
  if (packed) {
    o.sn = t.stride(0);
    o.starts = starts;
  } else {
    o.sb = t.stride(0);
    o.sn = t.stride(2);
  }
  return o;
}

// Query-side tensors: q, out, dout, dq ((B, H, Nq, W) or packed (Tq, H, W)).
template <typename T>
Operand<T> query_operand(const at::Tensor& t, const Problem& p) {
  return strided_operand<T>(t, p.packed(), p.cu_seq_q);
}

// Key-side tensors: k, v, dk, dv ((B, Hk, Nk, W), packed (Tk, Hk, W) or paged (pages, page_size, Hk, W)).
template <typename T>
Operand<T> key_operand(const at::Tensor& t, const Problem& p) {
  if (!p.paged()) return strided_operand<T>(t, p.packed(), p.cu_seq_k);
  Operand<T> o;
  o.data = static_cast<T*>(t.data_ptr());
  o.sh = t.stride(2);
  o.sn = t.stride(1);
  o.pages = p.block_table;
  o.pages_per_seq = p.pages_per_seq;
  o.page_size = p.page_size;
  o.page_stride = t.stride(0);
  return o;
}

// ---- Operands for the packed tile products of cpu_blas.h: bf16 (AMX), and fp32's K^T and V^T.
// The reduction length of a packed bf16/fp16 product over n keys or query rows: n rounded up to a
// multiple of 32 (an AMX tile's depth in 16-bit elements), the operands' extra rows zeros. brgemm
// over other lengths ran up to 1.5x longer than over the next multiple (the forward's value
// product over 74, 82, ..., 118 keys against 128; a whole forward at N = 246 took 1.4x that at 256).
inline int64_t packed_reduction(int64_t n) { return (n + 31) / 32 * 32; }

// The columns of a packed bf16/fp16 score (or dP) product over a block of n keys: n rounded up to
// 16, an AMX tile's width, the K^T (V^T) blocks packed with zero columns up to it, so the product
// writes scores for keys past the block (zeros), which nothing reads. brgemm over a column tail
// together with a row tail took up to 1.4x the time per score (a whole forward at Nq = Nk = 246:
// 7.7 ns per score against 5.6 at 256, one thread). fp32's panels take n as it is.
template <typename scalar_t>
inline int64_t score_columns(int64_t n) {
  return std::is_same_v<scalar_t, float> ? n : (n + 15) / 16 * 16;
}

// Blocks of `block` rows of a (B, heads, N, W) tensor, each packed once as the B operand of a
// tile product: the block itself (K = its rows, zero rows up to packed_reduction), or its
// transpose (K = W, which must be even; zero columns up to score_columns).
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
  packed.size = transpose ? cpu_blas::packed_size<scalar_t>(W, score_columns<scalar_t>(block))
                          : cpu_blas::packed_size<scalar_t>(packed_reduction(block), W);
  packed.storage = new_tensor({t.size(0) * heads * packed.n_blocks * packed.size}, t.options());
  const scalar_t* data = t.data_ptr<scalar_t>();
  at::parallel_for(0, t.size(0) * heads * packed.n_blocks, 1, [&](int64_t begin, int64_t end) {
    TileBuffer<scalar_t> scratch(std::is_same_v<scalar_t, float> ? 0 : packed_reduction(block) * W);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / packed.n_blocks, n = task % packed.n_blocks;
      const int64_t j0 = n * block, rows = std::min(block, N - j0);
      const scalar_t* src = data + (bh / heads) * t.stride(0) + (bh % heads) * t.stride(1) + j0 * t.stride(2);
      scalar_t* dst = packed.at(bh, n);
      if (transpose) {  // (fp32 packs only transposes: the score products' K^T and V^T)
        if constexpr (std::is_same_v<scalar_t, float>) {
          cpu_blas::pack_b_transposed(src, t.stride(2), rows, W, dst);
        } else {
          cpu_blas::pack_b_transposed(src, t.stride(2), rows, W, dst, scratch.data(),
                                      score_columns<scalar_t>(rows));
        }
      } else if (rows == packed_reduction(rows)) {
        cpu_blas::pack_b(src, t.stride(2), rows, W, dst);
      } else {
        for (int64_t c = 0; c < rows; ++c) std::memcpy(scratch.data() + c * W, src + c * t.stride(2), W * sizeof(scalar_t));
        std::fill(scratch.data() + rows * W, scratch.data() + packed_reduction(rows) * W, scalar_t(0));
        cpu_blas::pack_b(scratch.data(), W, packed_reduction(rows), W, dst);
      }
    }
  });
  return packed;
}

// The B operand of a product over the keys of a tile that leaves some unused (colsum 0): the
// (bn x width) key rows packed afresh with the unused rows zeroed, so that NaN or inf stored
// there cannot meet the zero probabilities. (Mixing in MKL's own AMX products instead would
// leave brgemm's tile state stale.)
// Rows from bn up to `rows` are zero rows.
template <typename scalar_t>
const scalar_t* pack_used_rows(const scalar_t* src, int64_t ld, int64_t width, const float* colsum, int64_t bn,
                               int64_t rows, scalar_t* scratch, scalar_t* packed) {
  for (int64_t c = 0; c < packed_reduction(rows); ++c) {
    scalar_t* dst = scratch + c * width;
    if (c < bn && colsum[c] != 0.f) {
      std::memcpy(dst, src + c * ld, width * sizeof(scalar_t));
    } else {
      std::fill(dst, dst + width, scalar_t(0));
    }
  }
  cpu_blas::pack_b(scratch, width, packed_reduction(rows), width, packed);
  return packed;
}

// Zeroes, in value blocks packed by pack_blocks (not transposed, `heads` per sequence), the rows
// of each sequence's trailing padded keys in the block of its last unpadded key. A tile cut at that
// key (Padding::unpadded_prefix) still multiplies the whole packed block, with zero probabilities
// there, and NaN or inf stored in those rows must not meet them.
template <typename scalar_t>
void zero_trailing_padded_rows(const PackedBlocks<scalar_t>& packed, const Padding& padding, int64_t heads,
                               int64_t block, int64_t width) {
  if (!padding.any) return;
  for (size_t b = 0; b < padding.last.size(); ++b) {
    const int64_t last = padding.last[b];
    if (padding.first[b] >= last || last % block == 0) continue;  // no key, or no padding in the block
    const int64_t start = last / block * block, rows = std::min(padding.Nk - start, block);
    for (int64_t h = 0; h < heads; ++h) {
      scalar_t* dst = packed.at(static_cast<int64_t>(b) * heads + h, last / block);
      for (int64_t r = last - start; r < rows; ++r) {
        scalar_t* row = dst + (r / 2) * 2 * width + r % 2;
        for (int64_t n = 0; n < width; ++n) row[2 * n] = scalar_t(0);
      }
    }
  }
}

// Packing a block pays off only where enough rows share it: query rows (times the GQA group) for
// K and V, and for the backward's Q and dO also that many keys. Measured (one thread, 12 heads of
// 64; benchmarks/tools/sweep_cpu_packing.py): bf16 on an AMX CPU, packed over MKL 1.21x the time
// at 16 rows, 1.02x at 64, 0.88x at 128, 0.74x at 256 (forward+backward 0.98x at 128); on AMD
// CPUs bf16 packing won from ~512 rows (Nk = 4096). fp32's register tiles beat MKL on AMD CPUs
// (MKL packs operands on every call there), but on an Intel Xeon MKL's own small-matrix paths
// won up to 1024 rows (packed 1.04-1.18x the time) and tied at 2048. So bf16/fp16: 128 rows
// where the CPU has AMX, else 256; fp32: 2048 on Intel CPUs, else 256.
// TRANSFORMER_FAST_PACK_MIN_ROWS overrides all (read per call; the tests use it to run both
// paths on small shapes).
inline bool intel_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool intel = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid(0, &eax, &ebx, &ecx, &edx) != 0 && ebx == 0x756e6547 && edx == 0x49656e69 &&
           ecx == 0x6c65746e;  // "Genu" "ineI" "ntel"
  }();
  return intel;
#else
  return false;
#endif
}

template <typename scalar_t>
bool packing_pays_off(int64_t rows_per_block) {
  if (const char* env = std::getenv("TRANSFORMER_FAST_PACK_MIN_ROWS")) return rows_per_block >= std::atoll(env);
  static const bool amx = [] {
    const auto caps = at::cpu::get_cpu_capabilities();
    const auto it = caps.find("amx_bf16");
    return it != caps.end() && it->second.isBool() && it->second.toBool();
  }();
  if constexpr (std::is_same_v<scalar_t, float>) return rows_per_block >= (intel_cpu() ? 2048 : 256);
  return rows_per_block >= (amx ? 128 : 256);
}

// Whether the scores S = Q K^T go through K^T packed once per call (bf16/fp16: AMX brgemm; fp32:
// cpu_blas's register tiles, in panels). The forward and the backward decide it alike, so that
// the backward recomputes the forward's scores bit for bit (see score_tile). Not with a head dim
// of 0: over an empty reduction the fp32 register tiles leave the tile unwritten (nor is brgemm
// relied on there), where gemm writes the zeros that are then the scores (D = 0) or dP (Dv = 0).
// Packed sequences have none: the blocks are packed per dense (batch, head).
template <typename scalar_t>
bool packed_scores(const Problem& p) {
  return cpu_blas::packed_products_available<scalar_t>() && !p.packed() && p.D > 0 && p.Dv > 0 &&
         p.D % 2 == 0 && packing_pays_off<scalar_t>(p.Nq * (p.H / p.Hk));
}

// How the scores are made, decided alike by the forward and the backward: packed products (above);
// one dot product at a time for decoding (attention_scores.h): with GQA where every sequence has
// at most kRowwiseMaxRows query rows (the forward then stacks the rows of a group, so each key and
// value row is read once per key head), without GQA up to kRowwiseMaxRowsMha; else MKL in the
// backward's units (score_tile). (Measured, one thread, 8192 keys, head dim 128: with GQA 4 the
// row-wise path took 0.3-0.9x the CPU time of MKL's per head up to 16 rows; without GQA 0.3x at
// one row, even at 4, but 1.25x at 8 rows in bf16.)
enum class ScorePath { kUnits, kPacked, kRowwise };
constexpr int64_t kRowwiseMaxRowsMha = 4;

template <typename scalar_t>
ScorePath score_path(const Problem& p) {
  if (packed_scores<scalar_t>(p)) return ScorePath::kPacked;
  return p.Nq <= (p.H > p.Hk ? kRowwiseMaxRows : kRowwiseMaxRowsMha) ? ScorePath::kRowwise : ScorePath::kUnits;
}

// C = A B^T (unscaled) for a (bm x bn) tile, B also packed. bf16/fp16: one packed product, over
// score_columns(bn) columns (C's leading dimension must hold them; the extra ones are zeros). fp32:
// in units of unit.m x unit.n, each through the packed panels (register tiles) where it has at
// least cpu_blas::kRegisterMinDim rows and columns, else through MKL, which makes such small
// products more accurately (cpu_blas.h). The forward and the backward split the same rows and
// keys into the same units (see score_tile), so they choose alike for every score.
template <typename scalar_t>
void packed_nt_product(const Blocks& unit, int64_t bm, int64_t bn, int64_t K, const scalar_t* A, int64_t lda,
                       const scalar_t* b_rows, int64_t ldb, const scalar_t* b_packed, float* C, int64_t ldc) {
  if constexpr (!std::is_same_v<scalar_t, float>) {
    cpu_blas::packed_gemm(bm, score_columns<scalar_t>(bn), K, A, lda, b_packed, false, C, ldc);
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
// S still has to be multiplied by) unless the scaled scores are needed before the softmax (a float
// mask added to them, soft-capping or ALiBi applied to them) or scale <= 0 (where max(s) * scale
// is not the scaled row's max): then it is applied here. MKL
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
  if (p.scale > 0.f && (p.mask == nullptr || p.mask_is_bool) && !p.transforms_scores()) return p.scale;
  for (int64_t r = 0; r < bm; ++r) scale_row(S + r * ldS, bn, p.scale);
  return 1.f;
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

}  // namespace cpu_attention
}  // namespace transformer_fast
