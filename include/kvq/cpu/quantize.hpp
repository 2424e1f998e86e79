// kvq/cpu/quantize.hpp — the append path's row transforms on CPU SIMD: the FWHT of
// Hadamard presets, the dense rotation of learned (_R) presets and the group quantizer,
// bit-identical to the scalar reference (kvq/rotation/hadamard.hpp, dense.hpp,
// kvq/core/quantizer.hpp) that CUDA runs too.
//
// Why the results are the same bits: every output element goes through the same
// IEEE operations on the same operands in the same order as in the scalar code, only
// a vector at a time (no reassociation):
//   x·R       one output column per lane, the scalar's ascending sum of rounded products
//   FWHT      stage by stage; each in-lane butterfly is FMA(x, ±1, partner), whose
//             product is exact, so its one rounding is the scalar add's or subtract's;
//             the ±1 signs and 1/√d are the same single multiplies.
//   min/max   a lane-wise fold with the scalar's select (a < b ? a : b); the lanes of
//             one vector's worth of groups then meet in one transpose, in another
//             order, which only matters for the sign of a zero extremum: a zero min or
//             max is recomputed by the scalar fold.
//   metadata  scale = (hi − lo)/levels, the fp16 rounding with the scalar encoder's
//             saturation, 1/s: the scalar code's operations, a group per lane.
//   codes     ⌊(x − lo)·inv + 0.5⌋ as sub, mul, add, round down, then saturating packs
//             to bytes and min(levels, ·) there, 64 codes per instruction (negatives and
//             NaN → 0, as the scalar's !(v > 0)). With fp16 metadata that does not
//             saturate, every finite group has (x − lo)·inv + 0.5 < 2³¹ (the stored lo is
//             within 16 of the true one, 1/s ≤ 2²⁴, and s is stored within 50%), so the
//             float-to-int conversion never overflows and the byte clamp is the scalar's
//             clamp; with bf16/fp32 metadata the clamp stays in float before the
//             conversion.
// Non-finite groups and groups whose fp16 scale or lo saturates get the scalar
// quantizer's own result.
//   clipping  the threshold is the same k-th smallest |x| (selected on |x| compared as
//             floats, a group per lane, instead of by the scalar's all-pairs ranking,
//             detail::clip_rows), then min(t, max(−t, x)), which picks what the
//             scalar's two compares pick, signed zeros included.
// The quantizer runs 16 lanes wide with AVX-512 and 8 wide with AVX2 + F16C
// (detail::AppendSimd), the FWHT 8 or, with AVX-512 and KVQ_CPU_FWHT_BITS = 512 (the
// default off Zen 4), 16 wide (detail::FwhtSimd); without them,
// everything is the scalar path. The `*_generic` names are that path, always compiled,
// for tests/cpu to compare against.
#pragma once

#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "kvq/core/config.hpp"
#include "kvq/core/packing.hpp"
#include "kvq/core/quantizer.hpp"
#include "kvq/cpu/isa.hpp"
#include "kvq/cpu/tile.hpp"
#include "kvq/layout/paged.hpp"
#include "kvq/rotation/dense.hpp"
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

namespace detail {

// The append path's vector operations, one struct per ISA, so that the FWHT and the
// quantizer below are written once. F: kLanes fp32 lanes; I: as many int32 lanes.
//   mul              the rounded product, as kvq::mul_rn: GCC contracts intrinsics too
//                    (_mm512_add_ps(_mm512_mul_ps(a, b), c) becomes one FMA under its
//                    default -ffp-contract=fast), which would move codes at x·inv ≈ k − ½
//   min / max        a < b ? a : b and a > b ? a : b, the scalar fmin_f / fmax_f
//   butterfly<H>     one FWHT stage of stride H < kLanes inside a vector: lanes with bit
//                    H clear get x[i] + x[i+H], the others x[i−H] − x[i], as
//                    FMA(x, ±1, partner): the product is exact, so its one rounding is
//                    the scalar add's or subtract's
//   extremes<kMax>   lane j = the lowest (highest) lane of v[kSlot[j]], j < kLanes: that
//                    many horizontal reductions as one transpose. Lanes meet in another
//                    order than the scalar fold's, which only matters for the sign of a
//                    zero extremum (the caller recomputes those)
//   fp16_metadata    scale = max(hi − lo, 1e-8)/levels, {scale, lo} encoded as the scalar
//                    float_to_half_bits(·, saturate) for non-NaN lanes, stored as one
//                    32-bit {scale, lo} pair per group; the stored lo and 1/s (0 where s
//                    is stored as 0); returns the lanes whose scale or lo saturated
//   codes<kClamp>    ⌊(x − lo)·inv + 0.5⌋ in int32 where that is ≥ 0, first clamped to
//                    levels in float when kClamp; some value ≤ 0 where it is negative;
//                    NaN and overflow become INT_MIN
//   pack<Bits>       4·kLanes codes (c[k] lane i = element kLanes·k + i) → bytes by
//                    saturating packs (negatives and INT_MIN → 0), min(levels, ·), then
//                    little-endian within a byte
//   clip             v > t ? t : (v < −t ? −t : v), the scalar quantizer's clipping, for
//                    finite v: min(t, max(−t, v)) as the selects above, which return v
//                    where it equals −t or t (zeros of either sign included), as the
//                    scalar's compares do
//
// The ±1 factors of an in-vector butterfly of stride H: +1 in lanes with bit H clear
// (they get x[i] + x[i+H]), −1 in the others (x[i−H] − x[i]). A constant in memory,
// so each stage is a permute and an FMA with a memory operand (a blend of two
// broadcasts per stage was a third of the in-vector stages' instructions).
template <int L, int H>
alignas(64) inline constexpr std::array<float, L> kButterflySigns = [] {
  std::array<float, L> s{};
  for (int i = 0; i < L; ++i) s[i] = (i & H) ? -1.f : 1.f;
  return s;
}();

#if KVQ_CPU_AVX512
struct AppendSimd512 {
  using F = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16;
  // GCC 12 builds the unmasked forms of several intrinsics on _mm512_undefined_*, which
  // -Wall reports as maybe-uninitialized; the all-ones masked forms are the same
  // instructions.
  static constexpr __mmask16 kAll = 0xFFFF;

  static KVQ_FORCE_INLINE F load(const float* p) { return _mm512_loadu_ps(p); }
  static KVQ_FORCE_INLINE void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static KVQ_FORCE_INLINE F set1(float x) { return _mm512_set1_ps(x); }
  static KVQ_FORCE_INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  static KVQ_FORCE_INLINE F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static KVQ_FORCE_INLINE F mul(F a, F b) {
    F p = _mm512_mul_ps(a, b);
    kvq::detail::materialize(p);
    return p;
  }
  static KVQ_FORCE_INLINE F min(F a, F b) { return _mm512_maskz_min_ps(kAll, a, b); }
  static KVQ_FORCE_INLINE F max(F a, F b) { return _mm512_maskz_max_ps(kAll, a, b); }

  template <int H>
  static KVQ_FORCE_INLINE F butterfly(F x) {
    F partner;
    if constexpr (H == 1) partner = _mm512_maskz_permute_ps(kAll, x, _MM_SHUFFLE(2, 3, 0, 1));
    else if constexpr (H == 2) partner = _mm512_maskz_permute_ps(kAll, x, _MM_SHUFFLE(1, 0, 3, 2));
    else if constexpr (H == 4) partner = _mm512_maskz_shuffle_f32x4(kAll, x, x, _MM_SHUFFLE(2, 3, 0, 1));
    else partner = _mm512_maskz_shuffle_f32x4(kAll, x, x, _MM_SHUFFLE(1, 0, 3, 2));
    return _mm512_fmadd_ps(x, _mm512_load_ps(kButterflySigns<16, H>.data()), partner);
  }

  // The four shuffle levels of extremes leave slot 4m + L's result in lane 4L + m.
  static constexpr int kSlot[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
  template <bool kMax>
  static KVQ_FORCE_INLINE F extremes(const F* v) {
    auto pick = [](F a, F b) { return kMax ? max(a, b) : min(a, b); };
    F halves[8], quarters[4], pairs[2];
    KVQ_UNROLL for (int j = 0; j < 8; ++j)  // 256-bit halves of two vectors
      halves[j] = pick(_mm512_maskz_shuffle_f32x4(kAll, v[2 * j], v[2 * j + 1], 0x44),
                       _mm512_maskz_shuffle_f32x4(kAll, v[2 * j], v[2 * j + 1], 0xEE));
    KVQ_UNROLL for (int j = 0; j < 4; ++j)  // 128-bit lanes: one per input vector
      quarters[j] = pick(_mm512_maskz_shuffle_f32x4(kAll, halves[2 * j], halves[2 * j + 1], 0x88),
                         _mm512_maskz_shuffle_f32x4(kAll, halves[2 * j], halves[2 * j + 1], 0xDD));
    KVQ_UNROLL for (int j = 0; j < 2; ++j)  // pairs of floats inside each 128-bit lane
      pairs[j] = pick(_mm512_maskz_shuffle_ps(kAll, quarters[2 * j], quarters[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                      _mm512_maskz_shuffle_ps(kAll, quarters[2 * j], quarters[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return pick(_mm512_maskz_shuffle_ps(kAll, pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                _mm512_maskz_shuffle_ps(kAll, pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }

  // Class 0x99: QNaN, SNaN, +∞, −∞.
  static KVQ_FORCE_INLINE bool all_finite(F v) { return _mm512_fpclass_ps_mask(v, 0x99) == 0; }
  static KVQ_FORCE_INLINE unsigned zero_lanes(F a, F b) {
    return _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_EQ_OQ) | _mm512_cmp_ps_mask(b, _mm512_setzero_ps(), _CMP_EQ_OQ);
  }

  // vcvtps2ph rounds like the scalar F16C path; finite lanes at or above 65520
  // saturate to ±65504 instead of ±∞.
  static KVQ_FORCE_INLINE __m256i encode_half_saturating(F f, unsigned& saturated_lanes) {
    const __m256i rounded = _mm512_maskz_cvtps_ph(kAll, f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i bits = _mm512_castps_si512(f);
    const __m512i abs = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 big = _mm512_cmpge_epu32_mask(abs, _mm512_set1_epi32(0x477ff000)) &
                          _mm512_cmplt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
    const __m512i saturated = _mm512_or_si512(_mm512_maskz_srli_epi32(kAll, _mm512_maskz_andnot_epi32(kAll, abs, bits), 16),
                                              _mm512_set1_epi32(0x7bff));
    saturated_lanes |= big;
    return _mm256_mask_mov_epi16(rounded, big, _mm512_maskz_cvtepi32_epi16(kAll, saturated));
  }
  static KVQ_FORCE_INLINE unsigned fp16_metadata(F lo, F hi, float levels, std::uint32_t* pairs, float* lo_stored,
                                                 float* inv) {
    const F scale = _mm512_div_ps(max(sub(hi, lo), set1(1e-8f)), set1(levels));
    unsigned saturated = 0;
    const __m256i s16 = encode_half_saturating(scale, saturated), lo16 = encode_half_saturating(lo, saturated);
    _mm512_storeu_si512(pairs, _mm512_or_si512(_mm512_maskz_cvtepu16_epi32(kAll, s16),
                                               _mm512_maskz_slli_epi32(kAll, _mm512_maskz_cvtepu16_epi32(kAll, lo16), 16)));
    const F s = _mm512_maskz_cvtph_ps(kAll, s16);
    const __mmask16 nonzero = _mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    store(lo_stored, _mm512_maskz_cvtph_ps(kAll, lo16));
    store(inv, _mm512_maskz_div_ps(nonzero, set1(1.f), s));
    return saturated;
  }

  static KVQ_FORCE_INLINE F clip(F v, F t, F neg_t) { return min(t, max(neg_t, v)); }

  template <bool kClamp>
  static KVQ_FORCE_INLINE I codes(F x, F lo, F inv, F top) {
    F t = add(mul(sub(x, lo), inv), set1(0.5f));
    if constexpr (kClamp) t = min(top, t);
    return _mm512_maskz_cvt_roundps_epi32(kAll, t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  }

  // Byte j of a 2-bit (4-bit) row part ← byte kPackSource<Bits>[j] of the combined dwords
  // (words): with VBMI one vpermb takes each field's byte where the packs left it, in
  // place of the dword permutation before and the vpmovdb / vpmovwb after (2 of 9 and 8
  // instructions per 64 codes). Bytes 16L + 4k + t hold element 16k + 4L + t (below), so
  // dword 4L + k packs elements 16k + 4L .. + 3, byte 4k + L of the output; word
  // 8L + 2k + u packs elements 16k + 4L + 2u, + 1, byte 8k + 2L + u.
  template <int Bits>
  alignas(64) static constexpr std::array<std::uint8_t, 64> kPackSource = [] {
    std::array<std::uint8_t, 64> idx{};
    for (int j = 0; j < 16 * Bits; ++j)
      idx[j] = Bits == 2 ? std::uint8_t(16 * (j % 4) + 4 * (j / 4))
                         : std::uint8_t(16 * ((j % 8) / 2) + 4 * (j / 8) + 2 * (j % 2));
    return idx;
  }();

  template <int Bits>
  static KVQ_FORCE_INLINE void pack(const I* c, std::uint8_t* out) {
    // Per 128-bit lane L the packs leave c0[4L..4L+3], c1[…], c2[…], c3[…]; the dword
    // permutation (with VBMI and 2/4 bits, the vpermb after the fields) restores element order.
    const __m512i by_lane = _mm512_packus_epi16(_mm512_packus_epi32(c[0], c[1]), _mm512_packus_epi32(c[2], c[3]));
#if KVQ_CPU_AVX512_VBMI
    if constexpr (Bits == 2 || Bits == 4) {
      const __m512i bytes = _mm512_min_epu8(by_lane, _mm512_set1_epi8(char((1 << Bits) - 1)));
      const __m512i idx = _mm512_load_si512(kPackSource<Bits>.data());
      __m512i fields;
      if constexpr (Bits == 4) {
        fields = _mm512_maddubs_epi16(bytes, _mm512_set1_epi16(0x1001));  // b0 + 16·b1
      } else {
        const __m512i pairs = _mm512_maddubs_epi16(bytes, _mm512_set1_epi16(0x0401));  // b0 + 4·b1
        fields = _mm512_madd_epi16(pairs, _mm512_set1_epi32(0x00100001));               // + 16·(b2 + 4·b3)
      }
      // The low 16·Bits bytes, stored from the register's low part (GCC 12's cast
      // intrinsics go through an extract from an undefined vector, which -Wall reports).
      using Qwords = long long __attribute__((vector_size(64)));
      const Qwords packed = reinterpret_cast<Qwords>(_mm512_maskz_permutexvar_epi8(~__mmask64(0), idx, fields));
      if constexpr (Bits == 4) {
        const auto low = __builtin_shufflevector(packed, packed, 0, 1, 2, 3);
        std::memcpy(out, &low, sizeof low);
      } else {
        const auto low = __builtin_shufflevector(packed, packed, 0, 1);
        std::memcpy(out, &low, sizeof low);
      }
      return;
    }
#endif
    const __m512i bytes = _mm512_min_epu8(
        _mm512_maskz_permutexvar_epi32(kAll, _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), by_lane),
        _mm512_set1_epi8(char((1 << Bits) - 1)));
    if constexpr (Bits == 8) {
      _mm512_storeu_si512(out, bytes);
    } else if constexpr (Bits == 4) {
      const __m512i pairs = _mm512_maddubs_epi16(bytes, _mm512_set1_epi16(0x1001));  // b0 + 16·b1
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_maskz_cvtepi16_epi8(~__mmask32(0), pairs));
    } else {
      static_assert(Bits == 2);
      const __m512i pairs = _mm512_maddubs_epi16(bytes, _mm512_set1_epi16(0x0401));  // b0 + 4·b1
      const __m512i quads = _mm512_madd_epi16(pairs, _mm512_set1_epi32(0x00100001));  // + 16·(b2 + 4·b3)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_maskz_cvtepi32_epi8(kAll, quads));
    }
  }
};
#endif

#if KVQ_CPU_AVX2 && KVQ_CPU_F16C
struct AppendSimd256 {
  using F = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8;

  static KVQ_FORCE_INLINE F load(const float* p) { return _mm256_loadu_ps(p); }
  static KVQ_FORCE_INLINE void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static KVQ_FORCE_INLINE F set1(float x) { return _mm256_set1_ps(x); }
  static KVQ_FORCE_INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }
  static KVQ_FORCE_INLINE F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static KVQ_FORCE_INLINE F mul(F a, F b) {
    F p = _mm256_mul_ps(a, b);
    kvq::detail::materialize(p);
    return p;
  }
  static KVQ_FORCE_INLINE F min(F a, F b) { return _mm256_min_ps(a, b); }
  static KVQ_FORCE_INLINE F max(F a, F b) { return _mm256_max_ps(a, b); }

  template <int H>
  static KVQ_FORCE_INLINE F butterfly(F x) {
    F partner;
    if constexpr (H == 1) partner = _mm256_permute_ps(x, _MM_SHUFFLE(2, 3, 0, 1));
    else if constexpr (H == 2) partner = _mm256_permute_ps(x, _MM_SHUFFLE(1, 0, 3, 2));
#if KVQ_CPU_AVX512
    else partner = _mm256_shuffle_f32x4(x, x, 1);  // the EVEX form, as the 512-bit path's shuffles
#else
    else partner = _mm256_permute2f128_ps(x, x, 0x01);
#endif
#if KVQ_CPU_FMA
    return _mm256_fmadd_ps(x, _mm256_load_ps(kButterflySigns<8, H>.data()), partner);
#else
    constexpr int kUpper = H == 1 ? 0xAA : (H == 2 ? 0xCC : 0xF0);
    return _mm256_blend_ps(add(x, partner), sub(partner, x), kUpper);
#endif
  }

  // The three shuffle levels of extremes leave slot 2m + L's result in lane 4L + m.
  static constexpr int kSlot[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  template <bool kMax>
  static KVQ_FORCE_INLINE F extremes(const F* v) {
    auto pick = [](F a, F b) { return kMax ? max(a, b) : min(a, b); };
    F halves[4], pairs[2];
    KVQ_UNROLL for (int j = 0; j < 4; ++j)  // 128-bit halves of two vectors
      halves[j] = pick(_mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x20), _mm256_permute2f128_ps(v[2 * j], v[2 * j + 1], 0x31));
    KVQ_UNROLL for (int j = 0; j < 2; ++j)  // pairs of floats inside each 128-bit lane
      pairs[j] = pick(_mm256_shuffle_ps(halves[2 * j], halves[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                      _mm256_shuffle_ps(halves[2 * j], halves[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return pick(_mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                _mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  }

  static KVQ_FORCE_INLINE bool all_finite(F v) {  // v − v is 0 exactly for finite lanes
    return _mm256_movemask_ps(_mm256_cmp_ps(sub(v, v), _mm256_setzero_ps(), _CMP_EQ_OQ)) == 0xFF;
  }
  static KVQ_FORCE_INLINE unsigned zero_lanes(F a, F b) {
    return unsigned(_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_EQ_OQ),
                                                    _mm256_cmp_ps(b, _mm256_setzero_ps(), _CMP_EQ_OQ))));
  }

  static KVQ_FORCE_INLINE __m128i encode_half_saturating(F f, unsigned& saturated_lanes) {
    const __m128i rounded = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));  // < 2^31: signed compares work
    const __m256i big = _mm256_andnot_si256(_mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f7fffff)),
                                            _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x477fefff)));
    const __m256i saturated = _mm256_or_si256(_mm256_srli_epi32(_mm256_andnot_si256(abs, bits), 16), _mm256_set1_epi32(0x7bff));
    const __m128i saturated16 = _mm_packus_epi32(_mm256_castsi256_si128(saturated), _mm256_extracti128_si256(saturated, 1));
    const __m128i big16 = _mm_packs_epi32(_mm256_castsi256_si128(big), _mm256_extracti128_si256(big, 1));
    saturated_lanes |= unsigned(_mm256_movemask_ps(_mm256_castsi256_ps(big)));
    return _mm_blendv_epi8(rounded, saturated16, big16);
  }
  static KVQ_FORCE_INLINE unsigned fp16_metadata(F lo, F hi, float levels, std::uint32_t* pairs, float* lo_stored,
                                                 float* inv) {
    const F scale = _mm256_div_ps(max(sub(hi, lo), set1(1e-8f)), set1(levels));
    unsigned saturated = 0;
    const __m128i s16 = encode_half_saturating(scale, saturated), lo16 = encode_half_saturating(lo, saturated);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs), _mm_unpacklo_epi16(s16, lo16));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(pairs + 4), _mm_unpackhi_epi16(s16, lo16));
    const F s = _mm256_cvtph_ps(s16);
    store(lo_stored, _mm256_cvtph_ps(lo16));
    store(inv, _mm256_and_ps(_mm256_div_ps(set1(1.f), s), _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_NEQ_UQ)));
    return saturated;
  }

  static KVQ_FORCE_INLINE F clip(F v, F t, F neg_t) { return min(t, max(neg_t, v)); }

  template <bool kClamp>
  static KVQ_FORCE_INLINE I codes(F x, F lo, F inv, F top) {
    F t = add(mul(sub(x, lo), inv), set1(0.5f));
    if constexpr (kClamp) t = min(top, t);
    return _mm256_cvttps_epi32(t);  // truncation is ⌊t⌋ for t ≥ 0; pack makes t < 0 a 0 either way
  }

  template <int Bits>
  static KVQ_FORCE_INLINE void pack(const I* c, std::uint8_t* out) {
    // Per 128-bit lane L the packs leave c0[4L..4L+3], c1[…], c2[…], c3[…]; the dword
    // permutation restores element order.
    const __m256i by_lane = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    const __m256i bytes = _mm256_min_epu8(_mm256_permutevar8x32_epi32(by_lane, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)),
                                          _mm256_set1_epi8(char((1 << Bits) - 1)));
    if constexpr (Bits == 8) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bytes);
    } else if constexpr (Bits == 4) {
      const __m256i pairs = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x1001));  // b0 + 16·b1
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                       _mm_packus_epi16(_mm256_castsi256_si128(pairs), _mm256_extracti128_si256(pairs, 1)));
    } else {
      static_assert(Bits == 2);
      const __m256i pairs = _mm256_maddubs_epi16(bytes, _mm256_set1_epi16(0x0401));  // b0 + 4·b1
      const __m256i quads = _mm256_madd_epi16(pairs, _mm256_set1_epi32(0x00100001));  // + 16·(b2 + 4·b3)
      const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(words, words));
    }
  }
};
#endif

// The quantizer's vectors, and the FWHT's. The FWHT's width is KVQ_CPU_FWHT_BITS
// (kvq/cpu/isa.hpp): an in-vector stage costs two instructions per vector (a permute and
// an FMA), a stage between vectors one, so at d 128 eight zmm do 4 in-vector and 3 across
// stages, 88 zmm instructions, and sixteen ymm 3 and 4, 160 ymm instructions (ymm take
// d 256 in two parts of 16). A Zen 4 issues the 160 as 80 zmm's worth: with ymm a
// K2V2_HC row took 83 → 76 cycles alone, and its append 92 → 88 ns per token·head
// (2026-12-05). A Xeon core with full-width 512-bit pipes (2026-12-07, 2-core VM,
// alternating runs of bench_cpu) runs zmm faster: K2V2_HC's append 736–743 → 629–659 µs
// for 4096 tokens × 2 heads (11.0–11.1 → 12.4–13.0 M token·heads/s), the FWHT of a row
// (BM_Fwht/1) 25.0–25.4 → 21.6–22.0 ns at d 128 and 52–53 → 33.5–33.7 ns at d 256.
// (A key and a value row interleaved took 71 cycles in a loop of their own, but 32 live
// ymm spill inside the append, which then got slower.) Rows across lanes instead (16 rows
// per zmm: 16-bit transposes in, all FWHT stages as adds between vectors, ranges in
// per-block chains, codes packed by shifts; bit-identical) took 83.6 ns per token·head
// against these row-wise passes' 82.0 for K2V2_HC's batch of 16 on the Zen 4 (2026-12-06):
// the transposes and three passes over an 8 KB buffer cost what they save. On the Xeon
// they gain: detail::quantize_rows_across_lanes takes d-128 2-bit kinds from fp16 where
// the FWHT is 512 bits wide (K2V2_HC's append 5–11% faster, 2026-12-08).
#if KVQ_CPU_AVX512
using AppendSimd = AppendSimd512;
#define KVQ_CPU_APPEND_SIMD 1
#elif KVQ_CPU_AVX2 && KVQ_CPU_F16C
using AppendSimd = AppendSimd256;
#define KVQ_CPU_APPEND_SIMD 1
#else
#define KVQ_CPU_APPEND_SIMD 0
#endif
#if KVQ_CPU_APPEND_SIMD
#if KVQ_CPU_AVX512 && KVQ_CPU_FWHT_BITS == 512
using FwhtSimd = AppendSimd512;
#else
using FwhtSimd = AppendSimd256;  // AppendSimd exists only with AVX2 + F16C
#endif

// One in-vector FWHT stage of stride H on the NV vectors v[].
template <int H, int NV, class V>
KVQ_FORCE_INLINE void butterflies_in_lanes(typename V::F* v) {
  KVQ_UNROLL for (int k = 0; k < NV; ++k) v[k] = V::template butterfly<H>(v[k]);
}

// The FWHT stages between the NV vectors v[], strides H, 2H, … vectors, as the scalar
// order; fixed trip counts, so v[] stays in registers.
template <int H, int NV, class V>
KVQ_FORCE_INLINE void butterflies_across(typename V::F* v) {
  if constexpr (H < NV) {
    KVQ_UNROLL for (int i = 0; i < NV; i += 2 * H)
      KVQ_UNROLL for (int j = i; j < i + H; ++j) {
        const typename V::F a = v[j], b = v[j + H];
        v[j] = V::add(a, b);
        v[j + H] = V::sub(a, b);
      }
    butterflies_across<2 * H, NV, V>(v);
  }
}

#endif

}  // namespace detail

// dst = (src − mean)·D·H/√D in registers: the conversion from T, the centering (when
// mean is not null) and the FWHT (when kHadamard) of kvq::center_rotate and
// kvq::hadamard_forward, with their bits. A row goes to memory once, for the quantizer,
// instead of once per step. Rows of more than 16 vectors (d 256) go in parts of 16, the
// most that stay in registers: the stages of strides below a part's length stay inside
// it, and one pass over the parts does the last stage and 1/√D. (AVX2 took d 256's 32
// vectors at once and spilled: K2V2_HC's append, Zen 4 at -march=haswell, 266 → 221 ns
// per token·head, d 128 99; AVX-512 runs as fast as with 16 zmm.)  src: [D] of T;
// mean: [D] or null;  dst: [D] (may be src).
template <int D, bool kHadamard, ActivationType T>
KVQ_FORCE_INLINE void center_hadamard_row_fast(const T* src, const float* mean, std::uint32_t sign_seed, float* dst) {
#if KVQ_CPU_APPEND_SIMD
  using V = detail::FwhtSimd;
  constexpr int L = V::kLanes, kPart = D < 16 * L ? D : 16 * L;
  if constexpr (D % L == 0 && (!kHadamard || ((D & (D - 1)) == 0 && (D == kPart || D == 2 * kPart)))) {
    constexpr int NV = kPart / L;
    alignas(64) float signs[kHadamard ? D : 1];
    if constexpr (kHadamard)
      if (sign_seed != 0)
        for (int i = 0; i < D; ++i) signs[i] = hadamard_sign(sign_seed, i);
    const typename V::F norm = V::set1(inv_sqrt_pow2(D));
    for (int p0 = 0; p0 < D; p0 += kPart) {
      typename V::F v[NV];
      KVQ_UNROLL for (int k = 0; k < NV; ++k) {
        const kvq::detail::FloatVec<L> x = kvq::detail::load_as_float<L>(src + p0 + L * k);
        std::memcpy(&v[k], &x, sizeof x);
        if (mean) v[k] = V::sub(v[k], V::load(mean + p0 + L * k));
      }
      if constexpr (kHadamard) {
        if (sign_seed != 0)
          KVQ_UNROLL for (int k = 0; k < NV; ++k) v[k] = V::mul(v[k], V::load(signs + p0 + L * k));
        [&]<int... H>(std::integer_sequence<int, H...>) {  // strides 1, 2, … inside vectors
#if KVQ_CPU_AVX512
          (detail::butterflies_in_lanes<(1 << H), NV, V>(v), ...);  // stage by stage
#else
          // A vector at a time: AVX2's 16 registers cannot hold a d-128 row besides the
          // signs, and whole stages spill more (K2V2_HC's append on a Zen 4 at
          // -march=haswell: 104.4 ns per token·head stage by stage, 101.0 this way).
          KVQ_UNROLL for (int k = 0; k < NV; ++k) (detail::butterflies_in_lanes<(1 << H), 1, V>(v + k), ...);
#endif
        }(std::make_integer_sequence<int, std::countr_zero(unsigned(L))>{});
        detail::butterflies_across<1, NV, V>(v);
        if constexpr (kPart == D) KVQ_UNROLL for (int k = 0; k < NV; ++k) v[k] = V::mul(v[k], norm);
      }
      KVQ_UNROLL for (int k = 0; k < NV; ++k) V::store(dst + p0 + L * k, v[k]);
    }
    if constexpr (kHadamard && kPart < D) {  // the stage of stride D/2, then 1/√D
      KVQ_UNROLL for (int k = 0; k < NV; ++k) {
        const typename V::F a = V::load(dst + L * k), b = V::load(dst + kPart + L * k);
        V::store(dst + L * k, V::mul(V::add(a, b), norm));
        V::store(dst + kPart + L * k, V::mul(V::sub(a, b), norm));
      }
    }
    return;
  }
#endif
  float x[D];
  kvq::detail::convert_row<D>(src, x);
  if (mean)
    for (int i = 0; i < D; ++i) x[i] = sub_rn(x[i], mean[i]);
  if constexpr (kHadamard) hadamard_forward_generic<D>(x, sign_seed);
  std::memcpy(dst, x, sizeof x);
}

// x ← x·D·H/√D in place (kvq::hadamard_forward's bits).
template <int D>
KVQ_FORCE_INLINE void hadamard_forward_fast(float* x, std::uint32_t sign_seed) {
  center_hadamard_row_fast<D, true>(x, nullptr, sign_seed, x);
}

namespace detail {

// kRows rows x[q] ← x[q]·R in one pass over R (see rotate_dense_rows_fast).
template <int D, int kRows>
KVQ_FORCE_INLINE void rotate_dense_pass(float* const* x, const float* r) {
  alignas(64) float out[kRows][D];
#if KVQ_CPU_APPEND_SIMD
  using V = AppendSimd;
  constexpr int L = V::kLanes;
  if constexpr (D % L == 0) {
    // kRows × kBlock accumulators + kBlock vectors of R + a broadcast stay in registers
    // (up to 16 + 4 + 1 of AVX-512's 32, 8 + 2 + 1 of AVX2's 16; one row takes 8).
    constexpr int NV = D / L, kWant = kRows == 1 ? 8 : (L == 16 ? 4 : 2);
    constexpr int kBlock = NV % kWant == 0 ? kWant : (NV % 4 == 0 && kWant > 4 ? 4 : (NV % 2 == 0 ? 2 : 1));
    for (int j0 = 0; j0 < D; j0 += kBlock * L) {
      typename V::F acc[kRows][kBlock];
      KVQ_UNROLL for (int q = 0; q < kRows; ++q)
        KVQ_UNROLL for (int b = 0; b < kBlock; ++b) acc[q][b] = V::set1(0.f);
      for (int i = 0; i < D; ++i) {
        const float* row = r + i * D + j0;
        typename V::F rv[kBlock];
        KVQ_UNROLL for (int b = 0; b < kBlock; ++b) rv[b] = V::load(row + b * L);
        KVQ_UNROLL for (int q = 0; q < kRows; ++q) {
          const typename V::F xi = V::set1(x[q][i]);
          KVQ_UNROLL for (int b = 0; b < kBlock; ++b) acc[q][b] = V::add(acc[q][b], V::mul(xi, rv[b]));
        }
      }
      KVQ_UNROLL for (int q = 0; q < kRows; ++q)
        KVQ_UNROLL for (int b = 0; b < kBlock; ++b) V::store(out[q] + j0 + b * L, acc[q][b]);
    }
    for (int q = 0; q < kRows; ++q) std::memcpy(x[q], out[q], sizeof out[q]);
    return;
  }
#endif
  for (int q = 0; q < kRows; ++q) {
    rotate_dense<D>(x[q], r, out[q]);
    std::memcpy(x[q], out[q], sizeof out[q]);
  }
}

}  // namespace detail

// Rows x[0..n) ← x·R in place (kvq::rotate_dense's bits): lane j of an accumulator sums
// the separately rounded products x_i·R[i][j] over i ascending from +0, as the scalar
// loop does. One pass over R serves up to 4 rows, so R (64 KiB at d 128, beyond L1) is
// read once per 4 rows: in the append, where a row's key and value rotations used to
// alternate, that made it 1.4× faster; a lone row is bound by the two FP pipes.
//   x[q] : [D];  R : [D, D] row-major
template <int D>
KVQ_FORCE_INLINE void rotate_dense_rows_fast(int n, float* const* x, const float* r) {
  for (int q = 0; q < n; q += 4) {
    const int rows = n - q < 4 ? n - q : 4;
    if (rows == 4) detail::rotate_dense_pass<D, 4>(x + q, r);
    else if (rows == 3) detail::rotate_dense_pass<D, 3>(x + q, r);
    else if (rows == 2) detail::rotate_dense_pass<D, 2>(x + q, r);
    else detail::rotate_dense_pass<D, 1>(x + q, r);
  }
}

#if KVQ_CPU_APPEND_SIMD
namespace detail {

// v[0..L) ← its transpose (lane c of v[j] = lane j of the old v[c]), L a power of two:
// log2(L) levels of two-source shuffles, each swapping the off-diagonal blocks of size H.
template <int H, class Vec, std::size_t... I>
KVQ_FORCE_INLINE void swap_blocks(Vec& a, Vec& b, std::index_sequence<I...>) {
  constexpr int L = sizeof...(I);
  const Vec lo = __builtin_shufflevector(a, b, ((I & H) ? int(L + I - H) : int(I))...);  // a's left, b's left
  const Vec hi = __builtin_shufflevector(a, b, ((I & H) ? int(L + I) : int(I + H))...);  // a's right, b's right
  a = lo, b = hi;
}
template <int L, class Vec, int H = L / 2>
KVQ_FORCE_INLINE void transpose_lanes(Vec* v) {
  KVQ_UNROLL for (int i = 0; i < L; i += 2 * H)
    KVQ_UNROLL for (int j = i; j < i + H; ++j) swap_blocks<H>(v[j], v[j + H], std::make_index_sequence<L>{});
  if constexpr (H > 1) transpose_lanes<L, Vec, H / 2>(v);
}

// Comparator networks on kLanes groups at once (one group per lane), for the clip
// threshold's selection. A comparator (a, b), a < b, leaves max in v[a] and min in v[b]
// (descending order); comparators are fixed pairs, so the vectors stay in registers.
struct Comparator {
  int a, b;
};

// Batcher's odd–even merge sort of n = 2^p keys (63 comparators for 16), as a list.
template <int N>
constexpr auto odd_even_merge_sort() {
  auto plan = [](Comparator* out) {
    int c = 0;
    for (int p = 1; p < N; p <<= 1)
      for (int k = p; k >= 1; k >>= 1)
        for (int j = k % p; j + k < N; j += 2 * k)
          for (int i = 0; i < k && i + j + k < N; ++i)
            if ((i + j) / (2 * p) == (i + j + k) / (2 * p)) {
              if (out) out[c] = {i + j, i + j + k};
              ++c;
            }
    return c;
  };
  std::array<Comparator, plan(nullptr)> net{};
  plan(net.data());
  return net;
}

// Sorting a bitonic sequence of K keys followed by P − K slots of +∞ (P the power of two
// ≥ K; the sequence stays bitonic): the half-cleaners of a bitonic merge, with the +∞
// slots tracked here at compile time, so that a comparator meeting one is nothing or a
// move of v[a] into v[b], listed as {a, −1 − b}. The K keys end sorted, descending, in
// slots P − K … P − 1.
template <int K>
constexpr auto padded_bitonic_merge() {
  auto plan = [](Comparator* out) {
    // P inside the lambda: a capture-less lambda may not name an enclosing local (GCC
    // accepts it for a constant, clang 14 does not).
    constexpr int P = std::bit_ceil(unsigned(K));
    bool pad[P] = {};
    for (int i = K; i < P; ++i) pad[i] = true;
    int c = 0;
    for (int h = P / 2; h >= 1; h /= 2)
      for (int i = 0; i < P; ++i)
        if ((i & h) == 0) {
          const int a = i, b = i + h;
          if (pad[a] && pad[b]) continue;
          if (pad[a]) continue;  // +∞ stays in a, the key in b
          if (pad[b]) {          // +∞ moves to a, the key to b
            if (out) out[c] = {a, -1 - b};
            ++c;
            pad[a] = true, pad[b] = false;
            continue;
          }
          if (out) out[c] = {a, b};
          ++c;
        }
    return c;
  };
  std::array<Comparator, plan(nullptr)> net{};
  plan(net.data());
  return net;
}

// A comparator's outputs: the selects below (scalars: the networks' tests), and for
// clip_rows' float keys the same selects as vmaxps / vminps (there are no NaN keys), as
// GCC 12 builds a select of float vectors as a compare and a blend.
template <class Vec>
KVQ_FORCE_INLINE Vec key_max(Vec a, Vec b) {
  return a > b ? a : b;
}
template <class Vec>
KVQ_FORCE_INLINE Vec key_min(Vec a, Vec b) {
  return a > b ? b : a;
}
KVQ_FORCE_INLINE AppendSimd::F key_max(AppendSimd::F a, AppendSimd::F b) { return AppendSimd::max(a, b); }
KVQ_FORCE_INLINE AppendSimd::F key_min(AppendSimd::F a, AppendSimd::F b) { return AppendSimd::min(b, a); }

template <auto& kNet, class Vec, std::size_t... I>
KVQ_FORCE_INLINE void run_network(Vec* v, std::index_sequence<I...>) {
  (
      [&] {
        constexpr Comparator c = kNet[I];
        if constexpr (c.b < 0) {
          v[-1 - c.b] = v[c.a];
        } else {
          const Vec hi = key_max(v[c.a], v[c.b]);
          v[c.b] = key_min(v[c.a], v[c.b]);
          v[c.a] = hi;
        }
      }(),
      ...);
}
template <auto& kNet, class Vec>
KVQ_FORCE_INLINE void run_network(Vec* v) {
  run_network<kNet>(v, std::make_index_sequence<kNet.size()>{});
}

template <int N>
inline constexpr auto kSortNetwork = odd_even_merge_sort<N>();
template <int K>
inline constexpr auto kBitonicMerge = padded_bitonic_merge<K>();

// The clipping of a clipping spec for n rows: out[r] = x[r] with every finite group
// clamped to ±t, t its threshold kth_smallest_abs(group, k), the same value bit for bit
// (k = clip_rank). The scalar selection compares all pairs (G² compares per group); here
// kLanes groups are selected at once, one group per lane, on the keys |x| (±0 share the
// key +0; NaN becomes +∞), transposed so that no step reduces across lanes:
//   5 ≤ m + 1 ≤ 16 (m = G−1−k: 11 values for 0.92 of 128, 6 for 0.92 of 64)
//       a descending list of the m + 1 largest, kept by blocks of kLanes keys: a block
//       sorted by a network, merged into the list as max(list[i], block[m − i]) (a
//       block shorter than the list padded below every key), the m + 1 largest of both
//       in a bitonic order, which a bitonic merge sorts again, whose last entry is the
//       rank-k key — about half the vector operations of the insertion below (K4V2_HC
//       appends 1.16× faster on a Zen 4 with blocks of 16, and 1.10× with AVX2's blocks
//       of 8, which leave its 16 registers for the list);
//   other m + 1 ≤ 16 (2 keys for OptR's 0.96 of 32)
//       each key is inserted into the same list (a max and a min per entry, a systolic
//       chain), whose last entry is the rank-k key;
//   otherwise
//       the largest T with more than m keys ≥ T, built bit by bit from bit 30 (31
//       rounds of G compares) — the rank-k key again.
// A nonzero key is |x| itself; key 0 means the rank-k element is a zero, and the
// scalar's index tie-break then picks the k-th zero in index order, whose sign the
// threshold keeps. Groups with a non-finite element (found by their largest key, the
// list's first entry, instead of a check per element) are copied unclipped (their result
// is the scalar quantizer's).
//   x[r] : [D] fp32;  out : [n][D]
template <QuantSpec S, int D>
KVQ_FORCE_INLINE void clip_rows(int n, const float* const* x, float (*out)[D]) {
  using V = AppendSimd;
  // Keys are |x| as floats with NaN raised to +∞: for such values the float order is the
  // order of their IEEE patterns, and float min/max issue on two ports where 512-bit
  // integer min/max (vpminsd) issue on one. With the finiteness read off the largest key
  // and clip() as min/max, K4V2_HC's append went 8.64–8.66 → 9.79–9.91 M token·heads/s
  // (bench_cpu, a Xeon core, 2026-12-07).
  using Keys = typename V::F;
  using KeyBits = typename kvq::detail::GnuVec<std::int32_t, V::kLanes>::type;
  constexpr int L = V::kLanes, G = S.group, NG = D / G, NV = G / L;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  constexpr int k = clip_rank(G, S.clip_permille), m = G - 1 - k;
  static_assert(G % L == 0);
  const int total = n * NG;
  for (int i0 = 0; i0 < total; i0 += L) {
    const int count = total - i0 < L ? total - i0 : L;
    const float* group[L];
    for (int c = 0; c < L; ++c) {
      const int i = i0 + (c < count ? c : 0);  // lanes past the batch repeat the first group
      group[c] = x[i / NG] + (i % NG) * G;
    }
    // keys[e] lane c: the key of element e' of group c, for e' a permutation of e within
    // each block of kLanes (the order in which a lane sees its keys does not matter).
    // Each block is transposed in a local array and stored whole: transposed in place in
    // keys[], GCC 12 at -march=haswell ran the shuffles through memory, and K4V2_HC's
    // append took 1.7× as long (2026-12-05, Zen 4).
    alignas(64) Keys keys[G];
    for (int v = 0; v < NV; ++v) {
      Keys block[L];
      KVQ_UNROLL for (int c = 0; c < L; ++c) {
        KeyBits bits;
        std::memcpy(&bits, group[c] + L * v, sizeof bits);
        block[c] = V::min(reinterpret_cast<Keys>(bits & 0x7fffffff), V::set1(kInf));  // NaN → +∞
      }
      transpose_lanes<L>(block);
      KVQ_UNROLL for (int c = 0; c < L; ++c) keys[L * v + c] = block[c];
    }
    // rank_k: the rank-k key; max_key: the largest key, +∞ exactly when the group has a
    // non-finite element.
    Keys rank_k, max_key;
    if constexpr (m + 1 > 4 && m + 1 <= 16 && G % L == 0) {
      // Blocks of kLanes keys: 16 with AVX-512, 8 with AVX2.
      constexpr int K = m + 1, P = int(std::bit_ceil(unsigned(K))), B = L;
      Keys top[K];
      KVQ_UNROLL for (int j = 0; j < K; ++j) top[j] = Keys{} - 1.f;  // −1: below every key
      for (int b = 0; b < G; b += B) {
        Keys block[B];
        KVQ_UNROLL for (int j = 0; j < B; ++j) block[j] = keys[b + j];
        run_network<kSortNetwork<B>>(block);
        if (b == 0) {
          KVQ_UNROLL for (int j = 0; j < K && j < B; ++j) top[j] = block[j];
          continue;
        }
        // A block shorter than the list counts as padded with keys below every key: the
        // list's first K − B entries stay.
        Keys merged[P];
        KVQ_UNROLL for (int j = 0; j < K; ++j)
          merged[j] = K - 1 - j >= B ? top[j] : key_max(top[j], block[K - 1 - j]);
        KVQ_UNROLL for (int j = K; j < P; ++j) merged[j] = Keys{};  // +∞ slots: never read
        run_network<kBitonicMerge<K>>(merged);
        KVQ_UNROLL for (int j = 0; j < K; ++j) top[j] = merged[P - K + j];
      }
      rank_k = top[m], max_key = top[0];
    } else if constexpr (m + 1 <= 16) {
      Keys top[m + 1];
      KVQ_UNROLL for (int j = 0; j <= m; ++j) top[j] = Keys{} - 1.f;  // below every key
      for (int e = 0; e < G; ++e) {
        Keys key = keys[e];
        KVQ_UNROLL for (int j = 0; j <= m; ++j) {
          const Keys larger = key_max(top[j], key);
          key = key_min(top[j], key);
          top[j] = larger;
        }
      }
      rank_k = top[m], max_key = top[0];
    } else {
      max_key = keys[0];
      for (int e = 1; e < G; ++e) max_key = key_max(max_key, keys[e]);
      KeyBits rank_bits = {};
      for (int bit = 30; bit >= 0; --bit) {
        const KeyBits candidate = rank_bits | (1 << bit);
        KeyBits at_or_above[4] = {};  // −1 per key ≥ candidate, four chains
        KVQ_UNROLL for (int e = 0; e < G; ++e) at_or_above[e % 4] += reinterpret_cast<KeyBits>(keys[e]) >= candidate;
        rank_bits = (at_or_above[0] + at_or_above[1]) + (at_or_above[2] + at_or_above[3]) < -m ? candidate : rank_bits;
      }
      rank_k = reinterpret_cast<Keys>(rank_bits);
    }
    for (int c = 0; c < count; ++c) {
      const float* xg = group[c];
      float* dst = out[(i0 + c) / NG] + ((i0 + c) % NG) * G;
      if (max_key[c] == kInf) {
        std::memcpy(dst, xg, sizeof(float) * G);
        continue;
      }
      float t = rank_k[c];
      if (t == 0.f)
        for (int e = 0, zeros = 0; e < G; ++e)
          if (xg[e] == 0.f && zeros++ == k) {
            t = xg[e];  // ±0: the scalar's x < 0 ? −x : x keeps it
            break;
          }
      const typename V::F t_vec = V::set1(t), neg_t = V::set1(-t);
      KVQ_UNROLL for (int v = 0; v < NV; ++v) V::store(dst + L * v, V::clip(V::load(xg + L * v), t_vec, neg_t));
    }
  }
}

}  // namespace detail
#endif

// n rows of D elements → packed codes and {scale, lo} per group (kvq::quantize_row's
// bits for each row). The rows go phase by phase, each over all n·D/G groups of the
// batch: lane-wise ranges, then kLanes groups' horizontal min/max by one transpose, the
// metadata of kLanes groups per vector (fp16; bf16/fp32 metadata is scalar per group),
// then codes and packing 4·kLanes elements at a time. Groups the vector path cannot
// reproduce (non-finite, saturated fp16 metadata) are requantized by the scalar code.
//   x[r] : [D] fp32;  packed[r] : [D·bits/8];  meta[r] : [D/G][2]
template <QuantSpec S, int D, int kMaxRows>
KVQ_FORCE_INLINE void quantize_rows_fast(int n, const float* const* x, std::uint8_t* const* packed,
                                         meta_storage_t<S.meta>* const* meta) {
#if KVQ_CPU_APPEND_SIMD
  using V = detail::AppendSimd;
  using F = typename V::F;
  constexpr int L = V::kLanes, G = S.group, NG = D / G;
  constexpr bool kClip = S.clips() && clip_rank(G, S.clip_permille) < G - 1;
  if constexpr (G % L == 0 && D % (4 * L) == 0) {
    using Meta = MetaTraits<S.meta>;
    // Clipping specs quantize the clipped rows (kMaxRows·D more floats of stack); groups
    // the scalar code redoes start again from the originals.
    const float* const* original = x;
    alignas(64) float clipped[kClip ? kMaxRows : 1][D];
    const float* clipped_rows[kClip ? kMaxRows : 1];
    if constexpr (kClip) {
      detail::clip_rows<S, D>(n, x, clipped);
      for (int r = 0; r < n; ++r) clipped_rows[r] = clipped[r];
      x = clipped_rows;
    }
    constexpr int NV = G / L, kLevels = S.levels(), kSlots = (kMaxRows * NG + L - 1) / L * L;
    constexpr bool kFp16 = S.meta == MetaType::fp16;  // codes clamped in bytes (see the top)
    alignas(64) float lo[kSlots], hi[kSlots], inv[kSlots];
    // Bit j of redo[c]: the scalar quantizer redoes group L·c + j. (A bool per group
    // was set by a memset call per chunk: K2V2's key rows took ~6% longer.)
    std::uint32_t redo[kSlots / L];
    const int groups = n * NG;
    // Every element of group i finite (the careful check, when a chunk's sum is not).
    auto group_finite = [&](int i) {
      const float* xg = x[i / NG] + (i % NG) * G;
      for (int k = 0; k < NV; ++k)
        if (!V::all_finite(V::load(xg + L * k))) return false;
      return true;
    };
    for (int base = 0; base < groups; base += L) {
      const int count = groups - base < L ? groups - base : L;
      // 1. Ranges: lane-wise min/max over each group's vectors (two chains), then the
      //    kLanes groups' lanes at once. fin sums every element of the chunk: finite
      //    when every element is (a sum that overflows only sends the chunk to the
      //    per-group check). A fixed trip count (padding slots repeat the last group)
      //    and four partial sums instead of one chain of kLanes adds: K2V2's key rows
      //    (4 groups of 32) 20.3 → 18.0 ns each in a batch of 16, on a Xeon (2026-12-07).
      F lo_lanes[L], hi_lanes[L], fin_part[4] = {V::set1(0.f), V::set1(0.f), V::set1(0.f), V::set1(0.f)};
      KVQ_UNROLL for (int j = 0; j < L; ++j) {
        const int i = base + (j < count ? j : count - 1);  // padding slots: the last group again
        const float* xg = x[i / NG] + (i % NG) * G;
        F lo_v[2], hi_v[2], fin[2];
        KVQ_UNROLL for (int c = 0; c < 2 && c < NV; ++c) fin[c] = lo_v[c] = hi_v[c] = V::load(xg + L * c);
        KVQ_UNROLL for (int k = 2; k < NV; ++k) {
          const F v = V::load(xg + L * k);
          lo_v[k % 2] = V::min(lo_v[k % 2], v);
          hi_v[k % 2] = V::max(hi_v[k % 2], v);
          fin[k % 2] = V::add(fin[k % 2], v);
        }
        if constexpr (NV > 1) {
          lo_v[0] = V::min(lo_v[0], lo_v[1]);
          hi_v[0] = V::max(hi_v[0], hi_v[1]);
          fin[0] = V::add(fin[0], fin[1]);
        }
        fin_part[j % 4] = V::add(fin_part[j % 4], fin[0]);
        lo_lanes[V::kSlot[j]] = lo_v[0];
        hi_lanes[V::kSlot[j]] = hi_v[0];
      }
      const bool chunk_finite = V::all_finite(V::add(V::add(fin_part[0], fin_part[1]), V::add(fin_part[2], fin_part[3])));
      std::uint32_t& chunk_redo = redo[base / L];
      chunk_redo = 0;
      if (!chunk_finite)
        for (int j = 0; j < count; ++j) chunk_redo |= std::uint32_t(!group_finite(base + j)) << j;
      const F lo_x = V::template extremes<false>(lo_lanes), hi_x = V::template extremes<true>(hi_lanes);
      V::store(lo + base, lo_x);
      V::store(hi + base, hi_x);
      // A zero extremum's sign depends on the order in which lanes met: recompute it in
      // the scalar order.
      for (unsigned zero = V::zero_lanes(lo_x, hi_x); zero != 0; zero &= zero - 1) {
        const int j = __builtin_ctz(zero), i = base + j;
        if (j < count && !(chunk_redo >> j & 1)) {
          const float* xg = x[i / NG] + (i % NG) * G;
          float l = xg[0], h = xg[0];
          for (int e = 1; e < G; ++e) l = fmin_f(l, xg[e]), h = fmax_f(h, xg[e]);
          lo[i] = l, hi[i] = h;
        }
      }
    }
    // 2. Metadata: scale, stored {s, lo}, and 1/s (0 when s is stored as 0: codes 0).
    //    Groups marked in redo are quantized by the scalar code after phase 3. A loop of
    //    its own: a chunk's metadata is a chain of two divisions and two conversions,
    //    and the chunks' chains overlap only when nothing long lies between them (K2V2's
    //    append: 59.2 → 57.3 ns per token·head on a Zen 4).
    for (int base = 0; base < groups; base += L) {
      const int count = groups - base < L ? groups - base : L;
      std::uint32_t& chunk_redo = redo[base / L];
      if constexpr (kFp16) {
        // {scale, lo} pairs of the chunk's groups: whole rows (NG ≤ L) or part of one.
        alignas(64) std::uint32_t pairs[L];
        const unsigned saturated =
            V::fp16_metadata(V::load(lo + base), V::load(hi + base), float(kLevels), pairs, lo + base, inv + base);
        if constexpr (NG <= L)
          for (int j = 0; j < count; j += NG) std::memcpy(meta[(base + j) / NG], pairs + j, NG * sizeof(std::uint32_t));
        else
          std::memcpy(meta[base / NG] + 2 * (base % NG), pairs, count * sizeof(std::uint32_t));
        chunk_redo |= saturated & ((1u << count) - 1);
      } else {
        for (int i = base; i < base + count; ++i) {
          meta_storage_t<S.meta>* mg = meta[i / NG] + 2 * (i % NG);
          const float scale = div_rn(fmax_f(sub_rn(hi[i], lo[i]), 1e-8f), static_cast<float>(kLevels));
          mg[0] = Meta::encode(scale);
          mg[1] = Meta::encode(lo[i]);
          const float s_stored = Meta::decode(mg[0]);
          lo[i] = Meta::decode(mg[1]);
          inv[i] = s_stored == 0.f ? 0.f : div_rn(1.f, s_stored);
        }
      }
    }
    // 3. Codes, 4·kLanes at a time. inv = 0 gives 0 everywhere, the scalar's s = 0 result.
    const F top = V::set1(float(kLevels));
    for (int r = 0; r < n; ++r)
      for (int e0 = 0; e0 < D; e0 += 4 * L) {
        typename V::I codes[4];
        KVQ_UNROLL for (int k = 0; k < 4; ++k) {
          const int e = e0 + L * k, i = r * NG + e / G;
          codes[k] = V::template codes<!kFp16>(V::load(x[r] + e), V::set1(lo[i]), V::set1(inv[i]), top);
        }
        V::template pack<S.bits>(codes, packed[r] + e0 * S.bits / 8);
      }
    // The scalar result (for non-finite groups the defined one of DESIGN §2), over
    // whatever phases 2 and 3 wrote there — unless a later row of the batch has the same
    // destination (an append of two tokens at one position): phases 2 and 3 stored that
    // row's bytes there last, and they stay, as in token order.
    for (int c = 0; c * L < groups; ++c)
      for (std::uint32_t m = redo[c]; m != 0; m &= m - 1) {
        const int i = L * c + __builtin_ctz(m), r = i / NG;
        bool overwritten = false;
        for (int later = r + 1; later < n; ++later) overwritten |= packed[later] == packed[r];
        if (!overwritten)
          quantize_group<S>(original[r] + (i % NG) * G, packed[r] + (i % NG) * (G * S.bits / 8), meta[r] + 2 * (i % NG));
      }
    return;
  }
#endif
  for (int r = 0; r < n; ++r) quantize_row_generic<S, D>(x[r], packed[r], meta[r]);
}

namespace detail {

// Rows across lanes: an append batch's 16 rows of one kind (keys or values) as 16 lanes,
// lane t = row t, vector e = element e. Every FWHT stage is then adds between vectors
// (in rows, 4 of d 128's 7 stages are a permute and an FMA per vector), the ranges are
// lane-wise folds without the transpose of phase 1, and the inputs' fp16 transposes move
// 32 elements per shuffle. K2V2_HC's append, a Xeon core: see benchmarks/README.md.
// Taken with the 512-bit FWHT (the Zen 4's 256-bit one does not gain: see FwhtSimd), and
// where a row's finiteness shows in its first output: fp16 sources, centered by means
// below kLaneMeanBound, cannot overflow, so a non-finite input makes every output of the
// FWHT non-finite and finite inputs none.
template <QuantSpec S, int D, class T, int kMaxRows>
inline constexpr bool kRowsAcrossLanes =
    KVQ_CPU_AVX512 && KVQ_CPU_FWHT_BITS == 512 && D == 128 && kMaxRows == 16 && std::is_same_v<T, half_t> &&
    S.rotation == Rotation::hadamard && S.meta == MetaType::fp16 && S.bits == 2 &&
    !(S.clips() && clip_rank(S.group, S.clip_permille) < S.group - 1);

// Whether an append of P from T rows sends whole chunks of tokens head by head
// (append_items): only where a kind can go across lanes. Row by row, batches of one head
// made K4V2's append 3–13% slower than the token order's (2026-12-08).
template <Policy P, class T, int kMaxRows>
inline constexpr bool kAppendByHead = kRowsAcrossLanes<P.key, P.head_dim, T, kMaxRows> ||
                                      (kRowsAcrossLanes<P.value, P.head_dim, T, kMaxRows> && !P.value.centered);

// |mean| below 2^100: |x − mean| < 2^101 for fp16 x, and the FWHT's sums of 128 such
// terms stay far below FLT_MAX.
inline constexpr float kLaneMeanBound = 0x1p100f;

#if KVQ_CPU_AVX512
// Every mean of a head finite and below kLaneMeanBound (16 at a time: a scalar loop was
// 7% of K2V2_HC's append).
template <int D>
bool means_bounded(const float* mean) {
  __mmask16 out = 0;
  for (int e = 0; e < D; e += 16)
    out |= _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(mean + e)), _mm512_set1_ps(kLaneMeanBound), _CMP_NLT_UQ);
  return out == 0;  // NaN compares unordered: not below
}
#endif

}  // namespace detail

#if KVQ_CPU_AVX512
namespace detail {

// Codes and metadata of n ≤ 16 rows of one kind, from fp16 sources, bit-identical to
// kvq::quantize_token_head's steps (x − mean, the signs, the FWHT, 1/√D, quantize_row).
//   src[t] : [D] fp16 (t < 16; lanes past n repeat a row);  mean : [D], the rows' KV
//   head's means, or null;  codes[t] : [D·bits/8];  meta[t] : [D/G][2];  next_offset :
//   bytes from row t to the next batch's row t, prefetched.
// Steps: 16-bit transposes into t16; per block of 16 elements the conversion, centering,
// signs and the stages of strides 1–8 (f); per low nibble the strides 16–64, 1/√D and the
// ranges (f again); metadata a group per lane; codes per 16 elements into a dword per
// lane; one transpose back into rows. A row whose first output is non-finite, and groups
// whose extremum is a zero (its sign is the scalar fold's order's) or whose fp16
// metadata saturates, are redone by the scalar code.
template <QuantSpec S, int D>
void quantize_rows_across_lanes(const std::uint16_t* const* src, const float* mean, std::uint32_t sign_seed,
                                std::uint8_t* const* codes, meta_storage_t<S.meta>* const* meta, int n,
                                std::ptrdiff_t next_offset) {
  using V = AppendSimd512;
  using F = __m512;
  using I = __m512i;
  constexpr int G = S.group, NG = D / G, NB = D / 16, kPerGroup = NB / NG;
  constexpr __mmask16 kAll = V::kAll;  // masked forms: see AppendSimd512
  constexpr __mmask8 kAllQwords = 0xFF;
  static_assert(D == 128 && S.bits == 2 && G >= 16);
  alignas(64) std::uint16_t t16[NB][8][32];  // block b, vector k: elements 16b + k, 16b + 8 + k
  alignas(64) float f[D][16];
  // 1. Transposes, 32 elements × 16 rows at a time: unpacks of words, dwords and qwords
  //    leave, in each 128-bit lane q, element 8q + k of 8 rows; a qword permutation joins
  //    rows 0–7 and 8–15.
  const I join0 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), join1 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  for (int c = 0; c < D / 32; ++c) {
    I a[16], w[8][2], d[4][4], o[2][8];
    KVQ_UNROLL for (int t = 0; t < 16; ++t) a[t] = _mm512_loadu_si512(src[t] + 32 * c);
    KVQ_UNROLL for (int p = 0; p < 8; ++p) {
      w[p][0] = _mm512_unpacklo_epi16(a[2 * p], a[2 * p + 1]);  // elements 0–3 of lane q, rows 2p, 2p + 1
      w[p][1] = _mm512_unpackhi_epi16(a[2 * p], a[2 * p + 1]);  // 4–7
    }
    KVQ_UNROLL for (int r = 0; r < 4; ++r)
      KVQ_UNROLL for (int h = 0; h < 2; ++h) {
        d[r][2 * h] = _mm512_maskz_unpacklo_epi32(kAll, w[2 * r][h], w[2 * r + 1][h]);  // elements 4h, 4h + 1 of rows 4r..
        d[r][2 * h + 1] = _mm512_maskz_unpackhi_epi32(kAll, w[2 * r][h], w[2 * r + 1][h]);
      }
    KVQ_UNROLL for (int h = 0; h < 2; ++h)
      KVQ_UNROLL for (int j = 0; j < 4; ++j) {
        o[h][2 * j] = _mm512_maskz_unpacklo_epi64(kAllQwords, d[2 * h][j], d[2 * h + 1][j]);  // element 2j of rows 8h..8h + 7
        o[h][2 * j + 1] = _mm512_maskz_unpackhi_epi64(kAllQwords, d[2 * h][j], d[2 * h + 1][j]);
      }
    KVQ_UNROLL for (int k = 0; k < 8; ++k) {
      _mm512_store_si512(t16[2 * c][k], _mm512_permutex2var_epi64(o[0][k], join0, o[1][k]));
      _mm512_store_si512(t16[2 * c + 1][k], _mm512_permutex2var_epi64(o[0][k], join1, o[1][k]));
    }
  }
  // 2. Strides 1–8: inside each block of 16 element vectors.
  alignas(64) float signs[D];
  if (sign_seed != 0)
    for (int e = 0; e < D; ++e) signs[e] = hadamard_sign(sign_seed, e);
  for (int b = 0; b < NB; ++b) {
    F x[16];
    KVQ_UNROLL for (int k = 0; k < 8; ++k) {
      x[k] = _mm512_maskz_cvtph_ps(kAll, _mm256_load_si256(reinterpret_cast<const __m256i*>(t16[b][k])));
      x[8 + k] = _mm512_maskz_cvtph_ps(kAll, _mm256_load_si256(reinterpret_cast<const __m256i*>(t16[b][k] + 16)));
    }
    if (mean) KVQ_UNROLL for (int i = 0; i < 16; ++i) x[i] = V::sub(x[i], V::set1(mean[16 * b + i]));
    if (sign_seed != 0) KVQ_UNROLL for (int i = 0; i < 16; ++i) x[i] = V::mul(x[i], V::set1(signs[16 * b + i]));
    butterflies_across<1, 16, V>(x);
    KVQ_UNROLL for (int i = 0; i < 16; ++i) V::store(f[16 * b + i], x[i]);
  }
  // 3. Strides 16–64 over the vectors l + 16m, 1/√D, and each group's lane-wise min/max
  //    (two chains; in another order than the scalar fold's, which only a zero extremum's
  //    sign can tell: step 4 recomputes those).
  const F norm = V::set1(inv_sqrt_pow2(D));
  F lo[NG][2], hi[NG][2];
  for (int l = 0; l < 16; ++l) {
    const std::uintptr_t next = reinterpret_cast<std::uintptr_t>(src[l]) + next_offset;  // may lie past the rows
    KVQ_UNROLL for (int z = 0; z < D * 2 / 64; ++z) _mm_prefetch(reinterpret_cast<const char*>(next + 64 * z), _MM_HINT_T0);
    F y[NB];
    KVQ_UNROLL for (int m = 0; m < NB; ++m) y[m] = V::load(f[l + 16 * m]);
    butterflies_across<1, NB, V>(y);
    KVQ_UNROLL for (int m = 0; m < NB; ++m) {
      y[m] = V::mul(y[m], norm);
      V::store(f[l + 16 * m], y[m]);
    }
    KVQ_UNROLL for (int g = 0; g < NG; ++g) {  // group g: vectors m = kPerGroup·g .., as a tree
      F lows[kPerGroup], highs[kPerGroup];
      KVQ_UNROLL for (int q = 0; q < kPerGroup; ++q) lows[q] = highs[q] = y[kPerGroup * g + q];
      KVQ_UNROLL for (int width = kPerGroup / 2; width >= 1; width /= 2)
        KVQ_UNROLL for (int q = 0; q < width; ++q) {
          lows[q] = V::min(lows[q], lows[q + width]);
          highs[q] = V::max(highs[q], highs[q + width]);
        }
      const F l0 = lows[0], h0 = highs[0];
      if (l < 2) {
        lo[g][l] = l0, hi[g][l] = h0;
      } else {
        lo[g][l & 1] = V::min(lo[g][l & 1], l0);
        hi[g][l & 1] = V::max(hi[g][l & 1], h0);
      }
    }
  }
  // 4. Metadata, a group per lane; rows with a non-finite first output redo everything.
  const std::uint32_t valid = (1u << n) - 1;
  const std::uint32_t nonfinite_rows = _mm512_fpclass_ps_mask(V::load(f[0]), 0x99);  // QNaN, SNaN, ±∞
  std::uint32_t redo[NG];
  alignas(64) float lo_stored[NG][16], inv[NG][16];
  alignas(64) std::uint32_t pairs[NG][16];
  KVQ_UNROLL for (int g = 0; g < NG; ++g) {
    F l = V::min(lo[g][0], lo[g][1]), h = V::max(hi[g][0], hi[g][1]);
    if (unsigned zero = V::zero_lanes(l, h) & ~nonfinite_rows & valid) {
      alignas(64) float lz[16], hz[16];
      V::store(lz, l), V::store(hz, h);
      for (; zero != 0; zero &= zero - 1) {
        const int t = __builtin_ctz(zero);
        float a = f[G * g][t], z = a;
        for (int e = 1; e < G; ++e) a = fmin_f(a, f[G * g + e][t]), z = fmax_f(z, f[G * g + e][t]);
        lz[t] = a, hz[t] = z;
      }
      l = V::load(lz), h = V::load(hz);
    }
    redo[g] = (V::fp16_metadata(l, h, float(S.levels()), pairs[g], lo_stored[g], inv[g]) | nonfinite_rows) & valid;
  }
  for (int t = 0; t < n; ++t)
    KVQ_UNROLL for (int g = 0; g < NG; ++g) std::memcpy(meta[t] + 2 * g, &pairs[g][t], sizeof(std::uint32_t));
  // 5. Codes per 16 elements 16b + 4k + j: the four vectors of j (k = 0..3) packed to
  //    bytes (byte 4k + r of 128-bit lane q: row 4q + r), clamped to 3, and the four j
  //    combined by shifts (codes below 4 stay inside their byte), then bytes regrouped by
  //    row: dword t of packed[b] = bytes 4b..4b + 3 of row t's codes.
  alignas(64) I packed[NB];
  {
    const I by_row = _mm512_maskz_broadcast_i32x4(kAll, _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
#pragma GCC unroll 1
    for (int b = 0; b < NB; ++b) {  // a loop: unrolled, the function was 1.6× the size
      const int g = 16 * b / G;     // G ≥ 16: one group per block
      const F lo_v = V::load(lo_stored[g]), inv_v = V::load(inv[g]);
      I part[4];
      KVQ_UNROLL for (int j = 0; j < 4; ++j) {
        I c[4];
        KVQ_UNROLL for (int k = 0; k < 4; ++k) c[k] = V::template codes<false>(V::load(f[16 * b + 4 * k + j]), lo_v, inv_v, lo_v);
        part[j] = _mm512_min_epu8(_mm512_packus_epi16(_mm512_packus_epi32(c[0], c[1]), _mm512_packus_epi32(c[2], c[3])),
                                  _mm512_set1_epi8(3));
      }
      const I low = _mm512_ternarylogic_epi32(part[0], _mm512_slli_epi16(part[1], 2), _mm512_slli_epi16(part[2], 4), 0xFE);
      packed[b] = _mm512_shuffle_epi8(_mm512_or_si512(low, _mm512_slli_epi16(part[3], 6)), by_row);
    }
  }
  // 6. packed[b] dword t → row t's 32 bytes: dword and qword unpacks give each 128-bit
  //    lane q bytes 0–15 (lo[r]) and 16–31 (hi[r]) of row 4q + r; the qword permutation
  //    joins them. Stored in row order: a later row with the same destination wins.
  alignas(64) std::uint8_t rows[4][4][32];  // [r][pair of zmm halves]: rows r, 4 + r, 8 + r, 12 + r
  {
    I lo_half[4], hi_half[4];
    KVQ_UNROLL for (int s = 0; s < 2; ++s) {
      const I* p = packed + 4 * s;
      const I l01 = _mm512_maskz_unpacklo_epi32(kAll, p[0], p[1]), h01 = _mm512_maskz_unpackhi_epi32(kAll, p[0], p[1]);
      const I l23 = _mm512_maskz_unpacklo_epi32(kAll, p[2], p[3]), h23 = _mm512_maskz_unpackhi_epi32(kAll, p[2], p[3]);
      I* out = s == 0 ? lo_half : hi_half;
      out[0] = _mm512_maskz_unpacklo_epi64(kAllQwords, l01, l23), out[1] = _mm512_maskz_unpackhi_epi64(kAllQwords, l01, l23);
      out[2] = _mm512_maskz_unpacklo_epi64(kAllQwords, h01, h23), out[3] = _mm512_maskz_unpackhi_epi64(kAllQwords, h01, h23);
    }
    KVQ_UNROLL for (int r = 0; r < 4; ++r) {
      _mm512_store_si512(rows[r][0], _mm512_permutex2var_epi64(lo_half[r], join0, hi_half[r]));
      _mm512_store_si512(rows[r][2], _mm512_permutex2var_epi64(lo_half[r], join1, hi_half[r]));
    }
  }
  for (int t = 0; t < n; ++t) std::memcpy(codes[t], rows[t % 4][t / 4], 32);
  // 7. The scalar quantizer's result for the groups marked above.
  std::uint32_t any = 0;
  KVQ_UNROLL for (int g = 0; g < NG; ++g) any |= redo[g];
  for (; any != 0; any &= any - 1) {
    const int t = __builtin_ctz(any);
    bool overwritten = false;
    for (int later = t + 1; later < n; ++later) overwritten |= codes[later] == codes[t];
    if (overwritten) continue;
    alignas(64) float row[D];
    for (int e = 0; e < D; ++e) row[e] = f[e][t];
    for (int g = 0; g < NG; ++g)
      if (redo[g] >> t & 1) quantize_group<S>(row + G * g, codes[t] + g * (G * S.bits / 8), meta[t] + 2 * g);
  }
}

}  // namespace detail
#endif

// kvq::quantize_token_head on the host, for n ≤ kMaxRows (token, KV head) items at
// once: center and rotate key row k[j] and value row v[j] of KV head heads[j] into the
// fp32 rows k_rows[j], v_rows[j] (workspace), then quantize them into pages[j], slot
// slots[j].  k[j], v[j]: [D] of T;  k_rows[j], v_rows[j]: [D] fp32.
template <Policy P, int kMaxRows, ActivationType T>
KVQ_FORCE_INLINE void quantize_token_heads_fast(int n, const T* const* k, const T* const* v, float* const* k_rows,
                                                float* const* v_rows, const int* heads, const int* slots,
                                                std::byte* const* pages, const RotationParams& r,
                                                const PageLayout<P>& layout) {
  constexpr int D = P.head_dim;
  // Centering and the FWHT per row; a learned rotation per KV head afterwards, for all
  // the batch's rows of that head in passes over its R.
  auto transform = [&]<QuantSpec S>(const T* src, float* x, int h, const float* mean) {
    const float* mean_h = S.centered ? mean + h * D : nullptr;
    center_hadamard_row_fast<D, S.rotation == Rotation::hadamard>(src, mean_h, S.sign_seed, x);
  };
  auto rotate_by_head = [&]<QuantSpec S>(float* const* rows, const float* rotation) {
    if constexpr (S.rotation == Rotation::dense) {
      bool done[kMaxRows] = {};
      for (int j = 0; j < n; ++j) {
        if (done[j]) continue;
        float* same_head[kMaxRows];
        int count = 0;
        for (int i = j; i < n; ++i)
          if (!done[i] && heads[i] == heads[j]) same_head[count++] = rows[i], done[i] = true;
        rotate_dense_rows_fast<D>(count, same_head, kvq::detail::head_rotation<S, D>(rotation, heads[j]));
      }
    }
  };
  std::uint8_t* k_codes[kMaxRows];
  std::uint8_t* v_codes[kMaxRows];
  meta_storage_t<P.key.meta>* k_meta[kMaxRows];
  meta_storage_t<P.value.meta>* v_meta[kMaxRows];
  for (int j = 0; j < n; ++j) {
    k_codes[j] = reinterpret_cast<std::uint8_t*>(layout.key_codes(pages[j], heads[j], slots[j]));
    v_codes[j] = reinterpret_cast<std::uint8_t*>(layout.value_codes(pages[j], heads[j], slots[j]));
    k_meta[j] = reinterpret_cast<meta_storage_t<P.key.meta>*>(layout.key_meta_bytes(pages[j], heads[j], slots[j]));
    v_meta[j] = reinterpret_cast<meta_storage_t<P.value.meta>*>(layout.value_meta_bytes(pages[j], heads[j], slots[j]));
  }
  // Each kind across lanes where it can (a full 16-lane batch; lanes past n repeat item 0),
  // otherwise row by row.
  // A kind goes across lanes where it can (a full batch; centered rows of one KV head
  // with bounded means), otherwise row by row.
  auto quantize_kind = [&]<QuantSpec S>(const T* const* src, float* const* rows, std::uint8_t* const* codes,
                                        meta_storage_t<S.meta>* const* meta, const float* mean, const float* rotation) {
#if KVQ_CPU_AVX512
    if constexpr (detail::kRowsAcrossLanes<S, D, T, kMaxRows>) {
      bool across = n == kMaxRows;
      const float* head_mean = S.centered ? mean + heads[0] * D : nullptr;
      if constexpr (S.centered) {
        for (int t = 1; t < n; ++t) across &= heads[t] == heads[0];
        across = across && detail::means_bounded<D>(head_mean);
      }
      if (across) {
        const std::uint16_t* lanes[16];
        for (int t = 0; t < 16; ++t) lanes[t] = reinterpret_cast<const std::uint16_t*>(src[t]);
        // The next batch in append_items' order: the next KV head's rows of these tokens,
        // or after the last head the next tokens' first head.
        const int hkv = layout.num_kv_heads;
        const std::ptrdiff_t next = heads[0] + 1 < hkv ? D : (std::ptrdiff_t(16) * hkv - heads[0]) * D;
        detail::quantize_rows_across_lanes<S, D>(lanes, head_mean, S.sign_seed, codes, meta, n,
                                                 next * std::ptrdiff_t(sizeof(T)));
        return;
      }
    }
#endif
    for (int j = 0; j < n; ++j) transform.template operator()<S>(src[j], rows[j], heads[j], mean);
    rotate_by_head.template operator()<S>(rows, rotation);
    quantize_rows_fast<S, D, kMaxRows>(n, rows, codes, meta);
  };
  quantize_kind.template operator()<P.key>(k, k_rows, k_codes, k_meta, r.key_mean, r.key_rotation);
  quantize_kind.template operator()<P.value>(v, v_rows, v_codes, v_meta, r.value_mean, r.value_rotation);
}

}  // namespace kvq::cpu
