// kvq/attention/decode.hpp — decode attention over the paged quantized cache (CPU
// reference, DESIGN §4).
//
// For query head j (KV head h) with rotated query q' = q·R_K and quantized token t:
//   logit_t = τ·Σ_g [ s_{t,g}·Σ_{i∈g} q'_i·c_{t,i} + lo_{t,g}·Σ_{i∈g} q'_i ]
// The per-group sums of q' are computed once per query; no dequantized K is formed.
// Values accumulate under an online softmax in fp32 as Σ_t p_t·(s·c + lo) per group;
// then ô = acc/l, o = ô·R_Vᵀ + ν (unless rotated_output), and
// lse = m + ln l + τ·(q·μ_K) so the part merges with un-centered parts.
#pragma once

#include <algorithm>
#include <cmath>

#include "kvq/attention/online.hpp"
#include "kvq/attention/params.hpp"
#include "kvq/attention/softmax.hpp"
#include "kvq/core/packing.hpp"
#include "kvq/core/quantizer.hpp"
#include "kvq/layout/page_table.hpp"
#include "kvq/layout/paged.hpp"
#include "kvq/rotation/transform.hpp"

namespace kvq {

namespace detail {

// Codes of one packed row as floats (exact small integers).
template <int Bits, int D>
KVQ_FORCE_INLINE void unpack_row_to_float(const std::uint8_t* packed, float* out) {
  constexpr int per_byte = 8 / Bits;
  for (int b = 0; b < D / per_byte; ++b) {
    const unsigned byte = packed[b];
    for (int k = 0; k < per_byte; ++k) out[b * per_byte + k] = float((byte >> (k * Bits)) & ((1u << Bits) - 1u));
  }
}

template <Policy P>
Status validate_decode(const ConstPagedCacheView<P>& cache, const PageTableView& table, const RotationParams& r) {
  using enum StatusCode;
  KVQ_CHECK_ARG(cache.pool || cache.num_pages == 0, invalid_argument, "attention: cache pool is null");
  KVQ_CHECK_ARG(table.page_size == cache.layout.page_size, invalid_argument,
                "attention: page table page_size differs from the cache layout's");
  KVQ_RETURN_IF_ERROR(validate_page_table(table, cache.num_pages));
  return validate_rotation_params<P>(r);
}

}  // namespace detail

// Decode attention of a ragged batch over the quantized part of its cache.
// Shapes: see DecodeParams. Writes out/lse for every query row (rows that see no key
// get o = 0, lse = −∞). A NaN group in the cache makes the rows that see it NaN.
template <Policy P, ActivationType QT, ActivationType OT>
Status decode_attention(const ConstPagedCacheView<P>& cache, const PageTableView& table,
                        const DecodeParams<QT, OT>& p, const RotationParams& r = {}) {
  static_assert(check_policy<P>());
  constexpr int D = P.head_dim;
  constexpr int GK = P.key.group, GV = P.value.group;
  constexpr int NK = D / GK, NV = D / GV;
  using Layout = PageLayout<P>;
  using KMeta = MetaTraits<P.key.meta>;
  using VMeta = MetaTraits<P.value.meta>;
  const int hkv = cache.layout.num_kv_heads;
  KVQ_RETURN_IF_ERROR(detail::validate_decode(cache, table, r));
  KVQ_RETURN_IF_ERROR(validate_decode_params(p, table, hkv));
  KVQ_CHECK_ARG(!p.rotated_output || !P.value.centered, StatusCode::invalid_argument,
                "attention: rotated_output needs a policy without value centering");
  const int hq = p.num_qo_heads, group = hq / hkv;
  const float tau = p.scale(D);
  const Layout& L = cache.layout;

  alignas(64) float qrot[detail::kMaxRowsPerPass][D];
  float qsum[detail::kMaxRowsPerPass][NK];
  float shift[detail::kMaxRowsPerPass];
  int limit[detail::kMaxRowsPerPass];
  alignas(64) float acc[detail::kMaxRowsPerPass * D];
  float m[detail::kMaxRowsPerPass], l[detail::kMaxRowsPerPass];
  alignas(64) float codes[D];
  float scratch[D];

  for (int b = 0; b < table.batch_size; ++b) {
    const int q0 = p.q_indptr[b], nq = p.q_indptr[b + 1] - q0;
    const int len = table.seq_len(b);
    const int offset = p.causal_offset ? p.causal_offset[b] : len - nq;
    const int rows_total = nq * group;
    for (int h = 0; h < hkv; ++h) {
      for (int r0 = 0; r0 < rows_total; r0 += detail::kMaxRowsPerPass) {
        const int rows = std::min(detail::kMaxRowsPerPass, rows_total - r0);
        // Row r ↔ (query token i, query head j = h·group + jj).
        for (int rr = 0; rr < rows; ++rr) {
          const int i = (r0 + rr) / group, j = h * group + (r0 + rr) % group;
          const QT* src = p.q + (std::size_t(q0 + i) * hq + j) * D;
          for (int d = 0; d < D; ++d) qrot[rr][d] = to_float(src[d]);
          shift[rr] = transform_query<P>(qrot[rr], h, r, scratch);
          for (int g = 0; g < NK; ++g) {
            float s = 0.f;
            for (int d = 0; d < GK; ++d) s += qrot[rr][g * GK + d];
            qsum[rr][g] = s;
          }
          const long long lim = static_cast<long long>(i) + offset;
          limit[rr] = lim < 0 ? -1 : static_cast<int>(std::min<long long>(lim, len - 1));
        }
        auto key_logits = [&](int t, float* out_logits) {
          const std::byte* page = cache.page(table.page_of(b, t));
          const int slot = t % table.page_size;
          detail::unpack_row_to_float<P.key.bits, D>(reinterpret_cast<const std::uint8_t*>(L.key_codes(page, h, slot)), codes);
          const auto* meta = reinterpret_cast<const meta_storage_t<P.key.meta>*>(L.key_meta_bytes(page, h, slot));
          float s[NK], lo[NK];
          for (int g = 0; g < NK; ++g) {
            s[g] = KMeta::decode(meta[2 * g]);
            lo[g] = KMeta::decode(meta[2 * g + 1]);
          }
          for (int rr = 0; rr < rows; ++rr) {
            float logit = 0.f;
            for (int g = 0; g < NK; ++g)
              logit += s[g] * detail::dot<GK>(qrot[rr] + g * GK, codes + g * GK) + lo[g] * qsum[rr][g];
            out_logits[rr] = tau * logit;
          }
        };
        auto value_acc = [&](int t, const float* pw, float* a) {
          const std::byte* page = cache.page(table.page_of(b, t));
          const int slot = t % table.page_size;
          detail::unpack_row_to_float<P.value.bits, D>(reinterpret_cast<const std::uint8_t*>(L.value_codes(page, h, slot)), codes);
          const auto* meta = reinterpret_cast<const meta_storage_t<P.value.meta>*>(L.value_meta_bytes(page, h, slot));
          float s[NV], lo[NV];
          for (int g = 0; g < NV; ++g) {
            s[g] = VMeta::decode(meta[2 * g]);
            lo[g] = VMeta::decode(meta[2 * g + 1]);
          }
          for (int rr = 0; rr < rows; ++rr) {
            if (pw[rr] == 0.f) continue;
            float* ar = a + rr * D;
            for (int g = 0; g < NV; ++g) {
              const float ps = pw[rr] * s[g], pl = pw[rr] * lo[g];
              for (int d = 0; d < GV; ++d) ar[g * GV + d] += ps * codes[g * GV + d] + pl;
            }
          }
        };
        detail::attend_part<D>(len, rows, limit, acc, m, l, key_logits, value_acc);
        // Normalize, return to the original basis, write.
        for (int rr = 0; rr < rows; ++rr) {
          const int i = (r0 + rr) / group, j = h * group + (r0 + rr) % group;
          float* o = acc + rr * D;
          const bool empty = l[rr] == 0.f;
          const float inv_l = empty ? 0.f : 1.f / l[rr];
          for (int d = 0; d < D; ++d) o[d] *= inv_l;
          if (!empty && !p.rotated_output) untransform_output<P>(o, h, r, scratch);
          OT* dst = p.out + (std::size_t(q0 + i) * hq + j) * D;
          for (int d = 0; d < D; ++d) dst[d] = from_float<OT>(o[d]);
          if (p.lse) p.lse[std::size_t(q0 + i) * hq + j] = empty ? neg_inf_f() : m[rr] + std::log(l[rr]) + tau * shift[rr];
        }
      }
    }
  }
  return {};
}

}  // namespace kvq
