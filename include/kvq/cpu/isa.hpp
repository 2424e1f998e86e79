// kvq/cpu/isa.hpp — every instruction-set check of kvq's CPU code, in one place.
//
// kvq never dispatches at run time: the engine's compiler flags (-march=...) choose the
// paths, and each KVQ_CPU_* macro below is 1 exactly when its instructions may be used
// in this translation unit. nvcc's passes get none of them (the CUDA tests include the
// CPU reference, which then runs its portable loops). Every SIMD path has a portable
// twin that is always compiled (the `generic` functions), and tests/cpu compares them.
#pragma once

#include "kvq/core/config.hpp"

#if KVQ_GNU_HOST && (defined(__x86_64__) || defined(__i386__))
#define KVQ_CPU_X86 1
#else
#define KVQ_CPU_X86 0
#endif

// KVQ_CPU_F16C        fp16 ↔ fp32 conversions in hardware (vcvtph2ps / vcvtps2ph)
// KVQ_CPU_FMA         fused multiply-add (vfmadd*)
// KVQ_CPU_AVX2        256-bit integer SIMD (vpmaddubsw, vpmaddwd)
// KVQ_CPU_AVX512      512-bit SIMD with byte/word ops and mask registers (F, BW, DQ, VL)
// KVQ_CPU_AVX512_VNNI vpdpbusd: u8×s8 dot products of four bytes into int32 lanes
// KVQ_CPU_AVX512_VBMI vpermb: any permutation of a zmm's 64 bytes
#if KVQ_CPU_X86 && defined(__F16C__)
#define KVQ_CPU_F16C 1
#else
#define KVQ_CPU_F16C 0
#endif
#if KVQ_CPU_X86 && defined(__FMA__)
#define KVQ_CPU_FMA 1
#else
#define KVQ_CPU_FMA 0
#endif
#if KVQ_CPU_X86 && defined(__AVX2__)
#define KVQ_CPU_AVX2 1
#else
#define KVQ_CPU_AVX2 0
#endif
#if KVQ_CPU_X86 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define KVQ_CPU_AVX512 1
#else
#define KVQ_CPU_AVX512 0
#endif
#if KVQ_CPU_AVX512 && defined(__AVX512VNNI__)
#define KVQ_CPU_AVX512_VNNI 1
#else
#define KVQ_CPU_AVX512_VNNI 0
#endif
#if KVQ_CPU_AVX512 && defined(__AVX512VBMI__)
#define KVQ_CPU_AVX512_VBMI 1
#else
#define KVQ_CPU_AVX512_VBMI 0
#endif

#if KVQ_CPU_X86
#include <immintrin.h>
#endif

namespace kvq::cpu {

// Floats per native vector: 16 with AVX-512F, 8 with AVX, else 4 (SSE2 / NEON).
#if KVQ_CPU_X86 && defined(__AVX512F__)
inline constexpr int kNativeFloatLanes = 16;
#elif KVQ_CPU_X86 && defined(__AVX__)
inline constexpr int kNativeFloatLanes = 8;
#else
inline constexpr int kNativeFloatLanes = 4;
#endif

// The width of the fp32 logits' vectors (kvq/cpu/tile.hpp: Q·Kᵀ over fp16/bf16/fp32 pages
// and fp32 key tiles), in bits: 512 or 256 with AVX-512, the native width otherwise. Zen 4
// splits every 512-bit operation over its 256-bit pipes, and there 256-bit logits are
// faster: 42.6 → 34.2 cycles per token at 4 query rows, d 128, from L1; the fp16 pages'
// decode 4K warm 236 → 220 µs, 32K cold 2.51–2.60 → 2.42–2.45 ms, and equal or faster at
// d 64/128/256 and GQA 1–16 (benchmarks/README.md, 2026-12-05). (256-bit value sums were faster from L1
// too, 36.3 → 33.1, but with twice the column passes over a block they took the cold decode
// to 2.65 ms; they stay native.) Cores with 512-bit datapaths (Intel's two-FMA-unit cores,
// Zen 5) should keep 512; not measured. The default follows the compiler's -mtune: 256 when
// tuning for Zen 4 (GCC 12's -march=native there says znver3, a core without AVX-512). At
// 256 bits each logit sums its products in 8 lanes instead of 16, as the AVX2 build does.
#ifndef KVQ_CPU_FP32_LOGIT_BITS
#if defined(__AVX512F__) && (defined(__tune_znver4__) || defined(__tune_znver3__))
#define KVQ_CPU_FP32_LOGIT_BITS 256
#else
#define KVQ_CPU_FP32_LOGIT_BITS 512
#endif
#endif
static_assert(KVQ_CPU_FP32_LOGIT_BITS == 256 || KVQ_CPU_FP32_LOGIT_BITS == 512,
              "kvq: KVQ_CPU_FP32_LOGIT_BITS must be 256 or 512");
inline constexpr int kLogitFloatLanes =
    kNativeFloatLanes < KVQ_CPU_FP32_LOGIT_BITS / 32 ? kNativeFloatLanes : KVQ_CPU_FP32_LOGIT_BITS / 32;

// The width of the append's FWHT vectors (kvq/cpu/quantize.hpp), in bits: 512 or 256 with
// AVX-512, 256 with AVX2 alone. At d 128 sixteen ymm take 160 instructions (3 in-vector
// stages of a permute and an FMA, 4 between vectors of one add or subtract), eight zmm 88
// (4 and 3). A Zen 4 issues a zmm as two ymm halves, and there the ymm form was faster
// (a K2V2_HC row 83 → 76 cycles, 2026-12-05); a core with full-width 512-bit pipes issues
// the 88 at the ymm's rate. The default follows -mtune as the logits' width does.
#ifndef KVQ_CPU_FWHT_BITS
#if defined(__AVX512F__) && !(defined(__tune_znver4__) || defined(__tune_znver3__))
#define KVQ_CPU_FWHT_BITS 512
#else
#define KVQ_CPU_FWHT_BITS 256
#endif
#endif
static_assert(KVQ_CPU_FWHT_BITS == 256 || KVQ_CPU_FWHT_BITS == 512, "kvq: KVQ_CPU_FWHT_BITS must be 256 or 512");

// The paths this translation unit was built with, for benchmark and log headers.
constexpr const char* isa_name() {
  if constexpr (KVQ_CPU_AVX512_VNNI && KVQ_CPU_AVX512_VBMI) return KVQ_CPU_F16C ? "avx512+vnni+vbmi+f16c" : "avx512+vnni+vbmi";
  if constexpr (KVQ_CPU_AVX512_VNNI) return KVQ_CPU_F16C ? "avx512+vnni+f16c" : "avx512+vnni";
  if constexpr (KVQ_CPU_AVX512) return KVQ_CPU_F16C ? "avx512+f16c" : "avx512";
  if constexpr (KVQ_CPU_AVX2) return KVQ_CPU_F16C ? "avx2+f16c" : "avx2";
  if constexpr (KVQ_CPU_X86) return "x86-64 (sse2)";
  return "generic";
}

}  // namespace kvq::cpu
