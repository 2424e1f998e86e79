// kvq/cpu/value_int8.hpp — value accumulation on the codes with int8 weights for the
// CPU decode (ValueAccumulation::int8_weights).
//
// Group g of value row j (s_jg, lo_jg, codes c_j) dequantizes to v̂_j = s_jg·c_j + lo_jg.
// With the code midpoint μ = 2^(b−1), for the softmax weights p_rj of query row r over a
// block of n ≤ 32 tokens, on the elements of group g,
//   Σ_j p_rj·v̂_j = Σ_j w_rjg·(c_j − μ) + [Σ_j p_rj·lo_jg + μ·Σ_j w_rjg],  w_rjg = p_rj·s_jg
// The weights are quantized per row, group and block to unsigned 8 bits:
//   σ_rg = max_j w_rjg / 255,  w8_rjg = round(w_rjg / σ_rg) ∈ [0, 255]
// and Σ_j w8_rjg·(c_j − μ) is summed exactly in int32: vpdpbusd (u8 weights × s8 codes)
// over four tokens per lane with AVX-512 VNNI + VBMI (vpermb puts four tokens' bytes in
// one lane), vpmaddubsw + vpmaddwd with AVX2 (codes ≤ 4 bits), plain loops otherwise.
// All give the same integers and share the float code, so within one build the SIMD and
// portable paths agree bit for bit (across builds, only FMA contraction may differ). Then
//   acc_r += σ_rg·isum_r + bias_rg   (bias_rg: the bracket above, in fp32)
// The only approximation is w → σ·w8: |w_rjg − σ_rg·w8_rjg| ≤ σ_rg/2, so per block an
// accumulator lane moves by at most σ_rg/2·Σ_j |c_j − μ| ≤ n·σ_rg/2·μ. The weights keep
// 8 bits relative to the block's largest, about what 8-bit values keep, so this is meant
// for 2- and 4-bit values, where it adds a few percent of the cache's own error
// (tests/cpu/test_value_int8.cpp). A negative or non-finite weight (a scale no quantizer
// writes, or NaN/Inf metadata) sends the block to the fp32 path.
//
// Codes stay packed as stored; slab k of byte i (bits [k·b, (k+1)·b)) is element
// k·(D·b/8) + i of the slab order, which is the order of the decode's accumulators, and
// byte i belongs to group i / (G·b/8). Needs G·b/8 a multiple of 16 bytes, so that each
// 16-byte step is in one group (every kvq preset: value groups of 128, or head_dim).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvq/core/config.hpp"
#include "kvq/cpu/isa.hpp"
#include "kvq/cpu/tile.hpp"

namespace kvq::detail {

template <int Bits, int G, int D>
constexpr bool int8_values_supported() {
  return D % G == 0 && (G * Bits / 8) % 16 == 0;
}

// One block's 8-bit weights and integer sums for up to kMaxRowsPerPass query rows.
template <int Bits, int G, int D>
struct Int8ValueBlock {
  static constexpr int kRowBytes = D * Bits / 8, kGroupBytes = G * Bits / 8, kGroups = D / G, kSlabs = 8 / Bits;
  static constexpr unsigned kMask = (1u << Bits) - 1u;
  static_assert(int8_values_supported<Bits, G, D>(), "kvq: int8 value weights need group·bits/8 a multiple of 16");

  static constexpr int kMid = 1 << (Bits - 1);

  alignas(64) std::uint8_t w8[kMaxRowsPerPass][kGroups][kTokensPerBlock];  // zero past n
  float sigma[kMaxRowsPerPass][kGroups];
  float bias[kMaxRowsPerPass][kGroups];
  std::int32_t w8_sum[kMaxRowsPerPass][kGroups];
  alignas(64) std::int32_t isum[kMaxRowsPerPass][D];  // slab order

  // p [rows_padded][32] softmax weights, scale/lo [kGroups][32] the block's decoded
  // metadata, all zero past the block's n tokens (and p in rows past the pass). False
  // when a weight is negative or a weight or bias is not finite: the caller then takes
  // the fp32 path, which defines what such values do.
  // The loops run over 8 fixed lanes, so the summation order does not depend on the
  // vector width.
  bool set_weights(const float (*p)[kTokensPerBlock], int rows_padded, const float (*scale)[kTokensPerBlock],
                   const float (*lo)[kTokensPerBlock]) {
    constexpr int L = 8;
    bool usable = true;
    for (int r = 0; r < rows_padded; ++r)
      for (int g = 0; g < kGroups; ++g) {
        alignas(32) float w[kTokensPerBlock];
        float largest[L] = {}, smallest[L] = {}, w_sum[L] = {}, lo_sum[L] = {};
        for (int j0 = 0; j0 < kTokensPerBlock; j0 += L)
          for (int k = 0; k < L; ++k) {
            const float x = p[r][j0 + k] * scale[g][j0 + k];
            w[j0 + k] = x;
            largest[k] = x > largest[k] ? x : largest[k];
            smallest[k] = x < smallest[k] ? x : smallest[k];
            w_sum[k] += x;  // NaN and ±Inf weights make it non-finite
            lo_sum[k] += p[r][j0 + k] * lo[g][j0 + k];
          }
        for (int k = 1; k < L; ++k) {
          largest[0] = largest[k] > largest[0] ? largest[k] : largest[0];
          smallest[0] = smallest[k] < smallest[0] ? smallest[k] : smallest[0];
        }
        const float b = sum_lanes8(lo_sum) + float(kMid) * sum_lanes8(w_sum);
        usable = usable && smallest[0] >= 0.f && b - b == 0.f;
        const float inv = largest[0] > 0.f ? 255.f / largest[0] : 0.f;
        sigma[r][g] = largest[0] / 255.f;
        bias[r][g] = b;
        std::int32_t total = 0;
        for (int j = 0; j < kTokensPerBlock; ++j) {
          const float x = std::min(255.f, std::max(0.f, w[j] * inv));
          w8[r][g][j] = static_cast<std::uint8_t>(static_cast<std::int32_t>(x + 0.5f));
          total += w8[r][g][j];
        }
        w8_sum[r][g] = total;
      }
    return usable;
  }

  // isum[r] = Σ_{j<n} w8[r][g][j]·(c_j − μ) (g of each element) for r < rows_padded,
  // portable loops.
  void accumulate_generic(const std::uint8_t* const* codes, int n, int rows_padded) {
    for (int r = 0; r < rows_padded; ++r) std::fill(isum[r], isum[r] + D, 0);
    for (int j = 0; j < n; ++j)
      for (int r = 0; r < rows_padded; ++r)
        for (int k = 0; k < kSlabs; ++k)
          for (int b = 0; b < kRowBytes; ++b)
            isum[r][k * kRowBytes + b] +=
                w8[r][b / kGroupBytes][j] * (int((unsigned(codes[j][b]) >> (k * Bits)) & kMask) - kMid);
  }

  // The same integers, on the fastest path this translation unit was built with.
  void accumulate(const std::uint8_t* const* codes, int n, int rows_padded) {
#if KVQ_CPU_AVX512_VNNI && KVQ_CPU_AVX512_VBMI
    if (rows_padded == 1) {
      accumulate_vnni<1>(codes, n, 0);
    } else {
      for (int r0 = 0; r0 < rows_padded; r0 += 4) accumulate_vnni<4>(codes, n, r0);
    }
#elif KVQ_CPU_AVX2
    if constexpr (Bits <= 4) {
      accumulate_avx2(codes, n, rows_padded);
    } else {
      accumulate_generic(codes, n, rows_padded);
    }
#else
    accumulate_generic(codes, n, rows_padded);
#endif
  }

  // (a0 + a4) + (a1 + a5) + … in a fixed order.
  static float sum_lanes8(const float* a) {
    return (((a[0] + a[4]) + (a[1] + a[5])) + (a[2] + a[6])) + (a[3] + a[7]);
  }

  // acc [rows_padded][D] (slab order) += σ_rg·isum_r + bias_rg.
  void add_to(float* acc, int rows_padded) const {
    for (int r = 0; r < rows_padded; ++r)
      for (int k = 0; k < kSlabs; ++k)
        for (int g = 0; g < kGroups; ++g) {
          const float sg = sigma[r][g], b = bias[r][g];
          const int i0 = k * kRowBytes + g * kGroupBytes;
          for (int i = i0; i < i0 + kGroupBytes; ++i) acc[r * D + i] += sg * float(isum[r][i]) + b;
        }
  }

 private:
#if KVQ_CPU_AVX512_VNNI && KVQ_CPU_AVX512_VBMI
  // Rows [r0, r0 + RB), 16 code bytes of four tokens per step: one zmm holds the four
  // tokens' 16 bytes, vpermb makes lane u = (t0[u], t1[u], t2[u], t3[u]), and each slab
  // is a shift and a mask away from vpdpbusd with the rows' four u8 weights. Codes below
  // 8 bits are valid s8 as they are, and μ·Σw8 comes off at the end; 8-bit codes
  // become c − 128 by flipping their top bit.
  template <int RB>
  KVQ_FORCE_INLINE void accumulate_vnni(const std::uint8_t* const* codes, int n, int r0) {
    const __m512i quad = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12,  //
                                         59, 43, 27, 11, 58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8,    //
                                         55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4,      //
                                         51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
    const __m512i mask = _mm512_set1_epi8(char(kMask));
    for (int c = 0; c < kRowBytes; c += 16) {
      __m512i acc[RB][kSlabs];
      KVQ_UNROLL for (int r = 0; r < RB; ++r)
        KVQ_UNROLL for (int k = 0; k < kSlabs; ++k) acc[r][k] = _mm512_setzero_si512();
      for (int j = 0; j < n; j += 4) {
        // Tokens past n have weight 0; they read token j's codes.
        const std::uint8_t* t1 = codes[j + 1 < n ? j + 1 : j];
        const std::uint8_t* t2 = codes[j + 2 < n ? j + 2 : j];
        const std::uint8_t* t3 = codes[j + 3 < n ? j + 3 : j];
        __m512i z = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes[j] + c)));
        z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(t1 + c)), 1);
        z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(t2 + c)), 2);
        z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(t3 + c)), 3);
        z = _mm512_maskz_permutexvar_epi8(~__mmask64(0), quad, z);  // the unmasked form warns in GCC 12
        __m512i w[RB];
        KVQ_UNROLL for (int r = 0; r < RB; ++r) {
          std::int32_t four;
          std::memcpy(&four, &w8[r0 + r][c / kGroupBytes][j], sizeof four);
          w[r] = _mm512_set1_epi32(four);
        }
        KVQ_UNROLL for (int k = 0; k < kSlabs; ++k) {
          const __m512i slab = Bits == 8 ? _mm512_xor_si512(z, _mm512_set1_epi8(char(0x80)))
                                         : _mm512_and_si512(k == 0 ? z : _mm512_srli_epi16(z, k * Bits), mask);
          KVQ_UNROLL for (int r = 0; r < RB; ++r) acc[r][k] = _mm512_dpbusd_epi32(acc[r][k], w[r], slab);
        }
      }
      KVQ_UNROLL for (int r = 0; r < RB; ++r) {
        const __m512i offset = _mm512_set1_epi32(Bits == 8 ? 0 : kMid * w8_sum[r0 + r][c / kGroupBytes]);
        KVQ_UNROLL for (int k = 0; k < kSlabs; ++k)
          _mm512_store_si512(reinterpret_cast<__m512i*>(&isum[r0 + r][k * kRowBytes + c]),
                             _mm512_sub_epi32(acc[r][k], offset));
      }
    }
  }
#endif

#if KVQ_CPU_AVX2 && !(KVQ_CPU_AVX512_VNNI && KVQ_CPU_AVX512_VBMI)
  // AVX2, codes of at most 4 bits: the block's codes are first interleaved into
  // quads[q][4i + t] = byte i of token 4q + t (byte unpacks), then per 8 row bytes and
  // slab vpmaddubsw (u8 weights × s8 codes: |pair sum| ≤ 2·255·15, no saturation) and
  // vpmaddwd with ones sum four tokens per int32 lane.
  void accumulate_avx2(const std::uint8_t* const* codes, int n, int rows_padded) {
    alignas(32) std::uint8_t quads[kTokensPerBlock / 4][4 * kRowBytes];
    const int nq = (n + 3) / 4;
    for (int q = 0; q < nq; ++q) {
      const int j = 4 * q;  // tokens past n have weight 0; they read token j's codes
      const std::uint8_t* t[4] = {codes[j], codes[j + 1 < n ? j + 1 : j], codes[j + 2 < n ? j + 2 : j],
                                  codes[j + 3 < n ? j + 3 : j]};
      for (int c = 0; c < kRowBytes; c += 16) {
        __m128i x[4];
        KVQ_UNROLL for (int k = 0; k < 4; ++k) x[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(t[k] + c));
        const __m128i lo01 = _mm_unpacklo_epi8(x[0], x[1]), lo23 = _mm_unpacklo_epi8(x[2], x[3]);
        const __m128i hi01 = _mm_unpackhi_epi8(x[0], x[1]), hi23 = _mm_unpackhi_epi8(x[2], x[3]);
        auto* dst = reinterpret_cast<__m128i*>(quads[q] + 4 * c);
        _mm_store_si128(dst + 0, _mm_unpacklo_epi16(lo01, lo23));
        _mm_store_si128(dst + 1, _mm_unpackhi_epi16(lo01, lo23));
        _mm_store_si128(dst + 2, _mm_unpacklo_epi16(hi01, hi23));
        _mm_store_si128(dst + 3, _mm_unpackhi_epi16(hi01, hi23));
      }
    }
    if (rows_padded == 1) {
      accumulate_quads_avx2<1>(quads, nq, 0);
    } else {
      for (int r0 = 0; r0 < rows_padded; r0 += 4) accumulate_quads_avx2<4>(quads, nq, r0);
    }
  }

  template <int RB>
  KVQ_FORCE_INLINE void accumulate_quads_avx2(const std::uint8_t (*quads)[4 * kRowBytes], int nq, int r0) {
    const __m256i mask = _mm256_set1_epi8(char(kMask)), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < kRowBytes; i += 8) {
      const int g = i / kGroupBytes;
      KVQ_UNROLL for (int k = 0; k < kSlabs; ++k) {
        __m256i acc[RB];
        KVQ_UNROLL for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_si256();
        for (int q = 0; q < nq; ++q) {
          const __m256i y = _mm256_load_si256(reinterpret_cast<const __m256i*>(quads[q] + 4 * i));
          const __m256i slab = _mm256_and_si256(k == 0 ? y : _mm256_srli_epi16(y, k * Bits), mask);
          KVQ_UNROLL for (int r = 0; r < RB; ++r) {
            std::int32_t four;
            std::memcpy(&four, &w8[r0 + r][g][4 * q], sizeof four);
            const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi32(four), slab);
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
          }
        }
        KVQ_UNROLL for (int r = 0; r < RB; ++r)
          _mm256_store_si256(reinterpret_cast<__m256i*>(&isum[r0 + r][k * kRowBytes + i]),
                             _mm256_sub_epi32(acc[r], _mm256_set1_epi32(kMid * w8_sum[r0 + r][g])));
      }
    }
  }
#endif
};

}  // namespace kvq::detail
