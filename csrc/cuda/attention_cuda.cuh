// Softmax attention on CUDA GPUs, for the C++ backend: the fallback where Triton is missing. The
// kernels, and the host code that sizes and launches them through a launch function: a CUDA launch
// in attention_cuda.cu, a run on CPU threads in the tests (tests/cuda_emulation.cpp), which
// checks this code on machines without a GPU.
//
// Same contract and semantics as the CPU kernels (transformer_fast/attention.py documents them),
// including the dropout mask, regenerated from the hash in ops/attention_problem.h. These kernels run on the
// CUDA cores in fp32 (no tensor cores) and use no atomics, so they are deterministic; the fast
// GPU path is the Triton kernels.
//
// Work split. A warp owns kRows query rows (forward, dQ) or kRows keys (dK/dV); the kWarps warps
// of a block share a tile of up to 32 keys (or queries) staged in shared memory as fp32, one per
// lane. Lane c computes the scores of the tile's c-th key (or query) against the warp's rows, the
// lanes combine row statistics with shuffles, and then each tile entry's contribution is added
// to the warp's output rows, whose head dims are spread over the lanes (lane l holds dims
// l, l + 32, ...: kDims of them).
//
// Masked positions: padded keys and keys past the end are staged as zeros; a masked score is
// replaced by -inf (a select, so NaN in a masked key cannot survive it), and the accumulations
// skip masked entries (a ballot of the warp), so NaN or inf in masked keys and values never
// reach the output or the gradients.

#pragma once

#include "ops/attention_problem.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>

// A block's dynamic shared memory (the CPU emulation defines its own).
#ifndef TF_SHARED_MEMORY
#define TF_SHARED_MEMORY(name) extern __shared__ float name[]
#endif

namespace transformer_fast {
namespace cuda_kernels {

constexpr int kWarps = 4;                    // warps per block
constexpr int kRows = 4;                     // query rows (or keys) per warp
constexpr int kBlockRows = kWarps * kRows;   // query rows (or keys) per block
constexpr int kThreads = kWarps * 32;
constexpr int kMaxHeadDim = 256;
constexpr unsigned kFullWarp = 0xffffffffu;

// Element strides of a (B, heads, N, width) tensor with a unit last-dim stride.
struct Layout {
  int64_t sb, sh, sn;
};

inline Layout layout_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// xor butterflies: every lane ends with the same value (each step adds or compares the same
// two operands on both lanes of a pair).
__device__ inline float warp_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(kFullWarp, x, offset));
  return x;
}

__device__ inline float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(kFullWarp, x, offset);
  return x;
}

// The scaled, masked score of query i and key j (b, h: batch and query head), as the CPU kernels'
// apply_masks: the float mask is added first, so the -inf of a disallowed position replaces
// whatever a garbage key or mask value produced.
template <typename scalar_t>
__device__ inline float masked_score(const Problem& p, float dot, int64_t b, int64_t h, int64_t i, int64_t j) {
  float s = dot * p.scale;
  bool allowed = true;
  if (p.mask != nullptr) {
    const int64_t off = b * p.msb + h * p.msh + i * p.msm + j * p.msn;
    if (p.mask_is_bool) {
      allowed = static_cast<const bool*>(p.mask)[off];
    } else if (p.mask_is_float32) {
      s += static_cast<const float*>(p.mask)[off];
    } else {
      s += static_cast<float>(static_cast<const scalar_t*>(p.mask)[off]);
    }
  }
  if (p.causal && j > i) allowed = false;
  if (p.pad != nullptr && p.pad[b * p.Nk + j]) allowed = false;
  return allowed ? s : -INFINITY;
}

// out[r] = sum_d rows[r * width + d] * x[d] for the warp's kRows rows (broadcast reads: every lane
// reads the same row element) against the lane's own vector x, in kParts partial sums (element d
// goes to sum d % kParts) added pairwise at the end. One running sum over up to 256 elements lost
// 4-5x the reference's accuracy in dS = P (dP - delta) where that cancels (rows with one allowed
// key; measured in the CPU emulation with FMAs; docs/attention.md); the partial sums are also
// independent FMA chains.
constexpr int kParts = 8;

__device__ inline void row_dots(const float* rows, const float* x, int width, float (&out)[kRows]) {
  float part[kRows][kParts] = {};
  int d = 0;
  for (; d + kParts <= width; d += kParts) {
#pragma unroll
    for (int e = 0; e < kParts; ++e) {
      const float xd = x[d + e];
#pragma unroll
      for (int r = 0; r < kRows; ++r) part[r][e] += rows[r * width + d + e] * xd;
    }
  }
  for (; d < width; ++d) {  // (the tail into sum 0: a runtime index would put `part` in local memory)
    const float xd = x[d];
#pragma unroll
    for (int r = 0; r < kRows; ++r) part[r][0] += rows[r * width + d] * xd;
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int stride = kParts / 2; stride > 0; stride /= 2) {
#pragma unroll
      for (int e = 0; e < stride; ++e) part[r][e] += part[r][e + stride];
    }
    out[r] = part[r][0];
  }
}

// acc[r] += w_c[r] * (row c of a staged tile) over the tile's entries c that are live for row r,
// where w_c[r] is lane c's w[r]; the lanes hold the head dims lane, lane + 32, ... of acc's rows.
// The tile's terms are summed on their own first and then added to acc: acc runs over every tile
// (and, for dK/dV, every head of a GQA group), and one running sum over all of them lost up to
// ~2x the reference's accuracy in the dV of a key that takes every row's probability (the same
// corner as cpu/cpu_blas.h's few_rows_gemm; measured in the CPU emulation).
template <int kDims>
__device__ inline void accumulate_tile(float (&acc)[kRows][kDims], const float (&w)[kRows],
                                       const unsigned (&live)[kRows], const float* tile_rows, int ld, int width,
                                       int tile, int lane) {
  float part[kRows][kDims] = {};
  for (int c = 0; c < tile; ++c) {
    const float* row = tile_rows + c * ld;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (!((live[r] >> c) & 1u)) continue;  // a masked entry (warp-uniform: a ballot)
      const float wc = __shfl_sync(kFullWarp, w[r], c);
#pragma unroll
      for (int t = 0; t < kDims; ++t) {
        const int d = lane + 32 * t;
        if (d < width) part[r][t] += wc * row[d];
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int t = 0; t < kDims; ++t) acc[r][t] += part[r][t];
  }
}

// Rows [r0, r0 + n) of a matrix with `rows` rows of `width` elements (row stride ld) into dst as
// fp32 (row stride ld_dst); rows past the end, and padded ones where `pad` is given, are zeros.
template <typename scalar_t>
__device__ void stage_rows(const scalar_t* src, int64_t ld, int64_t r0, int64_t rows, int n, int width,
                           const bool* pad, float* dst, int ld_dst) {
  for (int idx = threadIdx.x; idx < n * width; idx += kThreads) {
    const int r = idx / width, d = idx % width;
    const int64_t row = r0 + r;
    const bool live = row < rows && (pad == nullptr || !pad[row]);
    dst[r * ld_dst + d] = live ? static_cast<float>(src[row * ld + d]) : 0.f;
  }
}

// -------------------------------------------------------------------------------------------
// Forward: a block owns kBlockRows query rows of one (batch, head) and walks the key tiles with
// an online softmax.
// -------------------------------------------------------------------------------------------
template <typename scalar_t, int kDims>
__global__ void __launch_bounds__(kThreads)
    attention_fwd_kernel(const Problem p, const scalar_t* __restrict__ q, Layout qs, const scalar_t* __restrict__ k,
                         Layout ks, const scalar_t* __restrict__ v, Layout vs, scalar_t* __restrict__ out,
                         Layout os, float* __restrict__ lse, int tile) {
  TF_SHARED_MEMORY(smem);
  const int D = static_cast<int>(p.D), Dv = static_cast<int>(p.Dv), ldk = D + 1, ldv = Dv + 1;
  float* k_tile = smem;                  // tile x ldk (the +1 keeps lane-per-key reads off one bank)
  float* v_tile = k_tile + tile * ldk;   // tile x ldv
  float* q_rows = v_tile + tile * ldv;   // kBlockRows x D
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n_mblocks = (p.Nq + kBlockRows - 1) / kBlockRows;
  const int64_t bh = blockIdx.x / n_mblocks, b = bh / p.H, h = bh % p.H, hk = h / (p.H / p.Hk);
  const int64_t i0 = (blockIdx.x % n_mblocks) * kBlockRows;
  const int64_t row0 = i0 + warp * kRows;  // the warp's first query row
  const scalar_t* kb = k + b * ks.sb + hk * ks.sh;
  const scalar_t* vb = v + b * vs.sb + hk * vs.sh;
  const bool* pad = p.pad != nullptr ? p.pad + b * p.Nk : nullptr;
  const float* my_q = q_rows + warp * kRows * D;
  stage_rows(q + b * qs.sb + h * qs.sh, qs.sn, i0, p.Nq, kBlockRows, D, nullptr, q_rows, D);

  float acc[kRows][kDims], m[kRows], l[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int t = 0; t < kDims; ++t) acc[r][t] = 0.f;
  }
  const int64_t key_end = p.causal && i0 + kBlockRows < p.Nk ? i0 + kBlockRows : p.Nk;  // later keys: all masked
  for (int64_t j0 = 0; j0 < key_end; j0 += tile) {
    __syncthreads();  // the previous tile is consumed
    stage_rows(kb, ks.sn, j0, p.Nk, tile, D, pad, k_tile, ldk);
    stage_rows(vb, vs.sn, j0, p.Nk, tile, Dv, pad, v_tile, ldv);
    __syncthreads();
    if (row0 >= p.Nq) continue;  // (warp-uniform; the warp still meets the barriers)
    const int64_t j = j0 + lane;
    const bool key_in_tile = lane < tile && j < p.Nk;
    float dot[kRows] = {};
    if (key_in_tile) row_dots(my_q, k_tile + lane * ldk, D, dot);
    float prob[kRows];
    unsigned live[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = row0 + r;
      const float s = key_in_tile && i < p.Nq ? masked_score<scalar_t>(p, dot[r], b, h, i, j) : -INFINITY;
      live[r] = __ballot_sync(kFullWarp, s != -INFINITY);
      // fmaxf ignores NaN: a NaN score leaves the maximum alone and makes the row's sum NaN.
      const float m_new = fmaxf(m[r], warp_max(s));
      const float shift = m_new == -INFINITY ? 0.f : m_new;  // all masked so far: exp(-inf) = 0
      const float e = expf(s - shift);
      const float alpha = expf(m[r] - shift);  // 0 while the row had no allowed key (acc and l are 0)
      l[r] = l[r] * alpha + warp_sum(e);
#pragma unroll
      for (int t = 0; t < kDims; ++t) acc[r][t] *= alpha;
      m[r] = m_new;
      prob[r] = p.dropout.active() && s != -INFINITY ? e * p.dropout.factor(p.dropout.row_key(bh, p.Nq, i), j) : e;
    }
    accumulate_tile(acc, prob, live, v_tile, ldv, Dv, tile, lane);
  }
  if (row0 >= p.Nq) return;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = row0 + r;
    if (i >= p.Nq) break;
    const bool any = l[r] != 0.f;  // (NaN too: a NaN score makes the row NaN, as it should)
    const float inv = 1.f / l[r];
    scalar_t* o = out + b * os.sb + h * os.sh + i * os.sn;
#pragma unroll
    for (int t = 0; t < kDims; ++t) {
      const int d = lane + 32 * t;
      if (d < Dv) o[d] = static_cast<scalar_t>(any ? acc[r][t] * inv : 0.f);
    }
    // no allowed key: output 0, and lse = +inf makes exp(s - lse) = 0 in the backward
    if (lane == 0) lse[bh * p.Nq + i] = any ? m[r] + logf(l[r]) : INFINITY;
  }
}

// -------------------------------------------------------------------------------------------
// Backward. delta_i = dO_i . O_i first; then dQ (a block per kBlockRows query rows, walking the
// key tiles) and dK, dV (a block per kBlockRows keys, walking the query tiles of every head of
// its GQA group), each recomputing P = exp(S - lse) and dS = P (dP - delta).
// -------------------------------------------------------------------------------------------
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    attention_bwd_delta_kernel(const Problem p, const scalar_t* __restrict__ dout, Layout dos,
                               const scalar_t* __restrict__ out, Layout os, float* __restrict__ delta) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= p.B * p.H * p.Nq) return;
  const int64_t i = row % p.Nq, bh = row / p.Nq, b = bh / p.H, h = bh % p.H;
  const scalar_t* g = dout + b * dos.sb + h * dos.sh + i * dos.sn;
  const scalar_t* o = out + b * os.sb + h * os.sh + i * os.sn;
  float sum = 0.f;
  for (int64_t d = lane; d < p.Dv; d += 32) sum += static_cast<float>(g[d]) * static_cast<float>(o[d]);
  sum = warp_sum(sum);
  if (lane == 0) delta[row] = sum;
}

template <typename scalar_t, int kDims>
__global__ void __launch_bounds__(kThreads)
    attention_bwd_dq_kernel(const Problem p, const scalar_t* __restrict__ q, Layout qs, const scalar_t* __restrict__ k,
                            Layout ks, const scalar_t* __restrict__ v, Layout vs, const scalar_t* __restrict__ dout,
                            Layout dos, const float* __restrict__ lse, const float* __restrict__ delta,
                            scalar_t* __restrict__ dq, Layout dqs, void* __restrict__ ds_out, int tile) {
  TF_SHARED_MEMORY(smem);
  const int D = static_cast<int>(p.D), Dv = static_cast<int>(p.Dv), ldk = D + 1, ldv = Dv + 1;
  float* k_tile = smem;                    // tile x ldk
  float* v_tile = k_tile + tile * ldk;     // tile x ldv
  float* q_rows = v_tile + tile * ldv;     // kBlockRows x D
  float* do_rows = q_rows + kBlockRows * D;  // kBlockRows x Dv
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n_mblocks = (p.Nq + kBlockRows - 1) / kBlockRows;
  const int64_t bh = blockIdx.x / n_mblocks, b = bh / p.H, h = bh % p.H, hk = h / (p.H / p.Hk);
  const int64_t i0 = (blockIdx.x % n_mblocks) * kBlockRows;
  const int64_t row0 = i0 + warp * kRows;
  const scalar_t* kb = k + b * ks.sb + hk * ks.sh;
  const scalar_t* vb = v + b * vs.sb + hk * vs.sh;
  const bool* pad = p.pad != nullptr ? p.pad + b * p.Nk : nullptr;
  const float* my_q = q_rows + warp * kRows * D;
  const float* my_do = do_rows + warp * kRows * Dv;
  stage_rows(q + b * qs.sb + h * qs.sh, qs.sn, i0, p.Nq, kBlockRows, D, nullptr, q_rows, D);
  stage_rows(dout + b * dos.sb + h * dos.sh, dos.sn, i0, p.Nq, kBlockRows, Dv, nullptr, do_rows, Dv);

  float acc[kRows][kDims], row_lse[kRows], row_delta[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = row0 + r;
    row_lse[r] = i < p.Nq ? lse[bh * p.Nq + i] : INFINITY;
    row_delta[r] = i < p.Nq ? delta[bh * p.Nq + i] : 0.f;
#pragma unroll
    for (int t = 0; t < kDims; ++t) acc[r][t] = 0.f;
  }
  const int64_t key_end = p.causal && i0 + kBlockRows < p.Nk ? i0 + kBlockRows : p.Nk;
  for (int64_t j0 = 0; j0 < key_end; j0 += tile) {
    __syncthreads();
    stage_rows(kb, ks.sn, j0, p.Nk, tile, D, pad, k_tile, ldk);
    stage_rows(vb, vs.sn, j0, p.Nk, tile, Dv, pad, v_tile, ldv);
    __syncthreads();
    if (row0 >= p.Nq) continue;
    const int64_t j = j0 + lane;
    const bool key_in_tile = lane < tile && j < p.Nk;
    float dot[kRows] = {}, dp[kRows] = {};
    if (key_in_tile) {
      row_dots(my_q, k_tile + lane * ldk, D, dot);
      row_dots(my_do, v_tile + lane * ldv, Dv, dp);
    }
    float ds[kRows];
    unsigned live[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int64_t i = row0 + r;
      const float s = key_in_tile && i < p.Nq ? masked_score<scalar_t>(p, dot[r], b, h, i, j) : -INFINITY;
      live[r] = __ballot_sync(kFullWarp, s != -INFINITY);
      const float prob = expf(s - row_lse[r]);  // lse = +inf on rows with no allowed key: 0
      const float f = p.dropout.active() && s != -INFINITY ? p.dropout.factor(p.dropout.row_key(bh, p.Nq, i), j)
                                                           : 1.f;
      ds[r] = prob * (dp[r] * f - row_delta[r]);
      // dS out (the lanes write consecutive keys); disallowed pairs 0 whatever dP holds there
      if (ds_out != nullptr && key_in_tile && i < p.Nq) {
        const int64_t at = (bh * p.Nq + i) * p.Nk + j;
        const float value = s != -INFINITY ? ds[r] : 0.f;
        if (p.mask_is_float32) {  // dS in the mask's dtype (new_dmask)
          static_cast<float*>(ds_out)[at] = value;
        } else {
          static_cast<scalar_t*>(ds_out)[at] = static_cast<scalar_t>(value);
        }
      }
    }
    accumulate_tile(acc, ds, live, k_tile, ldk, D, tile, lane);
  }
  if (row0 >= p.Nq) return;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t i = row0 + r;
    if (i >= p.Nq) break;
    scalar_t* g = dq + b * dqs.sb + h * dqs.sh + i * dqs.sn;
#pragma unroll
    for (int t = 0; t < kDims; ++t) {
      const int d = lane + 32 * t;
      if (d < D) g[d] = static_cast<scalar_t>(acc[r][t] * p.scale);
    }
  }
}

template <typename scalar_t, int kDims>
__global__ void __launch_bounds__(kThreads)
    attention_bwd_dkdv_kernel(const Problem p, const scalar_t* __restrict__ q, Layout qs,
                              const scalar_t* __restrict__ k, Layout ks, const scalar_t* __restrict__ v, Layout vs,
                              const scalar_t* __restrict__ dout, Layout dos, const float* __restrict__ lse,
                              const float* __restrict__ delta, scalar_t* __restrict__ dk, Layout dks,
                              scalar_t* __restrict__ dv, Layout dvs, int tile) {
  TF_SHARED_MEMORY(smem);
  const int D = static_cast<int>(p.D), Dv = static_cast<int>(p.Dv), ldq = D + 1, ldo = Dv + 1;
  float* k_rows = smem;                      // kBlockRows x D: the block's keys
  float* v_rows = k_rows + kBlockRows * D;   // kBlockRows x Dv
  float* q_tile = v_rows + kBlockRows * Dv;  // tile x ldq
  float* do_tile = q_tile + tile * ldq;      // tile x ldo
  float* lse_tile = do_tile + tile * ldo;    // tile
  float* delta_tile = lse_tile + tile;       // tile
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n_nblocks = (p.Nk + kBlockRows - 1) / kBlockRows;
  const int64_t bhk = blockIdx.x / n_nblocks, b = bhk / p.Hk, hk = bhk % p.Hk, group = p.H / p.Hk;
  const int64_t j0 = (blockIdx.x % n_nblocks) * kBlockRows;
  const int64_t key0 = j0 + warp * kRows;  // the warp's first key
  const bool* pad = p.pad != nullptr ? p.pad + b * p.Nk : nullptr;
  const float* my_k = k_rows + warp * kRows * D;
  const float* my_v = v_rows + warp * kRows * Dv;
  stage_rows(k + b * ks.sb + hk * ks.sh, ks.sn, j0, p.Nk, kBlockRows, D, pad, k_rows, D);
  stage_rows(v + b * vs.sb + hk * vs.sh, vs.sn, j0, p.Nk, kBlockRows, Dv, pad, v_rows, Dv);

  float dk_acc[kRows][kDims], dv_acc[kRows][kDims];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int t = 0; t < kDims; ++t) dk_acc[r][t] = dv_acc[r][t] = 0.f;
  }
  // Causal: query tiles that end before j0 see none of the block's keys.
  const int64_t i_start = p.causal ? j0 / tile * tile : 0;
  for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
    const int64_t bh = b * p.H + h;
    for (int64_t i0 = i_start; i0 < p.Nq; i0 += tile) {
      __syncthreads();
      stage_rows(q + b * qs.sb + h * qs.sh, qs.sn, i0, p.Nq, tile, D, nullptr, q_tile, ldq);
      stage_rows(dout + b * dos.sb + h * dos.sh, dos.sn, i0, p.Nq, tile, Dv, nullptr, do_tile, ldo);
      for (int r = threadIdx.x; r < tile; r += kThreads) {
        const bool in = i0 + r < p.Nq;
        lse_tile[r] = in ? lse[bh * p.Nq + i0 + r] : INFINITY;
        delta_tile[r] = in ? delta[bh * p.Nq + i0 + r] : 0.f;
      }
      __syncthreads();
      if (key0 >= p.Nk) continue;
      const int64_t i = i0 + lane;
      const bool query_in_tile = lane < tile && i < p.Nq;
      float dot[kRows] = {}, dp[kRows] = {};
      if (query_in_tile) {
        row_dots(my_k, q_tile + lane * ldq, D, dot);
        row_dots(my_v, do_tile + lane * ldo, Dv, dp);
      }
      const float row_lse = query_in_tile ? lse_tile[lane] : INFINITY;
      const float row_delta = query_in_tile ? delta_tile[lane] : 0.f;
      const uint64_t drop_key = p.dropout.active() && query_in_tile ? p.dropout.row_key(bh, p.Nq, i) : 0;
      float ds[kRows], pd[kRows];
      unsigned live[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int64_t j = key0 + r;
        const float s = query_in_tile && j < p.Nk ? masked_score<scalar_t>(p, dot[r], b, h, i, j) : -INFINITY;
        live[r] = __ballot_sync(kFullWarp, s != -INFINITY);
        const float prob = expf(s - row_lse);
        const float f = p.dropout.active() && s != -INFINITY ? p.dropout.factor(drop_key, j) : 1.f;
        ds[r] = prob * (dp[r] * f - row_delta);
        pd[r] = prob * f;
      }
      accumulate_tile(dk_acc, ds, live, q_tile, ldq, D, tile, lane);
      accumulate_tile(dv_acc, pd, live, do_tile, ldo, Dv, tile, lane);
    }
  }
  if (key0 >= p.Nk) return;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t j = key0 + r;
    if (j >= p.Nk) break;
    scalar_t* gk = dk + b * dks.sb + hk * dks.sh + j * dks.sn;
    scalar_t* gv = dv + b * dvs.sb + hk * dvs.sh + j * dvs.sn;
#pragma unroll
    for (int t = 0; t < kDims; ++t) {
      const int d = lane + 32 * t;
      if (d < D) gk[d] = static_cast<scalar_t>(dk_acc[r][t] * p.scale);
      if (d < Dv) gv[d] = static_cast<scalar_t>(dv_acc[r][t]);
    }
  }
}

// -------------------------------------------------------------------------------------------
// Host side: sizes, grids, and the launch sequence, for any launch function
// launch(kernel, blocks, shared_bytes, args...).
// -------------------------------------------------------------------------------------------
// Shared memory of each kernel for a tile of `tile` keys (forward, dQ) or queries (dK/dV).
inline size_t fwd_shared_bytes(const Problem& p, int64_t tile) {
  return sizeof(float) * static_cast<size_t>(tile * (p.D + 1) + tile * (p.Dv + 1) + kBlockRows * p.D);
}

inline size_t dq_shared_bytes(const Problem& p, int64_t tile) {
  return sizeof(float) * static_cast<size_t>(tile * (p.D + 1) + tile * (p.Dv + 1) + kBlockRows * (p.D + p.Dv));
}

inline size_t dkdv_shared_bytes(const Problem& p, int64_t tile) {
  return sizeof(float) * static_cast<size_t>(kBlockRows * (p.D + p.Dv) + tile * (p.D + 1) + tile * (p.Dv + 1) + 2 * tile);
}

inline int64_t grid_size(int64_t blocks, const char* what) {
  TORCH_CHECK(blocks <= INT_MAX, what, ": too many thread blocks (", blocks, ")");
  return blocks;
}

// Calls fn(scalar_t{}, std::integral_constant<int, kDims>{}) for the dtype and head dims.
template <typename Fn>
void dispatch(const char* what, const Problem& p, at::ScalarType dtype, Fn&& fn) {
  const int64_t dims = std::max(p.D, p.Dv);
  TORCH_CHECK(dims <= kMaxHeadDim, what, ": head dims up to ", kMaxHeadDim, " on CUDA, got ", dims);
  auto with_dims = [&](auto tag) {
    if (dims <= 32) return fn(tag, std::integral_constant<int, 1>{});
    if (dims <= 64) return fn(tag, std::integral_constant<int, 2>{});
    if (dims <= 128) return fn(tag, std::integral_constant<int, 4>{});
    return fn(tag, std::integral_constant<int, 8>{});
  };
  switch (dtype) {
    case at::kFloat: return with_dims(float{});
    case at::kBFloat16: return with_dims(c10::BFloat16{});
    case at::kHalf: return with_dims(c10::Half{});
    default: TORCH_CHECK(false, what, ": unsupported dtype ", dtype, " (float32, bfloat16, float16)");
  }
}

// out (B, H, Nq, Dv) with a unit last-dim stride; lse (B, H, Nq) contiguous.
template <typename Launch>
void run_forward(const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                 at::Tensor& lse, int tile, Launch&& launch) {
  const int64_t blocks = grid_size((p.Nq + kBlockRows - 1) / kBlockRows * p.B * p.H, "attention_forward");
  dispatch("attention_forward", p, q.scalar_type(), [&](auto tag, auto dims) {
    using scalar_t = decltype(tag);
    launch(attention_fwd_kernel<scalar_t, decltype(dims)::value>, blocks, fwd_shared_bytes(p, tile), p,
           q.data_ptr<scalar_t>(), layout_of(q), k.data_ptr<scalar_t>(), layout_of(k), v.data_ptr<scalar_t>(),
           layout_of(v), out.data_ptr<scalar_t>(), layout_of(out), lse.data_ptr<float>(), tile);
  });
}

// delta (B, H, Nq) fp32 scratch; dq, dk, dv with unit last-dim strides; dmask undefined (no dS wanted) or
// (B, H, Nq, Nk) contiguous and zero-filled (the dQ kernel writes dS where it visits: all but the
// key tiles past the causal diagonal).
template <typename Launch>
void run_backward(const Problem& p, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, at::Tensor& delta, at::Tensor& dq,
                  at::Tensor& dk, at::Tensor& dv, at::Tensor& dmask, int dq_tile, int dkdv_tile, Launch&& launch) {
  const int64_t delta_blocks = grid_size((p.B * p.H * p.Nq + kWarps - 1) / kWarps, "attention_backward");
  const int64_t dq_blocks = grid_size((p.Nq + kBlockRows - 1) / kBlockRows * p.B * p.H, "attention_backward");
  const int64_t dkdv_blocks = grid_size((p.Nk + kBlockRows - 1) / kBlockRows * p.B * p.Hk, "attention_backward");
  dispatch("attention_backward", p, q.scalar_type(), [&](auto tag, auto dims) {
    using scalar_t = decltype(tag);
    constexpr int kDims = decltype(dims)::value;
    const float* lse_data = lse.data_ptr<float>();
    float* delta_data = delta.data_ptr<float>();
    launch(attention_bwd_delta_kernel<scalar_t>, delta_blocks, 0, p, dout.data_ptr<scalar_t>(), layout_of(dout),
           out.data_ptr<scalar_t>(), layout_of(out), delta_data);
    launch(attention_bwd_dq_kernel<scalar_t, kDims>, dq_blocks, dq_shared_bytes(p, dq_tile), p,
           q.data_ptr<scalar_t>(), layout_of(q), k.data_ptr<scalar_t>(), layout_of(k), v.data_ptr<scalar_t>(),
           layout_of(v), dout.data_ptr<scalar_t>(), layout_of(dout), lse_data, static_cast<const float*>(delta_data),
           dq.data_ptr<scalar_t>(), layout_of(dq), dmask.defined() ? dmask.data_ptr() : nullptr, dq_tile);
    launch(attention_bwd_dkdv_kernel<scalar_t, kDims>, dkdv_blocks, dkdv_shared_bytes(p, dkdv_tile), p,
           q.data_ptr<scalar_t>(), layout_of(q), k.data_ptr<scalar_t>(), layout_of(k), v.data_ptr<scalar_t>(),
           layout_of(v), dout.data_ptr<scalar_t>(), layout_of(dout), lse_data, static_cast<const float*>(delta_data),
           dk.data_ptr<scalar_t>(), layout_of(dk), dv.data_ptr<scalar_t>(), layout_of(dv), dkdv_tile);
  });
}

}  // namespace cuda_kernels
}  // namespace transformer_fast
