// kvq/cpu/value_int8.hpp — value accumulation on the codes with int8 weights for the
// CPU decode (ValueAccumulation::int8_weights).
//
// Group g of value row j (s_jg, lo_jg, codes c_j) dequantizes to v̂_j = s_jg·c_j + lo_jg.
// With the code midpoint μ = 2^(b−1), for the softmax weights p_rj of query row r over a
// block of n ≤ kTokensPerBlock tokens, on the elements of group g,
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
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvq/core/config.hpp"
#include "kvq/core/quantizer.hpp"
#include "kvq/cpu/code_fields.hpp"
#include "kvq/cpu/isa.hpp"
#include "kvq/cpu/tile.hpp"

namespace kvq::detail {

// Int8ValueBlock::accumulate_add's default between-steps hook: nothing.
struct NoBetween {
  KVQ_FORCE_INLINE void operator()() const {}
};

template <int Bits, int G, int D>
constexpr bool int8_values_supported() {
  return D % G == 0 && (G * Bits / 8) % 16 == 0;
}

// scale[g][j], lo[g][j] for j < kTokensPerBlock from a block's stored value metadata
// raw [kTokensPerBlock][2·kGroups] ({scale, lo} per group, zero past the block's n).
// One group per row (every preset with value groups of head_dim) decodes 16 tokens per
// step with AVX-512, 8 with AVX2 + F16C; the conversions are exact, so every path gives
// the same floats.
template <MetaType M, int kGroups>
KVQ_FORCE_INLINE void decode_meta_block(const meta_storage_t<M> (*raw)[2 * kGroups], float (*scale)[kTokensPerBlock],
                                        float (*lo)[kTokensPerBlock]) {
#if KVQ_CPU_AVX512 && KVQ_CPU_F16C
  if constexpr (kGroups == 1 && M != MetaType::fp32) {
    for (int j = 0; j < kTokensPerBlock; j += 16) {
      const __m512i pairs = _mm512_loadu_si512(&raw[j][0]);  // 16 × (scale, lo) 16-bit pairs
      if constexpr (M == MetaType::fp16) {
        // Masked forms with an explicit source (GCC 12 warns on the _undefined_ ones).
        const __m256i s16 = _mm512_maskz_cvtepi32_epi16(0xFFFF, pairs);
        const __m256i lo16 = _mm512_maskz_cvtepi32_epi16(0xFFFF, _mm512_maskz_srli_epi32(0xFFFF, pairs, 16));
        _mm512_storeu_ps(&scale[0][j], _mm512_maskz_cvtph_ps(0xFFFF, s16));
        _mm512_storeu_ps(&lo[0][j], _mm512_maskz_cvtph_ps(0xFFFF, lo16));
      } else {  // bf16: the high half of an fp32
        _mm512_storeu_ps(&scale[0][j], _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, pairs, 16)));
        _mm512_storeu_ps(&lo[0][j], _mm512_castsi512_ps(_mm512_maskz_and_epi32(0xFFFF, pairs, _mm512_set1_epi32(int(0xFFFF0000u)))));
      }
    }
    return;
  }
#elif KVQ_CPU_AVX2 && KVQ_CPU_F16C
  if constexpr (kGroups == 1 && M != MetaType::fp32) {  // 8 tokens per step
    const __m256i low_words = _mm256_set1_epi32(0xFFFF);
    for (int j = 0; j < kTokensPerBlock; j += 8) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&raw[j][0]));  // 8 × (scale, lo)
      if constexpr (M == MetaType::fp16) {
        // Each pair's half as a dword, packed to words (lanes 0–3 and 8–11), then the two
        // 64-bit quarters that hold them side by side.
        auto halves = [](__m256i dwords) {
          return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(dwords, dwords), 0x08));
        };
        _mm256_storeu_ps(&scale[0][j], _mm256_cvtph_ps(halves(_mm256_and_si256(pairs, low_words))));
        _mm256_storeu_ps(&lo[0][j], _mm256_cvtph_ps(halves(_mm256_srli_epi32(pairs, 16))));
      } else {  // bf16: the high half of an fp32
        _mm256_storeu_ps(&scale[0][j], _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)));
        _mm256_storeu_ps(&lo[0][j], _mm256_castsi256_ps(_mm256_andnot_si256(low_words, pairs)));
      }
    }
    return;
  }
#endif
  for (int g = 0; g < kGroups; ++g)
    for (int j = 0; j < kTokensPerBlock; ++j) {
      scale[g][j] = MetaTraits<M>::decode(raw[j][2 * g]);
      lo[g][j] = MetaTraits<M>::decode(raw[j][2 * g + 1]);
    }
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

  // p [rows_padded][kTokensPerBlock] softmax weights, scale/lo [kGroups][kTokensPerBlock]
  // the block's decoded metadata, all zero past the block's n tokens (and p in rows past
  // the pass). False when a weight is negative or a weight or bias is not finite: the
  // caller then takes the fp32 path, which defines what such values do.
  // Sixteen fixed lanes (lane k holds tokens k, k + 16, k + 32, …, folded in that order),
  // whatever the target's vector width, so every build sums in the same order.
  static constexpr int kLaneTokens = kTokensPerBlock / 16;  // tokens per lane
  bool set_weights(const float (*p)[kTokensPerBlock], int rows_padded, const float (*scale)[kTokensPerBlock],
                   const float (*lo)[kTokensPerBlock]) {
    static_assert(kTokensPerBlock % 16 == 0);
#if KVQ_GNU_HOST && KVQ_CPU_AVX512
    bool usable = true;
    for (int g = 0; g < kGroups; ++g)
      for (int r0 = 0; r0 < rows_padded; r0 += 4)
        usable = set_weights_rows4(p, r0, std::min(4, rows_padded - r0), g, scale[g], lo[g]) && usable;
    return usable;
#elif KVQ_GNU_HOST && KVQ_CPU_AVX2
    bool usable = true;
    for (int r = 0; r < rows_padded; ++r)
      for (int g = 0; g < kGroups; ++g) usable = set_group_weights_avx2(p[r], scale[g], lo[g], r, g) && usable;
    return usable;
#else
    return set_weights_generic(p, rows_padded, scale, lo);
#endif
  }

  // set_weights in portable loops: the same w8, σ, bias and Σw8 for usable blocks (the
  // SIMD path leaves w8 unspecified when it returns false).
  bool set_weights_generic(const float (*p)[kTokensPerBlock], int rows_padded, const float (*scale)[kTokensPerBlock],
                           const float (*lo)[kTokensPerBlock]) {
    bool usable = true;
    for (int r = 0; r < rows_padded; ++r)
      for (int g = 0; g < kGroups; ++g) usable = set_group_weights(p[r], scale[g], lo[g], r, g) && usable;
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
      accumulate_vnni<1>(codes, n, 0, nullptr);
    } else {
      for (int r0 = 0; r0 < rows_padded; r0 += 4) accumulate_vnni<4>(codes, n, r0, nullptr);
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

  // accumulate then add_to: with AVX-512 VNNI + VBMI in one pass, each integer sum going
  // into acc from registers (the same expression as add_to's, so the same floats), and
  // between() called before each kBetweenTokens tokens of each pass over the rows and
  // 16-byte columns (between_calls of them; the decode asks for the next block's lines
  // there, kvq/cpu/tile.hpp's PrefetchQueue). Other paths do not call it.
  static constexpr int kBetweenTokens = 16;
  static constexpr int between_calls(int n, int rows_padded) {
#if KVQ_CPU_AVX512_VNNI && KVQ_CPU_AVX512_VBMI
    return (rows_padded == 1 ? 1 : rows_padded / 4) * (kRowBytes / 16) * ((n + kBetweenTokens - 1) / kBetweenTokens);
#else
    (void)n, (void)rows_padded;
    return 0;
#endif
  }
  template <class Between = NoBetween>
  void accumulate_add(const std::uint8_t* const* codes, int n, int rows_padded, float* acc, Between between = {}) {
#if KVQ_CPU_AVX512_VNNI && KVQ_CPU_AVX512_VBMI
    if (rows_padded == 1) {
      accumulate_vnni<1>(codes, n, 0, acc, between);
    } else {
      for (int r0 = 0; r0 < rows_padded; r0 += 4) accumulate_vnni<4>(codes, n, r0, acc, between);
    }
#else
    (void)between;
    accumulate(codes, n, rows_padded);
    add_to(acc, rows_padded);
#endif
  }

  // acc [rows_padded][D] (slab order) += σ_rg·isum_r + bias_rg, a vector at a time (a
  // group's run of bytes is a multiple of 16; each element is computed on its own).
  void add_to(float* acc, int rows_padded) const {
    for (int r = 0; r < rows_padded; ++r)
      for (int k = 0; k < kSlabs; ++k)
        for (int g = 0; g < kGroups; ++g) {
          const float sg = sigma[r][g], b = bias[r][g];
          const int i0 = k * kRowBytes + g * kGroupBytes;
#if KVQ_GNU_HOST
          constexpr int W = kNativeFloatLanes;
          using Ints = typename GnuVec<std::int32_t, W>::type;
          for (int i = i0; i < i0 + kGroupBytes; i += W) {
            Ints x;
            std::memcpy(&x, &isum[r][i], sizeof x);
            store_vec<W>(acc + r * D + i, load_vec<W>(acc + r * D + i) + (sg * __builtin_convertvector(x, FloatVec<W>) + b));
          }
#else
          for (int i = i0; i < i0 + kGroupBytes; ++i) acc[r * D + i] += sg * float(isum[r][i]) + b;
#endif
        }
  }

 private:
  // Lane folds of the portable set_weights by halving (lane k with lane k + w), the order
  // of sum_lanes.
  template <bool kMax>
  static float fold_lanes16(const float* a) {
    float m[16];
    for (int k = 0; k < 16; ++k) m[k] = a[k];
    for (int w = 8; w >= 1; w /= 2)
      for (int k = 0; k < w; ++k) m[k] = kMax ? (m[k + w] > m[k] ? m[k + w] : m[k]) : m[k] + m[k + w];
    return m[0];
  }

  // Row r, group g of set_weights_generic; false when the group's weights are unusable.
  bool set_group_weights(const float* p, const float* scale, const float* lo, int r, int g) {
    float w[kTokensPerBlock], big[16], lanes[16];
    bool negative = false;
    for (int k = 0; k < 16; ++k) {
      float plo = 0.f, wsum = 0.f;
      big[k] = 0.f;
      for (int v = 0; v < kLaneTokens; ++v) {
        const int j = k + 16 * v;
        w[j] = p[j] * scale[j];
        big[k] = w[j] > big[k] ? w[j] : big[k];
        negative = negative || w[j] < 0.f;
        const float plo_j = mul_rn(p[j], lo[j]);  // rounded alone: no contraction to match
        plo = v == 0 ? plo_j : plo + plo_j;
        wsum = v == 0 ? w[j] : wsum + w[j];
      }
      lanes[k] = plo + float(kMid) * wsum;
    }
    const float top = fold_lanes16<true>(big);
    const float b = fold_lanes16<false>(lanes);
    const float inv = top > 0.f ? 255.f / top : 0.f;
    sigma[r][g] = top / 255.f;
    bias[r][g] = b;
    std::int32_t total = 0;
    for (int j = 0; j < kTokensPerBlock; ++j) {
      float x = w[j] * inv;
      x = x > 0.f ? x : 0.f;
      x = x < 255.f ? x : 255.f;
      w8[r][g][j] = static_cast<std::uint8_t>(static_cast<std::int32_t>(x + 0.5f));
      total += w8[r][g][j];
    }
    w8_sum[r][g] = total;
    return !negative && b - b == 0.f;
  }

#if KVQ_GNU_HOST && KVQ_CPU_AVX2 && !KVQ_CPU_AVX512
  // set_group_weights on 8-float vectors: lanes 0–7 of the sixteen (tokens k + 16v,
  // k < 8) are one vector per v, lanes 8–15 another; the halving folds are shuffles. The same
  // expressions, so the same contractions and bits. The scalar loop was ~17% of the K2V2
  // decode with int8 values on AVX2 (Zen 2, perf).
  bool set_group_weights_avx2(const float* p, const float* scale, const float* lo, int r, int g) {
    using V = FloatVec<8>;
    constexpr int kVectors = kTokensPerBlock / 8;
    static_assert(kVectors % 4 == 0, "kvq: the packs below take 32 tokens at a time");
    const V zero = zero_vec<8>();
    V w[kVectors];
    V big[2], lanes[2];
    int negative = 0;
    KVQ_UNROLL for (int h = 0; h < 2; ++h) {  // lanes 8h .. 8h + 7: tokens 8h + k + 16v
      V plo = zero, wsum = zero;
      big[h] = zero;
      KVQ_UNROLL for (int v = 0; v < kLaneTokens; ++v) {
        const int i = 2 * v + h;
        const V pv = load_vec<8>(p + 8 * i);
        w[i] = pv * load_vec<8>(scale + 8 * i);
        big[h] = w[i] > big[h] ? w[i] : big[h];
        negative |= _mm256_movemask_ps(_mm256_cmp_ps(w[i], zero, _CMP_LT_OQ));
        V plo_i = pv * load_vec<8>(lo + 8 * i);
        kvq::detail::materialize(plo_i);
        plo = v == 0 ? plo_i : plo + plo_i;
        wsum = v == 0 ? w[i] : wsum + w[i];
      }
      lanes[h] = plo + float(kMid) * wsum;
    }
    // fold_lanes16's halving order (lane k with k + 8, then k + 4, k + 2, k + 1) and select.
    const float top = max_lanes<8>(big[1] > big[0] ? big[1] : big[0]);
    const float b = sum_lanes<8>(lanes[0] + lanes[1]);
    const float inv = top > 0.f ? 255.f / top : 0.f;
    sigma[r][g] = top / 255.f;
    bias[r][g] = b;
    using Ints = GnuVec<std::int32_t, 8>::type;
    const V lim = zero + 255.f;
    Ints total{};
    KVQ_UNROLL for (int i0 = 0; i0 < kVectors; i0 += 4) {
      __m256i q[4];
      KVQ_UNROLL for (int i = 0; i < 4; ++i) {
        V y = w[i0 + i] * inv;
        y = y > zero ? y : zero;
        y = y < lim ? y : lim;
        q[i] = __m256i(__builtin_convertvector(y + 0.5f, Ints));
        total += Ints(q[i]);
      }
      // 32 int32 → 32 bytes in token order (the packs interleave 128-bit lanes).
      const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(q[0], q[1]), _mm256_packus_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(&w8[r][g][8 * i0]),
                          _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
    // The lanes' sum in registers (exact in any order).
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(__m256i(total)), _mm256_extracti128_si256(__m256i(total), 1));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
    w8_sum[r][g] = _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1)));
    return negative == 0 && b - b == 0.f;
  }
#endif

#if KVQ_GNU_HOST && KVQ_CPU_AVX512  // 64-byte vectors are native: no ABI notes, no splitting
  // Group g of rows r0 .. r0 + live − 1 (live ≤ 4; the other lanes of the fold are unused):
  // the per-row arithmetic of set_group_weights on vectors (the same expressions, so the
  // same contractions), with the four rows' maxima and sums folded together by
  // fold_rows4 in the halving order of fold_lanes16: one reduction chain for four rows.
  // A group that will be rejected (negative or non-finite weights) skips the clamps: its
  // w8 are never read.
  bool set_weights_rows4(const float (*p)[kTokensPerBlock], int r0, int live, int g, const float* scale,
                         const float* lo) {
    using V = FloatVec<16>;
    const V zero = zero_vec<16>();
    V w[4][kLaneTokens], largest[4], lanes[4];
    __mmask16 negative = 0;
    KVQ_UNROLL for (int q = 0; q < 4; ++q) {
      // Per lane: the largest weight (the select keeps a NaN weight out of it; the bias's
      // sum catches it), Σp·lo + μ·Σw; then one halving fold for both.
      V plo = zero, wsum = zero;
      largest[q] = zero;
      KVQ_UNROLL for (int v = 0; v < kLaneTokens; ++v) {
        const V pv = q < live ? load_vec<16>(p[r0 + q] + 16 * v) : zero;
        w[q][v] = pv * load_vec<16>(scale + 16 * v);
        largest[q] = w[q][v] > largest[q] ? w[q][v] : largest[q];
        negative |= _mm512_cmp_ps_mask(w[q][v], zero, _CMP_LT_OQ);
        V plo_v = pv * load_vec<16>(lo + 16 * v);
        kvq::detail::materialize(plo_v);
        plo = v == 0 ? plo_v : plo + plo_v;
        wsum = v == 0 ? w[q][v] : wsum + w[q][v];
      }
      lanes[q] = plo + float(kMid) * wsum;
    }
    alignas(64) float top[16], bias_lanes[16];
    _mm512_store_ps(top, fold_rows4(largest[0], largest[1], largest[2], largest[3], true));
    _mm512_store_ps(bias_lanes, fold_rows4(lanes[0], lanes[1], lanes[2], lanes[3], false));
    bool finite = true;
    __m512i count[4];
    KVQ_UNROLL for (int q = 0; q < 4; ++q) {
      const float t = top[4 * q], b = bias_lanes[4 * q];
      const float inv = t > 0.f ? 255.f / t : 0.f;
      // w ∈ [0, t] gives w·inv ≤ 255·(1 + 2⁻²²): + 0.5 and truncation stay ≤ 255.
      // Two roundings, as in set_group_weights: the masked builtins are not contracted.
      // vcvttps2dq and the wrapping add are defined for the NaN/huge values of a group
      // that will be rejected.
      const __m512 inv_vec = _mm512_set1_ps(inv), half = _mm512_set1_ps(0.5f);
      __m512i w8_lanes[kLaneTokens];
      KVQ_UNROLL for (int v = 0; v < kLaneTokens; ++v) {
        w8_lanes[v] = _mm512_maskz_cvttps_epi32(0xFFFF, _mm512_maskz_add_ps(0xFFFF, _mm512_maskz_mul_ps(0xFFFF, w[q][v], inv_vec), half));
        count[q] = v == 0 ? w8_lanes[v] : _mm512_add_epi32(count[q], w8_lanes[v]);
      }
      if (q >= live) continue;
      finite = finite && b - b == 0.f;
      const int r = r0 + q;
      sigma[r][g] = t / 255.f;
      bias[r][g] = b;
      KVQ_UNROLL for (int v = 0; v < kLaneTokens; ++v)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(&w8[r][g][16 * v]), _mm512_maskz_cvtepi32_epi8(0xFFFF, w8_lanes[v]));
    }
    alignas(64) std::int32_t sums[16];
    _mm512_store_si512(sums, fold_rows4_epi32(count[0], count[1], count[2], count[3]));
    for (int q = 0; q < live; ++q) w8_sum[r0 + q][g] = sums[4 * q];
    return negative == 0 && finite;
  }
#endif

#if KVQ_CPU_AVX512_VNNI && KVQ_CPU_AVX512_VBMI
  // Rows [r0, r0 + RB), 16 code bytes of four tokens per step: one zmm holds the four
  // tokens' 16 bytes, vpermb makes lane u = (t0[u], t1[u], t2[u], t3[u]), and each slab
  // is a shift and a mask away from vpdpbusd with the rows' four u8 weights. Codes below
  // 8 bits are valid s8 as they are, and μ·Σw8 comes off at the end; 8-bit codes
  // become c − 128 by flipping their top bit.
  // vpermt2b indices for 32-byte rows: byte 4u + t ← byte u of 16-byte chunk k of row t,
  // the four rows being 128 contiguous bytes.
  alignas(64) static constexpr auto kQuadOf4Rows32 = [] {
    std::array<std::array<std::uint8_t, 64>, 2> idx{};
    for (int k = 0; k < 2; ++k)
      for (int u = 0; u < 16; ++u)
        for (int t = 0; t < 4; ++t) idx[k][4 * u + t] = std::uint8_t(32 * t + 16 * k + u);
    return idx;
  }();

  // With out set, the sums go into out [rows][D] as add_to would add them; isum is not
  // written.
  template <int RB, class Between = NoBetween>
  KVQ_FORCE_INLINE void accumulate_vnni(const std::uint8_t* const* codes, int n, int r0, float* out,
                                        Between between = {}) {
    // Decided once per block, so that the token loop has no branch (a branch there also
    // made GCC 12 copy the accumulators each iteration).
    // Rows over 32 bytes always take the gathered form (no contiguous one is written
    // for them, nor instantiated).
    if constexpr (kRowBytes <= 32) {
      if (n % 4 == 0 && runs_are_strided<4>(codes, n, kRowBytes)) {
        accumulate_vnni_quads<RB, true>(codes, n, r0, out, between);
        return;
      }
    }
    accumulate_vnni_quads<RB, false>(codes, n, r0, out, between);
  }

  template <int RB, bool kContiguous, class Between>
  KVQ_FORCE_INLINE void accumulate_vnni_quads(const std::uint8_t* const* codes, int n, int r0, float* out,
                                              Between between) {
    const __m512i quad = _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12,  //
                                         59, 43, 27, 11, 58, 42, 26, 10, 57, 41, 25, 9, 56, 40, 24, 8,    //
                                         55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52, 36, 20, 4,      //
                                         51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
    for (int c = 0; c < kRowBytes; c += 16) {
      __m512i acc[RB][kSlabs];
      KVQ_UNROLL for (int r = 0; r < RB; ++r)
        KVQ_UNROLL for (int k = 0; k < kSlabs; ++k) acc[r][k] = _mm512_setzero_si512();
      for (int j_step = 0; j_step < n; j_step += kBetweenTokens) {
        between();
        const int j_end = std::min(n, j_step + kBetweenTokens);
        for (int j = j_step; j < j_end; j += 4) {
          __m512i z;
          const std::uint8_t* t0 = codes[j];
          if constexpr (kContiguous) {
            // Four consecutive rows of one page: one or two loads and one byte permute.
            static_assert(kRowBytes == 16 || kRowBytes == 32);
            if constexpr (kRowBytes == 16) {
              z = _mm512_maskz_permutexvar_epi8(~__mmask64(0), quad, _mm512_loadu_si512(t0));
            } else if constexpr (kRowBytes == 32) {
              const __m512i index = _mm512_load_si512(kQuadOf4Rows32[c / 16].data());
              z = _mm512_maskz_permutex2var_epi8(~__mmask64(0), _mm512_loadu_si512(t0), index, _mm512_loadu_si512(t0 + 64));
            }
          } else {
            // Tokens past n have weight 0; they read token j's codes.
            const std::uint8_t* t1 = codes[j + 1 < n ? j + 1 : j];
            const std::uint8_t* t2 = codes[j + 2 < n ? j + 2 : j];
            const std::uint8_t* t3 = codes[j + 3 < n ? j + 3 : j];
            z = _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t0 + c)));
            z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(t1 + c)), 1);
            z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(t2 + c)), 2);
            z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(t3 + c)), 3);
            z = _mm512_maskz_permutexvar_epi8(~__mmask64(0), quad, z);  // the unmasked form warns in GCC 12
          }
          __m512i w[RB];
          KVQ_UNROLL for (int r = 0; r < RB; ++r) {
            std::int32_t four;
            std::memcpy(&four, &w8[r0 + r][c / kGroupBytes][j], sizeof four);
            w[r] = _mm512_set1_epi32(four);
          }
          KVQ_UNROLL for (int k = 0; k < kSlabs; ++k) {
            const __m512i slab = Bits == 8 ? _mm512_xor_si512(z, _mm512_set1_epi8(char(0x80))) : code_field<Bits>(z, k);
            KVQ_UNROLL for (int r = 0; r < RB; ++r) acc[r][k] = dpbusd_tied(acc[r][k], w[r], slab);
          }
        }
      }
      KVQ_UNROLL for (int r = 0; r < RB; ++r) {
        const int g = c / kGroupBytes;
        const __m512i offset = _mm512_set1_epi32(Bits == 8 ? 0 : kMid * w8_sum[r0 + r][g]);
        KVQ_UNROLL for (int k = 0; k < kSlabs; ++k) {
          const __m512i sums = _mm512_sub_epi32(acc[r][k], offset);
          const int i = k * kRowBytes + c;
          if (out) {
            using Ints = typename GnuVec<std::int32_t, 16>::type;
            float* dst = out + (r0 + r) * D + i;
            const float sg = sigma[r0 + r][g], b = bias[r0 + r][g];
            store_vec<16>(dst, load_vec<16>(dst) + (sg * __builtin_convertvector(Ints(sums), FloatVec<16>) + b));
          } else {
            _mm512_store_si512(reinterpret_cast<__m512i*>(&isum[r0 + r][i]), sums);
          }
        }
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

  // A vpmaddubsw pair sum is at most 2·255·(2^b − 1) (1530 for 2-bit codes, 7650 for
  // 4-bit): kInt16Run quads add up in int16 lanes without overflow, then one vpmaddwd
  // widens them (one add per quad instead of a vpmaddwd and an add; the same integers).
  static constexpr int kInt16Run = 32767 / (2 * 255 * int(kMask));

  template <int RB>
  KVQ_FORCE_INLINE void accumulate_quads_avx2(const std::uint8_t (*quads)[4 * kRowBytes], int nq, int r0) {
    static_assert(kInt16Run >= 1);
    const __m256i mask = _mm256_set1_epi8(char(kMask)), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < kRowBytes; i += 8) {
      const int g = i / kGroupBytes;
      KVQ_UNROLL for (int k = 0; k < kSlabs; ++k) {
        __m256i acc[RB];
        KVQ_UNROLL for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_si256();
        for (int q0 = 0; q0 < nq; q0 += kInt16Run) {
          __m256i acc16[RB];
          KVQ_UNROLL for (int r = 0; r < RB; ++r) acc16[r] = _mm256_setzero_si256();
          for (int q = q0; q < nq && q < q0 + kInt16Run; ++q) {
            const __m256i y = _mm256_load_si256(reinterpret_cast<const __m256i*>(quads[q] + 4 * i));
            const __m256i slab = _mm256_and_si256(k == 0 ? y : _mm256_srli_epi16(y, k * Bits), mask);
            KVQ_UNROLL for (int r = 0; r < RB; ++r) {
              std::int32_t four;
              std::memcpy(&four, &w8[r0 + r][g][4 * q], sizeof four);
              acc16[r] = _mm256_add_epi16(acc16[r], _mm256_maddubs_epi16(_mm256_set1_epi32(four), slab));
            }
          }
          KVQ_UNROLL for (int r = 0; r < RB; ++r) acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(acc16[r], ones));
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
