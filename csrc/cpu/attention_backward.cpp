// Softmax attention on the CPU, backward (attention_tiles.h describes the tiles): one pass over
// (batch, key head, range of key blocks). Each task owns the dK, dV of its key blocks (summed over
// the group's query heads, GQA) and accumulates dQ into its own fp32 slice; the slices of the
// key-block ranges are summed in a fixed order afterwards, so the result does not depend on
// scheduling. The rows' sum_j P_ij dP_ij (compute_delta) is accumulated the same way.

#include "cpu/cpu_capability.h"  // first: selects at::vec's ISA

#include "cpu/attention_sequences.h"
#include "cpu/attention_tiles.h"
#include "ops/attention_ops.h"
#include "ops/op_utils.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace transformer_fast {
namespace cpu_attention {
namespace {

// Row-major (rows x cols) tile -> its transpose (leading dimension ld_out), in at::vec's 32 x 32
// register blocks; zero columns pad the rows to packed_reduction(rows), the product's reduction.
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
  for (int64_t c = 0; c < cols; ++c) {
    std::fill(dst + c * ld_out + rows, dst + c * ld_out + packed_reduction(rows), scalar_t(0));
  }
}

// A task: the key blocks [n_begin, n_end) of key head hk of sequence b, accumulating dQ into
// slice `slice` of the fp32 dQ buffer.
struct KeyTask {
  int64_t b, hk, n_begin, n_end, slice, cost;
};

template <typename scalar_t>
void attention_bwd_kernel(const Problem& p, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq,
                          at::Tensor& dk, at::Tensor& dv, at::Tensor& dmask, at::Tensor& row_delta) {
  const Blocks blk = backward_blocks<scalar_t>(p);
  const int64_t BM = blk.m, BN = blk.n;
  const Padding padding = padding_of(p);
  const int64_t group = p.H / p.Hk;
  const int64_t D = p.D, Dv = p.Dv;
  constexpr bool kLowp = !std::is_same_v<scalar_t, float>;
  const Operand<const scalar_t> qo = query_operand<const scalar_t>(q, p), doo = query_operand<const scalar_t>(dout, p),
                                oo = query_operand<const scalar_t>(out, p), ko = key_operand<const scalar_t>(k, p),
                                vo = key_operand<const scalar_t>(v, p);
  const Operand<scalar_t> dko = key_operand<scalar_t>(dk, p), dvo = key_operand<scalar_t>(dv, p);
  const float* lse_data = lse.data_ptr<float>();
  const int64_t lse_rows = p.packed() ? p.H * p.Tq : p.B * p.H * p.Nq;  // lse indices
  auto n_key_blocks = [&](int64_t b) { return (p.k_len(b) + BN - 1) / BN; };

  // delta_i = dO_i . O_i (= sum_j P_ij dP_ij, dropout included). Rows whose keys all lie in one
  // tile take sum_j P_ij dP_ij from that tile instead (delta_from_tile): it has no rounding of O,
  // which in bf16/fp16 dominates dS = P (dP - delta) in rows of few keys (dQ/dK up to 3x torch's
  // math with 1-3 keys a row).
  at::Tensor delta = new_tensor({lse_rows}, q.options().dtype(at::kFloat));
  float* delta_data = delta.data_ptr<float>();
  if (p.Nk > BN) at::parallel_for(0, p.B * p.H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / p.H, h = bh % p.H;
      if (n_key_blocks(b) <= 1) continue;
      const HeadRows<const scalar_t> d_rows = doo.at(b, h), o_rows = oo.at(b, h);
      for (int64_t i = 0; i < p.q_len(b); ++i) {
        delta_data[p.lse_index(b, h, i)] = dot_fp32(d_rows.row(i), o_rows.row(i), Dv);
      }
    }
  });

  // The key blocks of each (sequence, key head), split into ranges when there are too few of
  // them to keep every thread busy; each range of a (sequence, key head) has its own dQ slice.
  const int64_t threads = at::get_num_threads();
  int64_t total_blocks = 0;
  for (int64_t b = 0; b < p.B; ++b) total_blocks += p.Hk * n_key_blocks(b);
  const int64_t per_task =
      p.B * p.Hk >= 4 * threads ? std::numeric_limits<int64_t>::max() : std::max<int64_t>(1, total_blocks / (4 * threads));
  std::vector<KeyTask> key_tasks;
  int64_t n_slices = 1;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t nb = n_key_blocks(b);
    const int64_t ranges = per_task >= nb ? 1 : (nb + per_task - 1) / per_task;
    n_slices = std::max(n_slices, ranges);
    for (int64_t hk = 0; hk < p.Hk; ++hk) {
      for (int64_t s = 0; s < ranges; ++s) {
        const int64_t n0 = nb * s / ranges, n1 = nb * (s + 1) / ranges;
        key_tasks.push_back({b, hk, n0, n1, s, (n1 - n0) * p.q_len(b)});
      }
    }
  }
  if (p.packed()) {  // a pack's long sequences first
    std::stable_sort(key_tasks.begin(), key_tasks.end(),
                     [](const KeyTask& a, const KeyTask& c) { return a.cost > c.cost; });
  }
  at::Tensor dq_acc = new_zeros({n_slices, lse_rows, D}, q.options().dtype(at::kFloat));
  float* dq_acc_data = dq_acc.data_ptr<float>();
  // sum_j P_ij dP_ij from the fp32 P and dP of the tiles (compute_delta), by slice as dQ is.
  const bool want_delta = row_delta.defined();
  at::Tensor pdp_acc = want_delta ? new_zeros({n_slices, lse_rows}, q.options().dtype(at::kFloat)) : at::Tensor();
  float* pdp_acc_data = want_delta ? pdp_acc.data_ptr<float>() : nullptr;
  // dS out, (B, H, Nq, Nk) contiguous and zero-filled: the tiles skipped below have dS = 0.
  // In q's dtype, or float32 with a float32 mask (new_dmask): one of the two pointers is set.
  scalar_t* ds_data = dmask.defined() && !p.mask_is_float32 ? dmask.data_ptr<scalar_t>() : nullptr;
  float* ds_f32 = dmask.defined() && p.mask_is_float32 ? dmask.data_ptr<float>() : nullptr;

  // Packed products. bf16/fp16 (AMX): all five B operands packed once (K^T, V^T, K per key
  // block; Q, dO per query block); P^T and dS^T are written transposed. They take no alpha: the
  // softmax scale goes into the exponent (score_tile) and into the final dQ sum (dq_scale).
  // fp32: K^T and V^T only, for S and dP; the other three products need no packing.
  const ScorePath path = score_path<scalar_t>(p);
  const bool rowwise = path == ScorePath::kRowwise;
  const bool packed = path == ScorePath::kPacked && (!kLowp || (Dv % 2 == 0 && packing_pays_off<scalar_t>(p.Nk)));
  const bool packed_updates = packed && kLowp;
  PackedBlocks<scalar_t> packed_kt, packed_vt, packed_k, packed_q, packed_do;
  if (packed) {
    packed_kt = pack_blocks<scalar_t>(k, BN, true);
    packed_vt = pack_blocks<scalar_t>(v, BN, true);
  }
  if (packed_updates) {
    packed_k = pack_blocks<scalar_t>(k, BN, false);
    zero_trailing_padded_rows(packed_k, padding, p.Hk, BN, D);  // (dQ's product; see the forward)
    packed_q = pack_blocks<scalar_t>(q, BM, false);
    packed_do = pack_blocks<scalar_t>(dout, BM, false);
  }
  const float dq_scale = packed_updates ? p.scale : 1.f;
  const int64_t ldP = packed_reduction(BN), ldT = packed_reduction(BM);
  const int64_t ldS = score_columns<scalar_t>(BN);  // S's and dP's rows: room for the packed products' zeros
  const bool softcap = p.softcap > 0.f;

  parallel_tasks(static_cast<int64_t>(key_tasks.size()), [&](TaskQueue& tasks) {
    const cpu_blas::SerialGuard serial_blas;
    const cpu_blas::PackedProductsGuard packed_products(packed_updates);
    TileBuffer<float> S(BM * ldS), dP(BM * ldS), drop(BM * ldS), colsum(BN), dk_acc(BN * D), dv_acc(BN * Dv);
    TileBuffer<float> tanh_tile(softcap ? BM * ldS : 0);
    TileBuffer<scalar_t> P_lowp(kLowp ? BM * ldP : 0), dS_lowp(kLowp ? BM * ldP : 0), k_scratch(ldP * D);
    TileBuffer<scalar_t> PT(packed_updates ? BN * ldT : 0), dST(packed_updates ? BN * ldT : 0),
        k_packed(packed_updates ? packed_k.size : 0);
    TileBuffer<float> q_float(kLowp ? std::max(kShortReduction, rowwise ? BM : 0) * D : 0),
        do_float(kLowp ? kShortReduction * Dv : 0), k_float(kLowp ? kShortReduction * D : 0),
        key_float(rowwise && kLowp ? kRowwiseChunk * D : 0);
    std::vector<const float*> q_rows(rowwise ? BM : 0);
    std::vector<const scalar_t*> k_rows(rowwise ? BN : 0);
    std::vector<uint8_t> keys_in_tile(BM);  // whether a row's keys all lie in this tile
    for (int64_t t; tasks.pop(t);) {
      const KeyTask& task = key_tasks[t];
      const int64_t b = task.b, hk = task.hk, bhk = b * p.Hk + hk;
      const int64_t nq = p.q_len(b), nk = p.k_len(b);
      const Band band = band_of(p, nq, nk);
      const HeadRows<const scalar_t> krows = ko.at(b, hk), vrows = vo.at(b, hk);
      const int64_t ksn = krows.stride, vsn = vrows.stride;
      float* dq_slice = dq_acc_data + task.slice * lse_rows * D;
      float* pdp_slice = want_delta ? pdp_acc_data + task.slice * lse_rows : nullptr;
      for (int64_t n = task.n_begin; n < task.n_end; ++n) {
        const int64_t j0 = n * BN, tile_keys = std::min(BN, nk - j0);  // the score and dP products' columns
        const scalar_t* kb = krows.row(j0);
        const scalar_t* vb = vrows.row(j0);
        uint8_t status = padding.status(b, j0, j0 + tile_keys);
        // Right padding: the block ends at the last unpadded key, as the forward's tile does.
        const int64_t bn = status == kSomePadding ? padding.unpadded_prefix(b, j0, j0 + tile_keys) : tile_keys;
        if (bn < tile_keys) status = kNoPadding;
        std::fill(dk_acc.begin(), dk_acc.end(), 0.f);
        std::fill(dv_acc.begin(), dv_acc.end(), 0.f);
        // The query rows whose band reaches these keys.
        const auto [i_lo, i_hi] = row_range(band, j0, j0 + bn, nq);
        const int64_t mb_begin = std::max<int64_t>(0, i_lo) / BM, mb_end = (i_hi + BM - 1) / BM;
        if (rowwise) {
          for (int64_t c = 0; c < bn; ++c) k_rows[c] = krows.row(j0 + c);
        }
        for (int64_t h = hk * group; h < (hk + 1) * group && status != kAllPadding && i_lo < i_hi; ++h) {
          const HeadRows<const scalar_t> qrows = qo.at(b, h), drows = doo.at(b, h);
          for (int64_t mb = mb_begin; mb < mb_end; ++mb) {
            const int64_t i0 = mb * BM, bm = std::min(BM, nq - i0);
            const scalar_t* qt = qrows.row(i0);
            const scalar_t* dot = drows.row(i0);
            const int64_t qsn = qrows.stride, dsn = drows.stride, row0 = p.lse_index(b, h, i0);
            const float* lse_t = lse_data + row0;
            const float* delta_t = delta_data + row0;
            float s_scale = 1.f;
            if (rowwise) {
              for (int64_t r = 0; r < bm; ++r) {
                if constexpr (kLowp) {
                  at::vec::convert(qt + r * qsn, q_float.data() + r * D, D);
                  q_rows[r] = q_float.data() + r * D;
                } else {
                  q_rows[r] = qt + r * qsn;
                }
              }
              rowwise_scores(q_rows.data(), bm, k_rows.data(), bn, D, p.scale, S.data(), ldS, key_float.data());
            } else {
              s_scale = score_tile(p, packed, blk, qt, qsn, kb, ksn, packed ? packed_kt.at(bhk, n) : nullptr, bm,
                                   tile_keys, S.data(), ldS);
            }
            const bool masked = transform_scores<scalar_t>(p, band, S.data(), ldS, bm, bn, {b, h, i0, j0}, status,
                                                           softcap ? tanh_tile.data() : nullptr);
            bool delta_from_p = false;
            for (int64_t r = 0; r < bm; ++r) {
              const auto [lo, hi] = key_range(band, i0 + r, i0 + r + 1, nk);
              keys_in_tile[r] = lo >= j0 && hi <= j0 + tile_keys;
              delta_from_p |= keys_in_tile[r] != 0;
            }
            // An unmasked tile without dropout uses all its keys: P and dS are then made in one
            // pass after the dP product. Otherwise P comes first, to find the keys in use; so it
            // does where a row's keys fit this one tile, whose P and dP then give its delta, and
            // where the rows' sum_j P_ij dP_ij is wanted.
            const bool fused = !masked && !p.dropout.active() && !delta_from_p && !want_delta;
            UsedKeys used{0, bn, false};
            if (!fused) {
              if (masked) std::fill(colsum.begin(), colsum.begin() + bn, 0.f);
              // P = exp(S - lse) (0 on masked positions and on rows with no allowed key)
              for (int64_t r = 0; r < bm; ++r) {
                float* s = S.data() + r * ldS;
                const Vec shift(lse_t[r]), mult(s_scale);
                at::vec::map([shift, mult](Vec x) { return exp_softmax(at::vec::fmsub(x, mult, shift)); }, s, s, bn);
                if (keys_in_tile[r]) renormalize_row(s, bn, lse_t[r], p.sinks ? p.sinks[h] : kNegInf);
                if (masked) {
                  for (int64_t c = 0; c < bn; ++c) colsum[c] += s[c];
                }
              }
              if (masked) used = used_keys(colsum.data(), bn);
              if (used.hi <= used.lo) continue;
            }
            // dP = dO V^T (garbage in unused keys is discarded below by a select, not a product)
            if (packed) {
              packed_nt_product(blk, bm, tile_keys, Dv, dot, dsn, vb, vsn, packed_vt.at(bhk, n), dP.data(), ldS);
            } else {
              gemm(false, true, bm, bn, Dv, 1.f, dot, dsn, vb, vsn, 0.f, dP.data(), ldS);
            }
            // Pd = P * dropout factor -> dV += Pd^T dO; dS = P * (dP * factor - delta)
            for (int64_t r = 0; r < bm; ++r) {
              float* s = S.data() + r * ldS;
              float* dp = dP.data() + r * ldS;
              float* f = drop.data() + r * ldS;
              if (p.dropout.active()) {
                p.dropout.factors(p.dropout.row_key(row0 + r), j0, bn, p.dropout.inv_keep, f);
                for (int64_t c = 0; c < bn; ++c) dp[c] *= f[c];
              }
              if (fused) {
                p_and_ds(s, dp, bn, s_scale, lse_t[r], delta_t[r]);
              } else {
                const float pdp = keys_in_tile[r] || want_delta ? delta_from_tile(s, dp, bn) : 0.f;
                if (want_delta) pdp_slice[row0 + r] += pdp;
                ds_from_dp(s, dp, bn, keys_in_tile[r] ? pdp : delta_t[r]);  // dP -> dS
              }
              if (ds_data != nullptr) convert_row(dp, ds_data + (row0 + r) * p.Nk + j0, bn);
              if (ds_f32 != nullptr) convert_row(dp, ds_f32 + (row0 + r) * p.Nk + j0, bn);
              if (softcap) softcap_gradient_row(dp, tanh_tile.data() + r * ldS, bn);  // dS of the raw scores
              if (p.dropout.active()) {
                for (int64_t c = 0; c < bn; ++c) s[c] *= f[c];
              }
              if constexpr (kLowp) {
                convert_row(s, P_lowp.data() + r * ldP, bn);
                convert_row(dp, dS_lowp.data() + r * ldP, bn);
                if (packed_updates) {  // zeros up to the packed K's whole block (dQ below) and its zero rows
                  std::fill(dS_lowp.data() + r * ldP + bn, dS_lowp.data() + r * ldP + packed_reduction(tile_keys),
                            scalar_t(0));
                }
              }
            }
            float* dqt = dq_slice + row0 * D;
            if (packed_updates) {
              // dV += P^T dO, dK += dS^T Q (over all bn keys: unused ones have P = dS = 0 and
              // finite operands), dQ += dS K (unscaled; K's unused rows zeroed when there are any)
              const int64_t bh = b * p.H + h;
              transpose_to(P_lowp.data(), ldP, bm, bn, PT.data(), ldT);
              transpose_to(dS_lowp.data(), ldP, bm, bn, dST.data(), ldT);
              cpu_blas::packed_gemm(bn, Dv, packed_reduction(bm), PT.data(), ldT, packed_do.at(bh, mb), true,
                                    dv_acc.data(), Dv);
              cpu_blas::packed_gemm(bn, D, packed_reduction(bm), dST.data(), ldT, packed_q.at(bh, mb), true,
                                    dk_acc.data(), D);
              const scalar_t* kp = used.lo != 0 || used.hi != bn || used.holes
                                       ? pack_used_rows(kb, ksn, D, colsum.data(), bn, tile_keys, k_scratch.data(),
                                                        k_packed.data())
                                       : packed_k.at(bhk, n);
              cpu_blas::packed_gemm(bm, D, packed_reduction(tile_keys), dS_lowp.data(), ldP, kp, true, dqt, D);
              continue;
            }
            const int64_t nu = used.hi - used.lo;
            if (kLowp && bm <= kShortReduction) {  // fp32 P and dS (S, dP) times fp32 dO and Q rows
              gemm(true, false, nu, Dv, bm, 1.f, S.data() + used.lo, ldS,
                   rows_as_float(dot, dsn, bm, Dv, do_float.data()), Dv, 1.f, dv_acc.data() + used.lo * Dv, Dv);
              gemm(true, false, nu, D, bm, 1.f, dP.data() + used.lo, ldS, rows_as_float(qt, qsn, bm, D, q_float.data()),
                   D, 1.f, dk_acc.data() + used.lo * D, D);
            } else if constexpr (kLowp) {
              gemm(true, false, nu, Dv, bm, 1.f, P_lowp.data() + used.lo, ldP, dot, dsn, 1.f,
                   dv_acc.data() + used.lo * Dv, Dv);
              gemm(true, false, nu, D, bm, 1.f, dS_lowp.data() + used.lo, ldP, qt, qsn, 1.f,
                   dk_acc.data() + used.lo * D, D);
            } else {
              gemm(true, false, nu, Dv, bm, 1.f, S.data() + used.lo, ldS, dot, dsn, 1.f, dv_acc.data() + used.lo * Dv,
                   Dv);
              gemm(true, false, nu, D, bm, 1.f, dP.data() + used.lo, ldS, qt, qsn, 1.f, dk_acc.data() + used.lo * D,
                   D);
            }
            // dQ += scale * dS K over the used keys
            int64_t ldk;
            const scalar_t* kt = used_operand(kb, ksn, D, colsum.data(), used, k_scratch.data(), &ldk);
            if (kLowp && nu <= kShortReduction) {
              gemm(false, false, bm, D, nu, p.scale, dP.data() + used.lo, ldS,
                   rows_as_float(kt, ldk, nu, D, k_float.data()), D, 1.f, dqt, D);
            } else if constexpr (kLowp) {
              gemm(false, false, bm, D, nu, p.scale, dS_lowp.data() + used.lo, ldP, kt, ldk, 1.f, dqt, D);
            } else {
              gemm(false, false, bm, D, nu, p.scale, dP.data() + used.lo, ldS, kt, ldk, 1.f, dqt, D);
            }
          }
        }
        const HeadRows<scalar_t> dk_rows = dko.at(b, hk), dv_rows = dvo.at(b, hk);
        for (int64_t c = 0; c < tile_keys; ++c) {  // (dK and dV of the padded keys: 0)
          scale_row(dk_acc.data() + c * D, D, p.scale);
          convert_row(dk_acc.data() + c * D, dk_rows.row(j0 + c), D);
          convert_row(dv_acc.data() + c * Dv, dv_rows.row(j0 + c), Dv);
        }
      }
    }
  });

  // dQ: the slices summed in order, into dq's row of each lse index (dense: lse (B, H, Nq); packed:
  // lse (H, Tq) against dq (Tq, H, D)), through dq's strides (it is laid out as q is).
  scalar_t* dq_data = dq.data_ptr<scalar_t>();
  const int64_t dq_s0 = dq.stride(0), dq_s1 = dq.stride(1), dq_s2 = p.packed() ? 0 : dq.stride(2);
  at::parallel_for(0, lse_rows, 64, [&](int64_t begin, int64_t end) {
    TileBuffer<float> sum(D);
    for (int64_t row = begin; row < end; ++row) {
      std::memcpy(sum.data(), dq_acc_data + row * D, D * sizeof(float));
      for (int64_t s = 1; s < n_slices; ++s) {
        const float* part = dq_acc_data + (s * lse_rows + row) * D;
        for (int64_t d = 0; d < D; ++d) sum[d] += part[d];
      }
      if (dq_scale != 1.f) scale_row(sum.data(), D, dq_scale);
      const int64_t dst = p.packed() ? (row % p.Tq) * dq_s0 + row / p.Tq * dq_s1
                                     : row / (p.H * p.Nq) * dq_s0 + row / p.Nq % p.H * dq_s1 + row % p.Nq * dq_s2;
      convert_row(sum.data(), dq_data + dst, D);
    }
  });
  if (want_delta) {
    at::Tensor delta_rows = row_delta.view({lse_rows});  // sum_out writes through an lvalue
    at::sum_out(delta_rows, pdp_acc, 0);
  }
}

}  // namespace
}  // namespace cpu_attention

// Empty problems (B, H, Nq or Nk = 0) give zero gradients and a zero dmask. A head dim of 0 goes
// through the kernel: D = 0 leaves dq and dk empty; Dv = 0 makes dP = dO V^T = 0, so dS, dq and dk
// are 0. Packed key rows after the last sequence belong to none: their gradients are 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const AttentionBackwardCall& c) {
  const char* fn = "attention_backward";
  const at::Tensor &dout_in = c.dout, &q_in = c.q, &k_in = c.k, &v_in = c.v, &out_in = c.out, &lse_in = c.lse;
  const bool compute_dmask = c.compute_dmask, compute_delta = c.compute_delta;
  const CpuProblem cp = cpu_problem(fn, c.q, c.k, c.v, c.attn_mask, c.key_padding_mask, c.is_causal, c.scale,
                                    c.dropout_p, c.seed, c.extras());
  const Problem& p = cp.p;
  check_shape(fn, "dout", dout_in, cp.out_sizes(p.Dv));
  check_shape(fn, "out", out_in, cp.out_sizes(p.Dv));
  check_shape(fn, "lse", lse_in, cp.lse_sizes());
  TORCH_CHECK(dout_in.device() == cp.q.device() && out_in.device() == cp.q.device() &&
                  lse_in.device() == cp.q.device(),
              fn, ": dout, out and lse must be on q's device ", cp.q.device());
  TORCH_CHECK_VALUE(!compute_dmask || !p.packed(), fn, ": compute_dmask is for dense problems (the attn_mask's "
                    "gradient), not packed sequences");
  const at::Tensor dout = unit_last_stride(dout_in.to(cp.q.scalar_type()));
  const at::Tensor out = unit_last_stride(out_in.to(cp.q.scalar_type()));
  const at::Tensor lse = lse_in.to(at::kFloat).contiguous();
  at::Tensor dq = new_output_in_rows_of(q_in, p.D, cp.q.options());
  at::Tensor dk = new_output_in_rows_of(k_in, p.D, cp.k.options());
  at::Tensor dv = new_output_in_rows_of(v_in, p.Dv, cp.v.options());
  // The kernels skip key blocks that are all padded or outside every row's band.
  at::Tensor dmask = compute_dmask ? new_dmask(p, cp.q) : at::Tensor();
  at::Tensor row_delta = compute_delta ? new_output(cp.lse_sizes(), lse.options()) : at::Tensor();
  if (p.Nq == 0 || p.Nk == 0 || p.B * p.H == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    if (compute_delta) row_delta.zero_();
    return {dq, dk, dv, dmask, row_delta};
  }
  if (p.packed()) {
    const int64_t end = p.cu_seq_k[p.B];
    dk.narrow(0, end, dk.size(0) - end).zero_();
    dv.narrow(0, end, dv.size(0) - end).zero_();
  }
  cpu_attention::dispatch_dtype(fn, cp.q.scalar_type(), [&](auto tag) {
    cpu_attention::attention_bwd_kernel<decltype(tag)>(p, dout, cp.q, cp.k, cp.v, out, lse, dq, dk, dv, dmask,
                                                       row_delta);
  });
  return {dq, dk, dv, dmask, row_delta};
}

namespace {

// The attention_backward op's kernel for this device: attention_backward with the results a call does not
// produce as empty tensors (an op cannot return None).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_cpu_kernel(
    const AttentionBackwardCall& c) {
  auto [dq, dk, dv, dmask, delta] = attention_backward(c);
  return {dq, dk, dv, or_empty(dmask, c.q), or_empty(delta, c.q)};
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fast, CPU, m) {
  m.impl("attention_backward", TORCH_FN(CallKernel<AttentionBackwardCall>::of<&attention_backward_cpu_kernel>));
}

}  // namespace transformer_fast
