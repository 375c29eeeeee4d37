// Softmax attention on the CPU, backward (attention_tiles.h describes the tiles): one pass over
// (batch, key head, range of key blocks). Each task owns the dK, dV of its key blocks (summed over
// the group's query heads, GQA) and accumulates dQ into its own fp32 slice; the slices of the
// key-block ranges are summed in a fixed order afterwards, so the result does not depend on
// scheduling.

#include "cpu_capability.h"  // first: selects at::vec's ISA

#include "attention_tiles.h"
#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace transformer_fast {
namespace cpu_attention {
namespace {

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

}  // namespace
}  // namespace cpu_attention

// Empty problems (B, H, Nq or Nk = 0) give zero gradients and a zero dmask. A head dim of 0 goes
// through the kernel: D = 0 leaves dq and dk empty; Dv = 0 makes dP = dO V^T = 0, so dS, dq and dk
// are 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale, double dropout_p, int64_t seed,
    bool compute_dmask, at::IntArrayRef window, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k, int64_t max_q,
    int64_t max_k) {
  const AttentionExtras x = make_extras(window, softcap, alibi_slopes, std::nullopt, cu_seq_q, cu_seq_k,
                                        std::nullopt, std::nullopt, max_q, max_k, 0);
  TORCH_CHECK_NOT_IMPLEMENTED(!x.any(), "attention_backward (C++ CPU): windows, softcap, ALiBi and packed "
                              "sequences are not implemented yet");
  return attention_backward_entry(
      c10::DeviceType::CPU, dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed,
      compute_dmask,
      [](const Problem& p, const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         const at::Tensor& out, const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
         at::Tensor& dmask) {
        cpu_attention::dispatch_dtype("attention_backward", q.scalar_type(), [&](auto tag) {
          cpu_attention::attention_bwd_kernel<decltype(tag)>(p, dout, q, k, v, out, lse, dq, dk, dv, dmask);
        });
      });
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward_op(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale, double dropout_p, int64_t seed,
    bool compute_dmask, at::IntArrayRef window, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& cu_seq_q, const std::optional<at::Tensor>& cu_seq_k, int64_t max_q,
    int64_t max_k) {
  auto [dq, dk, dv, dmask] = attention_backward(dout, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal,
                                                scale, dropout_p, seed, compute_dmask, window, softcap, alibi_slopes,
                                                cu_seq_q, cu_seq_k, max_q, max_k);
  return {dq, dk, dv, dmask.defined() ? dmask : q.new_empty({0})};  // an op returns no None
}

}  // namespace

TORCH_LIBRARY_IMPL(transformer_fast, CPU, m) {
  m.impl("attention_backward", &attention_backward_op);
}

}  // namespace transformer_fast
