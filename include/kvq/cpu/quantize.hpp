// kvq/cpu/quantize.hpp — the append path's row transforms on CPU SIMD: the FWHT of
// Hadamard presets and the group quantizer, bit-identical to the scalar reference
// (kvq/rotation/hadamard.hpp, kvq/core/quantizer.hpp) that CUDA runs too.
//
// Why the results are the same bits: every output element goes through the same
// IEEE operations on the same operands in the same order as in the scalar code, only
// sixteen at a time (no reassociation):
//   FWHT      stage by stage; each in-lane butterfly is FMA(x, ±1, partner), whose
//             product is exact, so its one rounding is the scalar add's or subtract's;
//             the ±1 signs and 1/√d are the same single multiplies.
//   min/max   a lane-wise fold with the scalar's select (a < b ? a : b); the lanes of
//             16 groups then meet in one transpose, in another order, which only
//             matters for the sign of a zero extremum: a zero min or max is recomputed
//             by the scalar fold.
//   metadata  scale = (hi − lo)/levels, the fp16 rounding with the scalar encoder's
//             saturation, 1/s: the scalar code's operations on 16 groups per vector.
//   codes     ⌊(x − lo)·inv + 0.5⌋ as sub, mul, add, then min(levels, ·), round down
//             and saturating packs to [0, levels] (NaN → 0, as the scalar's !(v > 0)).
// Non-finite groups (and finite ones whose sum overflows) get the scalar quantizer's
// own result. Clipping policies (a rank selection per group) and groups that are not
// a multiple of 16 keep the scalar path. Without AVX-512 everything is the scalar
// path; the `*_generic` names are that path, always compiled, for tests/cpu to compare
// against.
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

// GCC 12 builds the unmasked forms of several intrinsics on _mm512_undefined_*, which
// -Wall reports as maybe-uninitialized; the all-ones masked forms below are the same
// instructions.
constexpr __mmask16 kAll16 = 0xFFFF;

// Butterfly stage with stride H < 16 inside one vector: lanes with bit H clear get
// x[i] + x[i+H], the others x[i−H] − x[i]. Both are one FMA x·(±1) + partner: the
// product is exact, so its single rounding is the scalar add's or subtract's.
template <int H>
KVQ_FORCE_INLINE __m512 butterfly_in_lanes(__m512 x) {
  __m512 partner;
  if constexpr (H == 1) partner = _mm512_maskz_permute_ps(kAll16, x, _MM_SHUFFLE(2, 3, 0, 1));
  else if constexpr (H == 2) partner = _mm512_maskz_permute_ps(kAll16, x, _MM_SHUFFLE(1, 0, 3, 2));
  else if constexpr (H == 4) partner = _mm512_maskz_shuffle_f32x4(kAll16, x, x, _MM_SHUFFLE(2, 3, 0, 1));
  else partner = _mm512_maskz_shuffle_f32x4(kAll16, x, x, _MM_SHUFFLE(1, 0, 3, 2));
  const __m512 sign = _mm512_mask_blend_ps(
      [] {
        unsigned m = 0;
        for (int i = 0; i < 16; ++i) m |= ((i & H) ? 1u : 0u) << i;
        return __mmask16(m);
      }(),
      _mm512_set1_ps(1.f), _mm512_set1_ps(-1.f));
  return _mm512_fmadd_ps(x, sign, partner);
}

// The slot of group j (< 16) in lanes_extreme16's input, so that its output is in
// group order: the four shuffle levels leave slot 4m + L's result in lane 4L + m.
constexpr int kTranspose4x4[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

// Lane j of the result = the lowest (kMax: highest) lane of v[kTranspose4x4[j]]: 16
// horizontal reductions as 4 levels of shuffles, 45 instructions. The order in which
// lanes meet only matters for the sign of a zero extremum, which the caller recomputes.
template <bool kMax>
KVQ_FORCE_INLINE __m512 lanes_extreme16(const __m512* v) {
  auto pick = [](__m512 a, __m512 b) {
    return kMax ? _mm512_maskz_max_ps(kAll16, a, b) : _mm512_maskz_min_ps(kAll16, a, b);
  };
  __m512 halves[8], quarters[4], pairs[2];
  KVQ_UNROLL for (int j = 0; j < 8; ++j)  // 256-bit halves of two vectors
    halves[j] = pick(_mm512_maskz_shuffle_f32x4(kAll16, v[2 * j], v[2 * j + 1], 0x44),
                     _mm512_maskz_shuffle_f32x4(kAll16, v[2 * j], v[2 * j + 1], 0xEE));
  KVQ_UNROLL for (int j = 0; j < 4; ++j)  // 128-bit lanes: one per input vector
    quarters[j] = pick(_mm512_maskz_shuffle_f32x4(kAll16, halves[2 * j], halves[2 * j + 1], 0x88),
                       _mm512_maskz_shuffle_f32x4(kAll16, halves[2 * j], halves[2 * j + 1], 0xDD));
  KVQ_UNROLL for (int j = 0; j < 2; ++j)  // pairs of floats inside each 128-bit lane
    pairs[j] = pick(_mm512_maskz_shuffle_ps(kAll16, quarters[2 * j], quarters[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                    _mm512_maskz_shuffle_ps(kAll16, quarters[2 * j], quarters[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return pick(_mm512_maskz_shuffle_ps(kAll16, pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
              _mm512_maskz_shuffle_ps(kAll16, pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// float_to_half_bits(f, saturate = true) of 16 non-NaN lanes: vcvtps2ph rounds like
// the scalar F16C path; finite lanes at or above 65520 saturate to ±65504 instead of ±∞.
KVQ_FORCE_INLINE __m256i encode_half_saturating(__m512 f) {
  const __m256i rounded = _mm512_maskz_cvtps_ph(kAll16, f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i abs = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  const __mmask16 big = _mm512_cmpge_epu32_mask(abs, _mm512_set1_epi32(0x477ff000)) &
                        _mm512_cmplt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
  const __m512i saturated = _mm512_or_si512(_mm512_maskz_srli_epi32(kAll16, _mm512_maskz_andnot_epi32(kAll16, abs, bits), 16), _mm512_set1_epi32(0x7bff));
  return _mm256_mask_mov_epi16(rounded, big, _mm512_maskz_cvtepi32_epi16(kAll16, saturated));
}

// Packs 64 codes (c[k] lane i = code of element 16k + i, in int32, each ≤ 2^Bits − 1
// or negative / INT_MIN for code 0) into 64·Bits/8 bytes, little-endian within a byte.
template <int Bits>
KVQ_FORCE_INLINE void pack64(const __m512i* c, std::uint8_t* out) {
  // Saturating packs: negatives become 0. Per 128-bit lane L they leave
  // c0[4L..4L+3], c1[4L..4L+3], c2[…], c3[…]; the dword permutation restores element order.
  const __m512i bytes_by_lane = _mm512_packus_epi16(_mm512_packus_epi32(c[0], c[1]), _mm512_packus_epi32(c[2], c[3]));
  const __m512i bytes = _mm512_maskz_permutexvar_epi32(
      kAll16, _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), bytes_by_lane);
  if constexpr (Bits == 8) {
    _mm512_storeu_si512(out, bytes);
  } else if constexpr (Bits == 4) {
    const __m512i pairs = _mm512_maddubs_epi16(bytes, _mm512_set1_epi16(0x1001));  // b0 + 16·b1
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_maskz_cvtepi16_epi8(~__mmask32(0), pairs));
  } else {
    static_assert(Bits == 2);
    const __m512i pairs = _mm512_maddubs_epi16(bytes, _mm512_set1_epi16(0x0401));            // b0 + 4·b1
    const __m512i quads = _mm512_madd_epi16(pairs, _mm512_set1_epi32(0x00100001));            // + 16·(b2 + 4·b3)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_maskz_cvtepi32_epi8(kAll16, quads));
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
// bits for each row). The rows go phase by phase, each over all n·D/G groups of the
// batch: lane-wise ranges, then 16 groups' horizontal min/max by one transpose, the
// metadata of 16 groups per vector (fp16; bf16/fp32 metadata is scalar per group),
// then codes and packing 64 elements at a time.
//   x[r] : [D] fp32;  packed[r] : [D·bits/8];  meta[r] : [D/G][2]
template <QuantSpec S, int D, int kMaxRows>
KVQ_FORCE_INLINE void quantize_rows_fast(int n, const float* const* x, std::uint8_t* const* packed,
                                         meta_storage_t<S.meta>* const* meta) {
#if KVQ_CPU_AVX512
  constexpr int G = S.group, NG = D / G;
  constexpr bool kClip = S.clips() && clip_rank(G, S.clip_permille) < G - 1;
  if constexpr (!kClip && G % 16 == 0 && D % 64 == 0) {
    using Meta = MetaTraits<S.meta>;
    constexpr int V = G / 16, kLevels = S.levels(), kSlots = (kMaxRows * NG + 15) / 16 * 16;
    alignas(64) float lo[kSlots], hi[kSlots], inv[kSlots];
    bool finite[kSlots];
    const int groups = n * NG;
    for (int base = 0; base < groups; base += 16) {
      const int count = groups - base < 16 ? groups - base : 16;
      // 1. Ranges: lane-wise min/max over each group's vectors (two chains), then the
      //    16 groups' lanes at once. Only a zero extremum's sign depends on the order in
      //    which lanes meet: it is recomputed in the scalar order.
      __m512 lo_lanes[16], hi_lanes[16];
      for (int j = 0; j < count; ++j) {
        const int i = base + j;
        const float* xg = x[i / NG] + (i % NG) * G;
        // fin: the sum of the group's elements, finite when every element is. A sum
        // that overflows only sends a finite group to the scalar quantizer, whose
        // result is the same.
        __m512 lo_v[2], hi_v[2], fin[2];
        KVQ_UNROLL for (int c = 0; c < 2 && c < V; ++c) fin[c] = lo_v[c] = hi_v[c] = _mm512_loadu_ps(xg + 16 * c);
        KVQ_UNROLL for (int k = 2; k < V; ++k) {
          const __m512 v = _mm512_loadu_ps(xg + 16 * k);
          lo_v[k % 2] = _mm512_maskz_min_ps(detail::kAll16, lo_v[k % 2], v);
          hi_v[k % 2] = _mm512_maskz_max_ps(detail::kAll16, hi_v[k % 2], v);
          fin[k % 2] = _mm512_add_ps(fin[k % 2], v);
        }
        if constexpr (V > 1) {
          lo_v[0] = _mm512_maskz_min_ps(detail::kAll16, lo_v[0], lo_v[1]);
          hi_v[0] = _mm512_maskz_max_ps(detail::kAll16, hi_v[0], hi_v[1]);
          fin[0] = _mm512_add_ps(fin[0], fin[1]);
        }
        // Class 0x99: QNaN, SNaN, +∞, −∞.
        finite[i] = _mm512_fpclass_ps_mask(fin[0], 0x99) == 0;
        lo_lanes[detail::kTranspose4x4[j]] = lo_v[0];
        hi_lanes[detail::kTranspose4x4[j]] = hi_v[0];
      }
      for (int j = count; j < 16; ++j)  // padding slots: any defined vector
        lo_lanes[detail::kTranspose4x4[j]] = hi_lanes[detail::kTranspose4x4[j]] = lo_lanes[0];
      const __m512 lo16 = detail::lanes_extreme16<false>(lo_lanes), hi16 = detail::lanes_extreme16<true>(hi_lanes);
      _mm512_store_ps(lo + base, lo16);
      _mm512_store_ps(hi + base, hi16);
      for (unsigned zero = _mm512_cmp_ps_mask(lo16, _mm512_setzero_ps(), _CMP_EQ_OQ) |
                           _mm512_cmp_ps_mask(hi16, _mm512_setzero_ps(), _CMP_EQ_OQ);
           zero != 0; zero &= zero - 1) {
        const int i = base + __builtin_ctz(zero);
        if (i < base + count && finite[i]) {
          const float* xg = x[i / NG] + (i % NG) * G;
          float l = xg[0], h = xg[0];
          for (int e = 1; e < G; ++e) l = fmin_f(l, xg[e]), h = fmax_f(h, xg[e]);
          lo[i] = l, hi[i] = h;
        }
      }
      // 2. Metadata: scale, stored {s, lo}, and 1/s (0 when s is stored as 0: codes 0).
      //    Non-finite groups are quantized by the scalar code after phase 3.
      if constexpr (S.meta == MetaType::fp16) {
        const __m512 lo16 = _mm512_load_ps(lo + base);  // after the zero fix
        const __m512 range = _mm512_maskz_max_ps(detail::kAll16, _mm512_sub_ps(_mm512_load_ps(hi + base), lo16),
                                                 _mm512_set1_ps(1e-8f));
        const __m256i scale_bits = detail::encode_half_saturating(_mm512_div_ps(range, _mm512_set1_ps(float(kLevels))));
        const __m256i lo_bits = detail::encode_half_saturating(lo16);
        const __m512 s_stored = _mm512_maskz_cvtph_ps(detail::kAll16, scale_bits);
        const __mmask16 nonzero = _mm512_cmp_ps_mask(s_stored, _mm512_setzero_ps(), _CMP_NEQ_UQ);
        _mm512_store_ps(lo + base, _mm512_maskz_cvtph_ps(detail::kAll16, lo_bits));
        _mm512_store_ps(inv + base, _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.f), s_stored));
        alignas(32) std::uint16_t s16[16], lo16_bits[16];
        _mm256_store_si256(reinterpret_cast<__m256i*>(s16), scale_bits);
        _mm256_store_si256(reinterpret_cast<__m256i*>(lo16_bits), lo_bits);
        for (int j = 0; j < count; ++j) {
          meta_storage_t<S.meta>* mg = meta[(base + j) / NG] + 2 * ((base + j) % NG);
          mg[0] = s16[j], mg[1] = lo16_bits[j];
        }
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
    // 3. Codes: ⌊(x − lo)·inv + 0.5⌋ clamped to [0, levels], 64 at a time. min(levels, t)
    //    keeps NaN (0·∞), whose conversion (INT_MIN) packs to 0 like a negative t: the
    //    scalar's !(v > 0). inv = 0 gives 0 everywhere, the scalar's s = 0 result.
    const __m512 half = _mm512_set1_ps(0.5f), top = _mm512_set1_ps(float(kLevels));
    for (int r = 0; r < n; ++r)
      for (int e0 = 0; e0 < D; e0 += 64) {
        __m512i codes[4];
        KVQ_UNROLL for (int k = 0; k < 4; ++k) {
          const int e = e0 + 16 * k, i = r * NG + e / G;
          const __m512 t = _mm512_add_ps(
              _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x[r] + e), _mm512_set1_ps(lo[i])), _mm512_set1_ps(inv[i])), half);
          codes[k] = _mm512_maskz_cvt_roundps_epi32(detail::kAll16, _mm512_maskz_min_ps(detail::kAll16, top, t),
                                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
        }
        detail::pack64<S.bits>(codes, packed[r] + e0 * S.bits / 8);
      }
    // The defined non-finite result (DESIGN §2), over whatever phase 3 wrote there.
    for (int i = 0; i < groups; ++i)
      if (!finite[i]) quantize_group<S>(x[i / NG] + (i % NG) * G, packed[i / NG] + (i % NG) * (G * S.bits / 8), meta[i / NG] + 2 * (i % NG));
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
    if constexpr (S.centered) {
#if KVQ_CPU_AVX512
      for (int i = 0; i < D; i += 16)
        _mm512_storeu_ps(x + i, _mm512_sub_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(mean + h * D + i)));
#else
      for (int i = 0; i < D; ++i) x[i] = sub_rn(x[i], mean[h * D + i]);
#endif
    }
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
