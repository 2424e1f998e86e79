// kvq/cpu/code_fields.hpp — one b-bit field of every packed byte of a zmm, as a byte.
//
// Field k of byte x is (x >> k·b) & (2^b − 1): slab k of the CPU decode's slab order
// (query_int8.hpp): a 64-bit shift (bits that cross from the next byte land above bit b
// and are masked off) and an and; field 0 is the and alone.
// Why these two instructions: on Zen 4 (512-bit operations on 256-bit pipes) vpdpbusd
// shares its pipes with gf2p8affineqb, vpsrlw/vpsrld and, in part, vpandd, so each of
// those costs a product's slot in the decode's inner loops, while vpsrlq and the
// FP-domain vandps issue elsewhere (4 of each beside 12 independent vpdpbusd: +0 cycles;
// 4 gf2p8affineqb, vpsrlw or vpunpckldq: +4). The K4V2 / K2V2 fastest decode, 4K warm:
// 105.5 → 103.7 / 99.6 → 97.6 µs against gf2p8affineqb. On Zen 5 shifts and ands were
// free already and gf2p8affineqb cost a fifth of a product (benchmarks/README.md). On another Zen 4
// (family 25 model 17, 2026-12-06) the same test gave +0 for vpunpckldq, vpsrld and vpandd
// as well; there only vpermt2d, vfmadd231ps and vpmultishiftqb took a product's slot (+4).
#pragma once

#include "kvq/cpu/isa.hpp"

namespace kvq::detail {

#if KVQ_CPU_AVX512
template <int Bits, int K>
KVQ_FORCE_INLINE __m512i code_field(__m512i x) {
  static_assert(Bits == 2 || Bits == 4 || Bits == 8, "kvq: codes are 2, 4 or 8 bits");
  static_assert(K >= 0 && K * Bits < 8);
  if constexpr (Bits == 8) {
    return x;
  } else {
    // Masked forms with an explicit source (GCC 12 warns on the _undefined_ ones).
    const __m512 mask = _mm512_castsi512_ps(_mm512_set1_epi8(char((1u << Bits) - 1u)));
    const __m512i shifted = K == 0 ? x : _mm512_maskz_srli_epi64(0xFF, x, unsigned(K * Bits));
    return _mm512_castps_si512(_mm512_maskz_and_ps(0xFFFF, _mm512_castsi512_ps(shifted), mask));
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
// acc + vpdpbusd(u8 a, s8 b) with the accumulator tied to its register (b may come from
// memory). Through the intrinsic, GCC 12 copies loop-carried and freshly zeroed
// accumulators out and back around the products (up to 183 zmm moves per 16 tokens in
// the key scoring; spills in the value sums). Same integers; key scoring of a 32-token
// block at 4 rows 99 → 92 ns in an L1-resident micro-benchmark (Zen 5). Taken and
// returned by value: bound to a reference (an array element), the accumulators were
// also stored to the stack after every chain. Clang takes the intrinsic: given "vm", it
// always picks the memory alternative and stored b to the stack before every product
// (clang 14: K4V2 fastest decode, 4K tokens warm, 175 µs against GCC's 100).
KVQ_FORCE_INLINE __m512i dpbusd_tied(__m512i acc, __m512i a, const __m512i& b) {
#if defined(__clang__)
  return _mm512_dpbusd_epi32(acc, a, b);
#else
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "vm"(b));
  return acc;
#endif
}
#endif

}  // namespace kvq::detail
