// kvq/attention/query_int8.hpp — key scoring with integer dot products on the codes
// for the CPU decode (DESIGN §9, KeyScoring::int8_query).
//
// The rotated query q' (already × τ) is quantized per key group g to int8, as llama.cpp's
// q8 × q4 does: σ_g = max_{i∈g}|q'_i| / 127, q8_i = round(q'_i / σ_g). Then
//   logit = Σ_g [ s_g·σ_g·Σ_{i∈g} q8_i·c_i + lo_g·Σ_{i∈g} q'_i ]
// The code products are summed exactly in int32, four bytes per lane: vpdpbusd with
// AVX-512 VNNI, vpmaddubsw + vpmaddwd with AVX2 (codes ≤ 4 bits, so no int16
// saturation), plain loops otherwise — the same integers on every target. The lo term
// uses the exact fp32 sums. The only approximation is q' → σ·q8: |q'_i − σ_g·q8_i| ≤
// σ_g/2, so the logit moves by at most Σ_g s_g·σ_g/2·Σ_{i∈g} c_i.
// Meant for 2- and 4-bit keys: there the attention error it adds is a few percent of the
// cache's own (tests/attention/test_query_int8.cpp); 8-bit keys are as fine as the int8
// query, which then doubles their error.
//
// Codes are unpacked to one byte each in the slab order of decode.hpp
// (slab_position), so each 4-byte lane belongs to one group (group/(8/bits) ≥ 4 bytes).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kvq/attention/tile.hpp"
#include "kvq/core/config.hpp"

#if (defined(__AVX512VNNI__) || defined(__AVX2__)) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

namespace kvq::detail {

// Slab order of b-bit codes: slab k holds bit field k of every byte (see decode.hpp).
template <int Bits, int D>
constexpr int slab_position(int i) {
  constexpr int per_byte = 8 / Bits;
  return (i % per_byte) * (D / per_byte) + i / per_byte;
}

// Group of the 4-byte lane `lane` of a slab-ordered row.
template <int Bits, int G, int D>
constexpr int lane_group(int lane) {
  constexpr int bytes = D * Bits / 8, group_bytes = G * Bits / 8;
  return ((4 * lane) % bytes) / group_bytes;
}

// One packed b-bit row → one code per byte, slab order.
template <int Bits, int D>
KVQ_FORCE_INLINE void unpack_codes_slabs(const std::uint8_t* KVQ_RESTRICT codes, std::uint8_t* KVQ_RESTRICT out) {
  constexpr int per_byte = 8 / Bits, bytes = D / per_byte;
  constexpr unsigned mask = (1u << Bits) - 1u;
  for (int k = 0; k < per_byte; ++k)
    for (int j = 0; j < bytes; ++j) out[k * bytes + j] = std::uint8_t((unsigned(codes[j]) >> (k * Bits)) & mask);
}

// The int8 query rows of one pass and the per-lane factors that turn lane sums into logits.
template <int Bits, int G, int D>
struct Int8Query {
  static constexpr int kGroups = D / G, kLanes = D / 4;
  static_assert(G * Bits / 8 >= 4, "kvq: an int8 lane must not straddle two key groups");
  alignas(64) std::int8_t q8[kMaxRowsPerPass][D];         // slab order
  alignas(64) float lane_scale[kMaxRowsPerPass][kLanes];  // σ_g of each lane's group
  float group_sum[kMaxRowsPerPass][kGroups];              // Σ_{i∈g} q'_i (fp32)

  // Quantizes row r from q' [D] (natural order, already × τ). A non-finite group makes
  // its lanes' factor NaN, so every logit of the row is NaN, as in the fp32 path.
  void set_row(int r, const float* q) {
    for (int g = 0; g < kGroups; ++g) {
      float amax = 0.f, sum = 0.f;
      bool finite = true;
      for (int i = g * G; i < (g + 1) * G; ++i) {
        finite = finite && std::isfinite(q[i]);
        amax = std::max(amax, std::abs(q[i]));
        sum += q[i];
      }
      const float sigma = !finite ? __builtin_nanf("") : amax / 127.f;
      const float inv = amax > 0.f && finite ? 127.f / amax : 0.f;
      for (int i = g * G; i < (g + 1) * G; ++i)
        q8[r][slab_position<Bits, D>(i)] = std::int8_t(finite ? std::nearbyint(q[i] * inv) : 0.f);
      group_sum[r][g] = sum;
      for (int lane = 0; lane < kLanes; ++lane)
        if (lane_group<Bits, G, D>(lane) == g) lane_scale[r][lane] = sigma;
    }
  }

  // logits[r·stride] for r < rows of one token: codes [D] one per byte (slab order),
  // s/lo its group scales and minima.
  void score(const std::uint8_t* KVQ_RESTRICT codes, const float* s, const float* lo, int rows,
             float* KVQ_RESTRICT logits, int stride) const {
    alignas(64) float s_lane[kLanes];
    for (int lane = 0; lane < kLanes; ++lane) s_lane[lane] = s[lane_group<Bits, G, D>(lane)];
    for (int r = 0; r < rows; ++r) {
      float logit = dot_lanes(codes, r, s_lane);
      for (int g = 0; g < kGroups; ++g) logit += lo[g] * group_sum[r][g];
      logits[r * stride] = logit;
    }
  }

 private:
#if (defined(__AVX512VNNI__) || defined(__AVX2__)) && !defined(__CUDACC__)
  static KVQ_FORCE_INLINE float sum_lanes_avx(__m256 f) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
  }
#endif

  // Σ_lane float(Σ_{4 bytes} c·q8)·σ_lane·s_lane for row r.
  KVQ_FORCE_INLINE float dot_lanes(const std::uint8_t* KVQ_RESTRICT c, int r, const float* s_lane) const {
#if defined(__AVX512VNNI__) && defined(__AVX512F__) && !defined(__CUDACC__)
    if constexpr (D % 64 == 0) {
      __m512 f = _mm512_setzero_ps();
      for (int z = 0; z < D / 64; ++z) {
        const __m512i isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(c + 64 * z),
                                                 _mm512_loadu_si512(q8[r] + 64 * z));
        const __m512 factor = _mm512_mul_ps(_mm512_loadu_ps(lane_scale[r] + 16 * z), _mm512_loadu_ps(s_lane + 16 * z));
        // Masked forms with an explicit source: the plain ones use _mm512_undefined_*,
        // which GCC 12 reports as maybe-uninitialized under -Wall.
        f = _mm512_fmadd_ps(_mm512_mask_cvtepi32_ps(_mm512_setzero_ps(), 0xFFFF, isum), factor, f);
      }
      const __m512d fd = _mm512_castps_pd(f);
      const __m256 half = _mm256_add_ps(_mm256_castpd_ps(_mm512_mask_extractf64x4_pd(_mm256_setzero_pd(), 0xF, fd, 0)),
                                        _mm256_castpd_ps(_mm512_mask_extractf64x4_pd(_mm256_setzero_pd(), 0xF, fd, 1)));
      return sum_lanes_avx(half);
    }
#endif
#if defined(__AVX2__) && !defined(__CUDACC__)
    if constexpr (D % 32 == 0 && Bits <= 4) {  // 15·127·2 fits int16: no saturation
      const __m256i ones = _mm256_set1_epi16(1);
      __m256 f = _mm256_setzero_ps();
      for (int z = 0; z < D / 32; ++z) {
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * z)),
                                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8[r] + 32 * z)));
        const __m256i isum = _mm256_madd_epi16(pairs, ones);
        const __m256 factor = _mm256_mul_ps(_mm256_loadu_ps(lane_scale[r] + 8 * z), _mm256_loadu_ps(s_lane + 8 * z));
        f = _mm256_add_ps(f, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), factor));
      }
      return sum_lanes_avx(f);
    }
#endif
    float f = 0.f;
    for (int lane = 0; lane < kLanes; ++lane) {
      std::int32_t isum = 0;
      for (int b = 0; b < 4; ++b) isum += std::int32_t(c[4 * lane + b]) * std::int32_t(q8[r][4 * lane + b]);
      f += float(isum) * (lane_scale[r][lane] * s_lane[lane]);
    }
    return f;
  }
};

}  // namespace kvq::detail
