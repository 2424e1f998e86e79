// kvq/cpu/quantize.hpp — the append path's row transforms on CPU SIMD: the FWHT of
// Hadamard presets and the group quantizer, bit-identical to the scalar reference
// (kvq/rotation/hadamard.hpp, kvq/core/quantizer.hpp) that CUDA runs too.
//
// Why the results are the same bits: every output element goes through the same
// IEEE operations on the same operands in the same order as in the scalar code, only
// sixteen at a time (no FMA, no reassociation):
//   FWHT      each butterfly is one add and one subtract of the same pair, stage by
//             stage; the ±1 signs and 1/√d are the same single multiplies.
//   min/max   a lane-wise fold with the scalar's select (a < b ? a : b); lanes then
//             combine in any order, which only matters for the sign of a zero
//             extremum: a zero min or max is recomputed by the scalar fold.
//   codes     ⌊(x − lo)·inv + 0.5⌋ as sub, mul, add, round-down, then clamped to
//             [0, levels]; scale, metadata and 1/s are the scalar code's, once per group.
// Clipping policies (a rank selection per group) and groups that are not a multiple
// of 16 keep the scalar path. Without AVX-512 everything is the scalar path; the
// `*_generic` names are that path, always compiled, for tests/cpu to compare against.
#pragma once

#include <cstdint>
#include <cstring>

#include "kvq/core/config.hpp"
#include "kvq/core/packing.hpp"
#include "kvq/core/quantizer.hpp"
#include "kvq/cpu/isa.hpp"
#include "kvq/layout/paged.hpp"
#include "kvq/rotation/hadamard.hpp"
#include "kvq/rotation/params.hpp"
#include "kvq/rotation/transform.hpp"

namespace kvq::cpu {

template <int D>
void hadamard_forward_generic(float* x, std::uint32_t sign_seed) {
  kvq::hadamard_forward<D>(x, sign_seed);
}

template <QuantSpec S, int D>
void quantize_row_generic(const float* x, std::uint8_t* packed, meta_storage_t<S.meta>* meta) {
  kvq::quantize_row<S, D>(x, packed, meta);
}

#if KVQ_CPU_AVX512
namespace detail {

// Masked forms with an explicit source: the plain ones are built on
// _mm512_undefined_*, which GCC 12 reports as maybe-uninitialized under -Wall.
KVQ_FORCE_INLINE __m512 permute_lanes(__m512 x, __m512i idx) { return _mm512_maskz_permutexvar_ps(0xFFFF, idx, x); }

// Butterfly stages with stride h < 16 inside one vector: lanes with bit h clear get
// x[i] + x[i+h], the others x[i−h] − x[i].
template <int H>
KVQ_FORCE_INLINE __m512 butterfly_in_lanes(__m512 x) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 partner = permute_lanes(x, _mm512_xor_si512(lane, _mm512_set1_epi32(H)));
  constexpr __mmask16 kUpper = [] {
    unsigned m = 0;
    for (int i = 0; i < 16; ++i) m |= ((i & H) ? 1u : 0u) << i;
    return __mmask16(m);
  }();
  return _mm512_mask_sub_ps(_mm512_add_ps(x, partner), kUpper, partner, x);
}

// Highest (kMax) or lowest lane. The order of the lanes only matters for the sign of a
// zero, which the caller recomputes.
template <bool kMax>
KVQ_FORCE_INLINE float lanes_extreme(__m512 v) {
  auto pick = [](auto a, auto b) {
    if constexpr (sizeof(a) == 32) return kMax ? _mm256_max_ps(a, b) : _mm256_min_ps(a, b);
    else return kMax ? _mm_max_ps(a, b) : _mm_min_ps(a, b);
  };
  const __m512d d = _mm512_castps_pd(v);
  const __m256 h = pick(_mm256_castpd_ps(_mm512_mask_extractf64x4_pd(_mm256_setzero_pd(), 0xF, d, 0)),
                        _mm256_castpd_ps(_mm512_mask_extractf64x4_pd(_mm256_setzero_pd(), 0xF, d, 1)));
  __m128 q = pick(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = pick(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(pick(q, _mm_movehdup_ps(q)));
}

// Packs 16 codes (int32 lanes, each < 2^Bits) into 16·Bits/8 bytes, little-endian.
template <int Bits>
KVQ_FORCE_INLINE void pack16(__m512i codes, std::uint8_t* out) {
  if constexpr (Bits == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_maskz_cvtepi32_epi8(0xFFFF, codes));
  } else if constexpr (Bits == 4) {
    // Two codes per 16-bit word after narrowing to bytes: b0 | b1 << 4 in the low byte.
    __m128i bytes = _mm512_maskz_cvtepi32_epi8(0xFFFF, codes);
    bytes = _mm_or_si128(bytes, _mm_srli_epi16(bytes, 4));
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi16(0x00FF));
    const __m128i packed = _mm_packus_epi16(low, low);  // 8 bytes
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out), packed);
  } else {
    static_assert(Bits == 2);
    // Four codes per 32-bit word: b0 | b1 << 2 | b2 << 4 | b3 << 6 in the low byte.
    __m128i bytes = _mm512_maskz_cvtepi32_epi8(0xFFFF, codes);
    bytes = _mm_or_si128(bytes, _mm_srli_epi32(bytes, 6));
    bytes = _mm_or_si128(bytes, _mm_srli_epi32(bytes, 12));
    const __m128i packed = _mm_maskz_cvtepi32_epi8(0xF, bytes);  // 4 bytes
    const std::uint32_t word = std::uint32_t(_mm_cvtsi128_si32(packed));
    std::memcpy(out, &word, 4);
  }
}

}  // namespace detail
#endif

// x ← x·D·H/√D in place (kvq::hadamard_forward's bits).
template <int D>
KVQ_FORCE_INLINE void hadamard_forward_fast(float* x, std::uint32_t sign_seed) {
#if KVQ_CPU_AVX512
  if constexpr (D % 16 == 0 && (D & (D - 1)) == 0) {
    constexpr int V = D / 16;
    __m512 v[V];
    KVQ_UNROLL for (int k = 0; k < V; ++k) v[k] = _mm512_loadu_ps(x + 16 * k);
    if (sign_seed != 0) {
      alignas(64) float signs[D];
      for (int i = 0; i < D; ++i) signs[i] = hadamard_sign(sign_seed, i);
      KVQ_UNROLL for (int k = 0; k < V; ++k) v[k] = _mm512_mul_ps(v[k], _mm512_load_ps(signs + 16 * k));
    }
    KVQ_UNROLL for (int k = 0; k < V; ++k) {
      v[k] = detail::butterfly_in_lanes<1>(v[k]);
      v[k] = detail::butterfly_in_lanes<2>(v[k]);
      v[k] = detail::butterfly_in_lanes<4>(v[k]);
      v[k] = detail::butterfly_in_lanes<8>(v[k]);
    }
    for (int h = 1; h < V; h <<= 1)  // strides 16, 32, … between vectors
      for (int i = 0; i < V; i += 2 * h)
        for (int j = i; j < i + h; ++j) {
          const __m512 a = v[j], b = v[j + h];
          v[j] = _mm512_add_ps(a, b);
          v[j + h] = _mm512_sub_ps(a, b);
        }
    const __m512 norm = _mm512_set1_ps(inv_sqrt_pow2(D));
    KVQ_UNROLL for (int k = 0; k < V; ++k) _mm512_storeu_ps(x + 16 * k, _mm512_mul_ps(v[k], norm));
    return;
  }
#endif
  hadamard_forward_generic<D>(x, sign_seed);
}

// n rows of D elements → packed codes and {scale, lo} per group (kvq::quantize_row's
// bits for each row). The rows go phase by phase (ranges, then metadata, then codes)
// so that the long dependency chain of each group (min/max → scale → fp16 round trip →
// 1/s → codes) overlaps with the other groups' instead of running one after another.
//   x[r] : [D] fp32;  packed[r] : [D·bits/8];  meta[r] : [D/G][2]
template <QuantSpec S, int D, int kMaxRows>
KVQ_FORCE_INLINE void quantize_rows_fast(int n, const float* const* x, std::uint8_t* const* packed,
                                         meta_storage_t<S.meta>* const* meta) {
#if KVQ_CPU_AVX512
  constexpr int G = S.group, NG = D / G;
  constexpr bool kClip = S.clips() && clip_rank(G, S.clip_permille) < G - 1;
  if constexpr (!kClip && G % 16 == 0) {
    using Meta = MetaTraits<S.meta>;
    constexpr int V = G / 16, kLevels = S.levels(), kGroupBytes = G * S.bits / 8;
    float lo[kMaxRows * NG], hi[kMaxRows * NG], inv[kMaxRows * NG];
    bool finite[kMaxRows * NG];
    // 1. Ranges: lane-wise min/max over the group's vectors (two chains), then across
    //    lanes. Only a zero extremum's sign depends on that order: it is recomputed in
    //    the scalar order.
    for (int r = 0; r < n; ++r)
      for (int g = 0; g < NG; ++g) {
        const float* xg = x[r] + g * G;
        __m512 lo_v[2], hi_v[2], fin[2];
        KVQ_UNROLL for (int c = 0; c < 2 && c < V; ++c) {
          lo_v[c] = hi_v[c] = _mm512_loadu_ps(xg + 16 * c);
          fin[c] = _mm512_sub_ps(lo_v[c], lo_v[c]);  // 0 for finite x, NaN otherwise
        }
        KVQ_UNROLL for (int k = 2; k < V; ++k) {
          const __m512 v = _mm512_loadu_ps(xg + 16 * k);
          lo_v[k % 2] = _mm512_maskz_min_ps(0xFFFF, lo_v[k % 2], v);
          hi_v[k % 2] = _mm512_maskz_max_ps(0xFFFF, hi_v[k % 2], v);
          fin[k % 2] = _mm512_add_ps(fin[k % 2], _mm512_sub_ps(v, v));
        }
        if constexpr (V > 1) {
          lo_v[0] = _mm512_maskz_min_ps(0xFFFF, lo_v[0], lo_v[1]);
          hi_v[0] = _mm512_maskz_max_ps(0xFFFF, hi_v[0], hi_v[1]);
          fin[0] = _mm512_add_ps(fin[0], fin[1]);
        }
        const int i = r * NG + g;
        finite[i] = _mm512_cmp_ps_mask(fin[0], _mm512_setzero_ps(), _CMP_EQ_OQ) == 0xFFFF;
        lo[i] = detail::lanes_extreme<false>(lo_v[0]);
        hi[i] = detail::lanes_extreme<true>(hi_v[0]);
        if (finite[i] && (lo[i] == 0.f || hi[i] == 0.f)) {
          float l = xg[0], h = xg[0];
          for (int e = 1; e < G; ++e) l = fmin_f(l, xg[e]), h = fmax_f(h, xg[e]);
          lo[i] = l, hi[i] = h;
        }
      }
    // 2. Metadata: scale, stored {s, lo}, and 1/s (0 when s is stored as 0: codes 0).
    for (int r = 0; r < n; ++r)
      for (int g = 0; g < NG; ++g) {
        const int i = r * NG + g;
        meta_storage_t<S.meta>* mg = meta[r] + 2 * g;
        if (!finite[i]) {
          quantize_group<S>(x[r] + g * G, packed[r] + g * kGroupBytes, mg);  // the defined non-finite result
          continue;
        }
        const float scale = div_rn(fmax_f(sub_rn(hi[i], lo[i]), 1e-8f), static_cast<float>(kLevels));
        mg[0] = Meta::encode(scale);
        mg[1] = Meta::encode(lo[i]);
        const float s_stored = Meta::decode(mg[0]);
        lo[i] = Meta::decode(mg[1]);
        inv[i] = s_stored == 0.f ? 0.f : div_rn(1.f, s_stored);
      }
    // 3. Codes: ⌊(x − lo)·inv + 0.5⌋ clamped to [0, levels]; inv = 0 gives 0 everywhere,
    //    the scalar's s = 0 result.
    const __m512 half = _mm512_set1_ps(0.5f), top = _mm512_set1_ps(float(kLevels));
    for (int r = 0; r < n; ++r)
      for (int g = 0; g < NG; ++g) {
        const int i = r * NG + g;
        if (!finite[i]) continue;
        const float* xg = x[r] + g * G;
        std::uint8_t* pg = packed[r] + g * kGroupBytes;
        const __m512 inv_b = _mm512_set1_ps(inv[i]), lo_b = _mm512_set1_ps(lo[i]);
        KVQ_UNROLL for (int k = 0; k < V; ++k) {
          const __m512 t = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(xg + 16 * k), lo_b), inv_b), half);
          __m512 c = _mm512_maskz_roundscale_ps(0xFFFF, t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
          // vmaxps c, 0 is c > 0 ? c : 0, so a NaN (0·∞) becomes 0 as the scalar's !(v > 0) does.
          c = _mm512_maskz_min_ps(0xFFFF, _mm512_maskz_max_ps(0xFFFF, c, _mm512_setzero_ps()), top);
          detail::pack16<S.bits>(_mm512_maskz_cvttps_epi32(0xFFFF, c), pg + k * (16 * S.bits / 8));
        }
      }
    return;
  }
#endif
  for (int r = 0; r < n; ++r) quantize_row_generic<S, D>(x[r], packed[r], meta[r]);
}

// kvq::quantize_token_head on the host, for n ≤ kMaxRows (token, KV head) items at
// once: center and rotate key row k[j] and value row v[j] of KV head heads[j] (in place:
// the rows are overwritten), then quantize them into pages[j], slot slots[j].
template <Policy P, int kMaxRows>
KVQ_FORCE_INLINE void quantize_token_heads_fast(int n, float* const* k, float* const* v, const int* heads,
                                                const int* slots, std::byte* const* pages, const RotationParams& r,
                                                const PageLayout<P>& layout) {
  constexpr int D = P.head_dim;
  float scratch[D];
  auto transform = [&]<QuantSpec S>(float* x, int h, const float* mean, const float* rotation) {
    if constexpr (S.centered)
      for (int i = 0; i < D; ++i) x[i] = sub_rn(x[i], mean[h * D + i]);
    if constexpr (S.rotation == Rotation::hadamard) {
      hadamard_forward_fast<D>(x, S.sign_seed);
    } else {
      kvq::detail::rotate_forward<S, D>(x, kvq::detail::head_rotation<S, D>(rotation, h), scratch);
    }
  };
  std::uint8_t* k_codes[kMaxRows];
  std::uint8_t* v_codes[kMaxRows];
  meta_storage_t<P.key.meta>* k_meta[kMaxRows];
  meta_storage_t<P.value.meta>* v_meta[kMaxRows];
  for (int j = 0; j < n; ++j) {
    transform.template operator()<P.key>(k[j], heads[j], r.key_mean, r.key_rotation);
    transform.template operator()<P.value>(v[j], heads[j], r.value_mean, r.value_rotation);
    k_codes[j] = reinterpret_cast<std::uint8_t*>(layout.key_codes(pages[j], heads[j], slots[j]));
    v_codes[j] = reinterpret_cast<std::uint8_t*>(layout.value_codes(pages[j], heads[j], slots[j]));
    k_meta[j] = reinterpret_cast<meta_storage_t<P.key.meta>*>(layout.key_meta_bytes(pages[j], heads[j], slots[j]));
    v_meta[j] = reinterpret_cast<meta_storage_t<P.value.meta>*>(layout.value_meta_bytes(pages[j], heads[j], slots[j]));
  }
  quantize_rows_fast<P.key, D, kMaxRows>(n, k, k_codes, k_meta);
  quantize_rows_fast<P.value, D, kMaxRows>(n, v, v_codes, v_meta);
}

}  // namespace kvq::cpu
