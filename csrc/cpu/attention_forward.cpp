// Softmax attention on the CPU, forward: one task per (sequence, head, block of query rows), which
// runs over the key tiles its rows may attend with an online softmax (attention_tiles.h describes
// the tiles). Decoding with GQA (at most kRowwiseMaxRows queries per sequence) stacks the query rows of
// all the heads that share a key head into one task, so each key and value row is read once per key
// head; with fewer tasks than threads, the keys of a task are split into parts that are merged
// afterwards (attention_decode.h).

#include "cpu/cpu_capability.h"  // first: selects at::vec's ISA

#include "cpu/attention_decode.h"
#include "cpu/attention_sequences.h"
#include "cpu/attention_tiles.h"
#include "ops/attention_ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace transformer_fast {
namespace cpu_attention {
namespace {

// A block of query rows of the heads [h0, h0 + heads) of sequence b.
struct RowBlock {
  int64_t b, h0, i0, cost;
};

template <typename scalar_t>
void attention_fwd_kernel(const Problem& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          at::Tensor& out, at::Tensor& lse) {
  const Blocks blk = forward_blocks<scalar_t>(p), unit = backward_blocks<scalar_t>(p);
  const int64_t BM = blk.m, BN = blk.n, D = p.D, Dv = p.Dv;
  const int64_t group = p.H / p.Hk;
  const ScorePath path = score_path<scalar_t>(p);
  const bool packed = path == ScorePath::kPacked, rowwise = path == ScorePath::kRowwise;
  const int64_t heads = rowwise ? group : 1;  // query heads per task
  const int64_t R = heads * BM;               // rows per task
  // Key tiles start on a multiple of the packed blocks (BN) or of the backward's tiles (unit.n),
  // and end at one (or at the sequence's end): the score products are then made in the backward's
  // units (score_tile).
  const int64_t align = packed ? BN : unit.n;
  const Padding padding = padding_of(p);
  const Operand<const scalar_t> qo = query_operand<const scalar_t>(q, p), ko = key_operand<const scalar_t>(k, p),
                                vo = key_operand<const scalar_t>(v, p);
  const Operand<scalar_t> oo = query_operand<scalar_t>(out, p);
  float* lse_data = lse.data_ptr<float>();
  constexpr bool kLowp = !std::is_same_v<scalar_t, float>;

  // Each sequence's keys that its rows may attend: the band, and the unpadded keys.
  auto keys_of = [&](int64_t b, int64_t i0, int64_t i1) {
    const int64_t nq = p.q_len(b), nk = p.k_len(b);
    auto [lo, hi] = key_range(band_of(p, nq, nk), i0, i1, nk);
    if (padding.any) {
      lo = std::max<int64_t>(lo, padding.first[b]);
      hi = std::min<int64_t>(hi, padding.last[b]);
    }
    return std::pair<int64_t, int64_t>{lo, hi};
  };
  // The row blocks, in (sequence, head, block) order; those of a pack costliest first, so that
  // its long sequences do not start last.
  std::vector<RowBlock> blocks;
  int64_t max_keys = 0;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t nq = p.q_len(b);
    for (int64_t h0 = 0; h0 < p.H; h0 += heads) {
      for (int64_t i0 = 0; i0 < nq; i0 += BM) {
        const auto [lo, hi] = keys_of(b, i0, std::min(nq, i0 + BM));
        max_keys = std::max(max_keys, hi - lo);
        blocks.push_back({b, h0, i0, std::max<int64_t>(hi - lo, 0) * std::min(BM, nq - i0) + 1});
      }
    }
  }
  if (p.packed()) {
    std::stable_sort(blocks.begin(), blocks.end(), [](const RowBlock& a, const RowBlock& c) { return a.cost > c.cost; });
  }
  const int64_t n_blocks = static_cast<int64_t>(blocks.size());
  const int64_t parts = key_parts(p.num_splits, n_blocks, max_keys, align);
  const Partials partials = make_partials(n_blocks, parts, R, Dv);

  // Packed (AMX) products need an even reduction dim: D for Q K^T; P V's runs over the block's keys
  // padded with zeros to packed_reduction.
  // fp32 packs only K^T: its P V product needs no packing (cpu_blas::register_gemm).
  const bool packed_values = packed && kLowp;
  const PackedBlocks<scalar_t> packed_kt = packed ? pack_blocks<scalar_t>(k, BN, true) : PackedBlocks<scalar_t>();
  const PackedBlocks<scalar_t> packed_v =
      packed_values ? pack_blocks<scalar_t>(v, BN, false) : PackedBlocks<scalar_t>();
  if (packed_values) zero_trailing_padded_rows(packed_v, padding, p.Hk, BN, Dv);
  const int64_t ldP = packed_reduction(BN);  // P_lowp's row length: room for the packed product's zeros
  const int64_t ldS = score_columns<scalar_t>(BN);  // S's row length: room for the packed scores' zeros

  parallel_tasks(n_blocks * parts, [&](TaskQueue& tasks) {
    const cpu_blas::SerialGuard serial_blas;
    const cpu_blas::PackedProductsGuard packed_products(packed_values);
    TileBuffer<float> S(R * ldS), acc(R * Dv), m(R), l(R), colsum(BN), drop(BN);
    // Decoding's few rows (rows_times_values) read the value rows in place, and P from S.
    const bool value_tiles = !(rowwise && R <= kFewValueRows);
    TileBuffer<scalar_t> P_lowp(kLowp && value_tiles ? R * ldP : 0), v_scratch(value_tiles ? ldP * Dv : 0);
    TileBuffer<scalar_t> kv_gathered(value_tiles ? BN * std::max(D, Dv) : 0);
    TileBuffer<scalar_t> v_packed(packed_values ? packed_v.size : 0);
    TileBuffer<float> v_float(kLowp && value_tiles ? kShortReduction * Dv : 0);
    TileBuffer<float> q_float(rowwise && kLowp ? R * D : 0), key_float(rowwise && kLowp ? kRowwiseChunk * D : 0);
    std::vector<const float*> q_rows(rowwise ? R : 0);
    std::vector<const scalar_t*> k_rows(rowwise ? BN : 0), v_rows(rowwise ? BN : 0);
    for (int64_t task; tasks.pop(task);) {
      const int64_t bi = task / parts, part = task % parts;
      const RowBlock& rb = blocks[bi];
      const int64_t b = rb.b, h0 = rb.h0, hk = h0 / group, i0 = rb.i0;
      const int64_t nq = p.q_len(b), nk = p.k_len(b), bm = std::min(BM, nq - i0), rows = heads * bm;
      const bool few_rows = rowwise && rows <= kFewValueRows;  // P V by rows_times_values, P in fp32
      const Band band = band_of(p, nq, nk);
      const auto [klo, khi] = keys_of(b, i0, i0 + bm);
      // This part's tiles: [j_begin, j_end), from and to multiples of align (or the last key).
      auto [j_begin, j_end] = part_range(klo / align * align, khi, align, part, parts);
      j_end = std::min(nk, (j_end + align - 1) / align * align);
      std::fill(m.begin(), m.begin() + rows, kNegInf);
      std::fill(l.begin(), l.begin() + rows, 0.f);
      std::fill(acc.begin(), acc.begin() + rows * Dv, 0.f);
      const HeadRows<const scalar_t> krows = ko.at(b, hk), vrows = vo.at(b, hk);
      const scalar_t* qt = qo.at(b, h0).row(i0);
      if (rowwise) {  // the rows of every head of the task, as fp32
        for (int64_t g = 0; g < heads; ++g) {
          const HeadRows<const scalar_t> qh = qo.at(b, h0 + g);
          for (int64_t r = 0; r < bm; ++r) {
            if constexpr (kLowp) {
              float* dst = q_float.data() + (g * bm + r) * D;
              at::vec::convert(qh.row(i0 + r), dst, D);
              q_rows[g * bm + r] = dst;
            } else {
              q_rows[g * bm + r] = qh.row(i0 + r);
            }
          }
        }
      }
      for (int64_t j0 = j_begin; j0 < j_end; j0 += BN) {
        const int64_t tile_keys = std::min(BN, j_end - j0);  // the score product's columns
        uint8_t status = padding.status(b, j0, j0 + tile_keys);
        if (status == kAllPadding) continue;
        // Right padding: the tile ends at the last unpadded key, so its trailing padded keys
        // need no masking, and the tile stays unmasked (P written straight to the product's
        // operand, every value row used: no column sums, no repacking).
        const int64_t bn = status == kSomePadding ? padding.unpadded_prefix(b, j0, j0 + tile_keys) : tile_keys;
        if (bn < tile_keys) status = kNoPadding;
        float s_scale = 1.f;
        if (rowwise) {
          for (int64_t c = 0; c < bn; ++c) k_rows[c] = krows.row(j0 + c);
          rowwise_scores(q_rows.data(), rows, k_rows.data(), bn, D, p.scale, S.data(), ldS, key_float.data());
        } else {
          int64_t ldk;
          const scalar_t* kt = krows.block(j0, tile_keys, D, kv_gathered.data(), &ldk);
          s_scale = score_tile(p, packed, unit, qt, qo.sn, kt, ldk, packed ? packed_kt.at(b * p.Hk + hk, j0 / BN) : nullptr,
                               bm, tile_keys, S.data(), ldS);
        }
        bool masked = false;
        for (int64_t g = 0; g < heads; ++g) {
          masked |= transform_scores<scalar_t>(p, band, S.data() + g * bm * ldS, ldS, bm, bn, {b, h0 + g, i0, j0},
                                               status, nullptr);
        }
        if (masked) std::fill(colsum.begin(), colsum.begin() + bn, 0.f);
        // Unmasked tiles without dropout write P straight into the product's operand, unless the
        // tile is short enough for fp32 products (kShortReduction), which read P from S.
        const bool direct = kLowp && !few_rows && !masked && !p.dropout.active() && bn > kShortReduction;
        for (int64_t r = 0; r < rows; ++r) {
          float* s = S.data() + r * ldS;
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
          // Dropout zeroes the dropped probabilities here and scales the row by 1 / (1 - p) once it
          // is finished (finish_row, in fp32): P enters a bf16/fp16 product with its own values (a
          // lone key's 1 stays 1), so O agrees with the backward's fp32 scaling of dP.
          if (p.dropout.active()) {
            const int64_t h = h0 + r / bm, i = i0 + r % bm;
            p.dropout.factors(p.dropout.row_key(p.lse_index(b, h, i)), j0, bn, 1.f, drop.data());
            for (int64_t c = 0; c < bn; ++c) s[c] *= drop[c];
          }
          if (masked) {
            for (int64_t c = 0; c < bn; ++c) colsum[c] += s[c];
          }
          if (kLowp && !few_rows) {
            if (!direct) convert_row(s, p_row, bn);
            // zeros up to the packed V's whole block (below) and its zero rows
            if (packed_values) std::fill(p_row + bn, p_row + packed_reduction(tile_keys), scalar_t(0));
          }
        }
        UsedKeys used{0, bn, false};
        if (masked) used = used_keys(colsum.data(), bn);
        if (used.hi <= used.lo) continue;
        if (few_rows) {
          for (int64_t c = used.lo; c < used.hi; ++c) v_rows[c] = vrows.row(j0 + c);
          rows_times_values(S.data() + used.lo, ldS, rows, v_rows.data() + used.lo, used.hi - used.lo,
                            masked ? colsum.data() + used.lo : nullptr, Dv, acc.data());
          continue;
        }
        if (packed_values) {
          const scalar_t* vp = used.lo != 0 || used.hi != bn || used.holes
                                   ? pack_used_rows(vrows.row(j0), vrows.stride, Dv, colsum.data(), bn, tile_keys,
                                                    v_scratch.data(), v_packed.data())
                                   : packed_v.at(b * p.Hk + hk, j0 / BN);
          // Over the whole block, also where the tile was cut at its last unpadded key (see
          // packed_reduction).
          cpu_blas::packed_gemm(rows, Dv, packed_reduction(tile_keys), P_lowp.data(), ldP, vp, true, acc.data(), Dv);
          continue;
        }
        int64_t ldv_tile, ldv;
        const scalar_t* v_tile = vrows.block(j0, bn, Dv, kv_gathered.data(), &ldv_tile);
        const scalar_t* vt = used_operand(v_tile, ldv_tile, Dv, colsum.data(), used, v_scratch.data(), &ldv);
        if (kLowp && used.hi - used.lo <= kShortReduction) {  // fp32 P (in S: not direct) times fp32 V
          gemm(false, false, rows, Dv, used.hi - used.lo, 1.f, S.data() + used.lo, ldS,
               rows_as_float(vt, ldv, used.hi - used.lo, Dv, v_float.data()), Dv, 1.f, acc.data(), Dv);
        } else if constexpr (kLowp) {
          gemm(false, false, rows, Dv, used.hi - used.lo, 1.f, P_lowp.data() + used.lo, ldP, vt, ldv, 1.f,
               acc.data(), Dv);
        } else {
          gemm(false, false, rows, Dv, used.hi - used.lo, 1.f, S.data() + used.lo, ldS, vt, ldv, 1.f, acc.data(),
               Dv);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* a = acc.data() + r * Dv;
        const int64_t h = h0 + r / bm, i = i0 + r % bm;
        if (parts > 1) {
          std::copy(a, a + Dv, partials.acc(bi, part, r));
          float* st = partials.stats(bi, part, r);
          st[0] = m[r];
          st[1] = l[r];
          continue;
        }
        lse_data[p.lse_index(b, h, i)] = finish_row(m[r], l[r], a, Dv, p.sinks ? p.sinks[h] : kNegInf,
                                                    p.dropout.inv_keep);
        convert_row(a, oo.at(b, h).row(i), Dv);
      }
    }
  });
  if (parts == 1) return;
  at::parallel_for(0, n_blocks * R, 16, [&](int64_t begin, int64_t end) {
    TileBuffer<float> a(Dv);
    for (int64_t row = begin; row < end; ++row) {
      const RowBlock& rb = blocks[row / R];
      const int64_t r = row % R, bm = std::min(BM, p.q_len(rb.b) - rb.i0);
      if (r >= heads * bm) continue;
      const int64_t h = rb.h0 + r / bm, i = rb.i0 + r % bm;
      const auto [mr, lr] = merge_parts(partials, row / R, r, a.data());
      lse_data[p.lse_index(rb.b, h, i)] = finish_row(mr, lr, a.data(), Dv, p.sinks ? p.sinks[h] : kNegInf,
                                                     p.dropout.inv_keep);
      convert_row(a.data(), oo.at(rb.b, h).row(i), Dv);
    }
  });
}

}  // namespace
}  // namespace cpu_attention

std::tuple<at::Tensor, at::Tensor> attention_forward(const AttentionForwardCall& c) {
  const at::Tensor& q_in = c.q;
  CpuProblem cp = cpu_problem("attention_forward", c.q, c.k, c.v, c.attn_mask, c.key_padding_mask, c.is_causal,
                              c.scale, c.dropout_p, c.seed, c.extras());
  const Problem& p = cp.p;
  at::Tensor out = new_output_in_rows_of(q_in, p.Dv, cp.q.options());
  at::Tensor lse = new_output(cp.lse_sizes(), cp.q.options().dtype(at::kFloat));
  cp.fill_rows_outside_sequences(out, lse);
  if (p.B * p.H == 0 || p.Nq == 0) return {out, lse};
  if (p.Nk == 0) {  // no keys anywhere: every row has none allowed
    cp.fill_keyless(out, lse);
    return {out, lse};
  }
  cpu_attention::dispatch_dtype("attention_forward", cp.q.scalar_type(), [&](auto tag) {
    cpu_attention::attention_fwd_kernel<decltype(tag)>(p, cp.q, cp.k, cp.v, out, lse);
  });
  return {out, lse};
}

bool native_lowp_products(at::ScalarType dtype) {
  TORCH_CHECK_VALUE(dtype == at::kBFloat16 || dtype == at::kHalf, "dtype must be bfloat16 or float16, got ", dtype);
  return dtype == at::kBFloat16 ? cpu_blas::native_lowp_products<at::BFloat16>()
                                : cpu_blas::native_lowp_products<at::Half>();
}

TORCH_LIBRARY_IMPL(transformer_fast, CPU, m) {
  m.impl("attention_forward", TORCH_FN(CallKernel<AttentionForwardCall>::of<&attention_forward>));
}

}  // namespace transformer_fast
