// Softmax attention on the CPU, forward: one task per (batch, head, block of query rows), which
// runs over the key blocks with an online softmax (attention_tiles.h describes the tiles).

#include "cpu_capability.h"  // first: selects at::vec's ISA

#include "attention_tiles.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace transformer_fast {
namespace cpu_attention {
namespace {

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
  const int64_t Dv = p.Dv;
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

}  // namespace
}  // namespace cpu_attention

std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& attn_mask,
    const std::optional<at::Tensor>& key_padding_mask, bool is_causal, double scale, double dropout_p,
    int64_t seed, at::IntArrayRef window, double softcap, const std::optional<at::Tensor>& alibi_slopes,
    const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& cu_seq_q,
    const std::optional<at::Tensor>& cu_seq_k, const std::optional<at::Tensor>& seqused_k,
    const std::optional<at::Tensor>& block_table, int64_t max_q, int64_t max_k, int64_t num_splits) {
  const AttentionExtras x = make_extras(window, softcap, alibi_slopes, sinks, cu_seq_q, cu_seq_k, seqused_k,
                                        block_table, max_q, max_k, num_splits);
  TORCH_CHECK_NOT_IMPLEMENTED(!x.any(), "attention_forward (C++ CPU): windows, softcap, ALiBi, sinks and packed "
                              "sequences are not implemented yet");
  return attention_forward_entry(
      c10::DeviceType::CPU, q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed,
      [](const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
         at::Tensor& lse) {
        cpu_attention::dispatch_dtype("attention_forward", q.scalar_type(), [&](auto tag) {
          cpu_attention::attention_fwd_kernel<decltype(tag)>(p, q, k, v, out, lse);
        });
      });
}

TORCH_LIBRARY_IMPL(transformer_fast, CPU, m) {
  m.impl("attention_forward", &attention_forward);
}

}  // namespace transformer_fast
