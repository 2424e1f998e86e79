// kvq/cpu/code_fields.hpp — one b-bit field of every packed byte of a zmm, as a byte.
//
// Field k of byte x is (x >> k·b) & (2^b − 1): slab k of the CPU decode's slab order
// (query_int8.hpp). With GFNI it is one gf2p8affineqb (a GF(2) matrix that moves bits
// k·b .. k·b + b − 1 of each byte to bits 0 .. b − 1 and clears the rest), else a 16-bit
// shift and a mask; field 0 is a mask alone. Both give the same bytes; the decode's inner
// loops are bound by the two 512-bit vector ports, where this saves one uop per field.
#pragma once

#include <cstdint>

#include "kvq/cpu/isa.hpp"

namespace kvq::detail {

#if KVQ_CPU_AVX512
// gf2p8affineqb's matrix: byte 7 − i of the qword selects the input bits of output bit i.
template <int Bits, int K>
constexpr std::uint64_t field_matrix() {
  std::uint64_t a = 0;
  for (int i = 0; i < Bits; ++i) a |= std::uint64_t(1u << (K * Bits + i)) << (8 * (7 - i));
  return a;
}

template <int Bits, int K>
KVQ_FORCE_INLINE __m512i code_field(__m512i x) {
  static_assert(Bits == 2 || Bits == 4 || Bits == 8, "kvq: codes are 2, 4 or 8 bits");
  static_assert(K >= 0 && K * Bits < 8);
  if constexpr (Bits == 8) {
    return x;
  } else if constexpr (K == 0) {
    return _mm512_and_si512(x, _mm512_set1_epi8(char((1u << Bits) - 1u)));
  } else {
#if KVQ_CPU_GFNI
    // Masked form with an explicit source (GCC 12 warns on the _undefined_ ones).
    return _mm512_maskz_gf2p8affine_epi64_epi8(~__mmask64(0), x, _mm512_set1_epi64(std::int64_t(field_matrix<Bits, K>())), 0);
#else
    // A 16-bit shift brings the next byte's low bits into this byte's top: the mask clears them.
    return _mm512_and_si512(_mm512_srli_epi16(x, unsigned(K * Bits)), _mm512_set1_epi8(char((1u << Bits) - 1u)));
#endif
  }
}

// code_field for a runtime k (unrolled loops pass constants, which fold).
template <int Bits>
KVQ_FORCE_INLINE __m512i code_field(__m512i x, int k) {
  if constexpr (Bits == 8) {
    return x;
  } else if constexpr (Bits == 4) {
    return k == 0 ? code_field<4, 0>(x) : code_field<4, 1>(x);
  } else {
    switch (k) {
      case 0: return code_field<2, 0>(x);
      case 1: return code_field<2, 1>(x);
      case 2: return code_field<2, 2>(x);
      default: return code_field<2, 3>(x);
    }
  }
}
#endif

#if KVQ_CPU_AVX512_VNNI
// acc += vpdpbusd(u8 a, s8 b) with the accumulator tied to its register (b may come
// from memory). Through the intrinsic, GCC 12 copies loop-carried and freshly zeroed
// accumulators out and back around the products (up to 183 zmm moves per 16 tokens in
// the key scoring; spills in the value sums). Same integers; key scoring of a 32-token
// block at 4 rows 99 → 92 ns in an L1-resident micro-benchmark (Zen 5).
KVQ_FORCE_INLINE void dpbusd_in_place(__m512i& acc, __m512i a, const __m512i& b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
}
#endif

}  // namespace kvq::detail
