// kvq/cpu/tile.hpp — register-blocked fp32 tile products of the CPU decode
// (DESIGN §9).
//
// The two products of a block of up to kTokensPerBlock tokens:
//   logits : S[r][j]  = Σ_i Q[r][i]·K[j][i]      Q [rows][D], K [n][D]
//   values : A[r][i] += Σ_j P[r][j]·V[j][i]      S, P [kMaxRowsPerPass][kTokensPerBlock]
// K and V come from an fp32 tile that stays in L1 (dequantized codes with
// KeyScoring/ValueAccumulation::fp32_tiles, or fp16/bf16 rows for more than 8 query
// rows) or straight from fp16/bf16/fp32 rows converted in registers (the full-precision
// pages up to 8 query rows). Rows are blocked by 4 (1 for a single row, 8 when there are
// exactly 8), tokens by 4; callers pad Q, P and the keys with zeros up to those multiples.
//
// SIMD width follows the compiler's target flags, chosen by the engine: 16 floats with
// AVX-512F, 8 with AVX, else 4 (SSE2 / NEON), through GCC/Clang vector extensions; the
// logits take 8 with AVX-512 where KVQ_CPU_FP32_LOGIT_BITS is 256 (kvq/cpu/isa.hpp: the
// default when tuning for Zen 4). Other compilers, and nvcc (whose tests include the CPU
// reference), use a lane loop.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "kvq/core/config.hpp"
#include "kvq/core/numeric.hpp"
#include "kvq/cpu/isa.hpp"

namespace kvq::detail {

inline constexpr int kMaxRowsPerPass = 16;  // query rows sharing one pass over the keys
// Tokens per block: one rescale, one softmax reduction, one set of int8 value weights
// per row and block. 64 rather than 32 halves that per-block work: K4V2 / K2V2 fastest
// decode at 32K cold on a Zen 4 810 → 800 / 767 → 715 µs (benchmarks/README.md); fp16 pages the same.
// The int8 value weights then keep 8 bits per 64 tokens.
inline constexpr int kTokensPerBlock = 64;
// Tokens per fp32 tile (the fp32-tile paths run a block as tiles of this many): 16 KB at
// d 128, which L1 holds beside the rows it is filled from. A 64-token tile made the fp32
// key and value tiles 5–11% slower (Zen 4, 32K cold).
inline constexpr int kTileTokens = 32;

using cpu::kLogitFloatLanes;
using cpu::kNativeFloatLanes;

// KVQ_UNROLL (config.hpp) fully unrolls the register blocks below, so they stay in
// registers.

// Widest vector of at most `widest` floats that divides D (D is a multiple of 4 wherever
// this is used): native for the value sums, KVQ_CPU_FP32_LOGIT_BITS for the logits.
constexpr int lanes_for(int d, int widest = kNativeFloatLanes) {
  int w = widest;
  while (w > 4 && d % w != 0) w /= 2;
  return w;
}
constexpr int logit_lanes_for(int d) { return lanes_for(d, kLogitFloatLanes); }

#if KVQ_GNU_HOST
template <int W>
struct FloatVecType;
template <>
struct FloatVecType<4> { typedef float type __attribute__((vector_size(16))); };
template <>
struct FloatVecType<8> { typedef float type __attribute__((vector_size(32))); };
template <>
struct FloatVecType<16> { typedef float type __attribute__((vector_size(64))); };
template <int W>
using FloatVec = typename FloatVecType<W>::type;
// N lanes of T as a GCC/Clang vector.
template <class T, int N>
struct GnuVec {
  typedef T type __attribute__((vector_size(N * sizeof(T))));
};
#else
template <int W>
struct FloatVec {
  float lane[W];
  KVQ_FORCE_INLINE float operator[](int i) const { return lane[i]; }
  friend KVQ_FORCE_INLINE FloatVec operator+(FloatVec a, const FloatVec& b) {
    for (int i = 0; i < W; ++i) a.lane[i] += b.lane[i];
    return a;
  }
  friend KVQ_FORCE_INLINE FloatVec operator-(FloatVec a, const FloatVec& b) {
    for (int i = 0; i < W; ++i) a.lane[i] -= b.lane[i];
    return a;
  }
  friend KVQ_FORCE_INLINE FloatVec operator*(FloatVec a, const FloatVec& b) {
    for (int i = 0; i < W; ++i) a.lane[i] *= b.lane[i];
    return a;
  }
  friend KVQ_FORCE_INLINE FloatVec operator*(float s, FloatVec a) {
    for (int i = 0; i < W; ++i) a.lane[i] *= s;
    return a;
  }
  KVQ_FORCE_INLINE FloatVec& operator+=(const FloatVec& b) { return *this = *this + b; }
};
#endif

template <int W>
KVQ_FORCE_INLINE FloatVec<W> load_vec(const float* p) {
  FloatVec<W> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <int W>
KVQ_FORCE_INLINE void store_vec(float* p, const FloatVec<W>& v) {
  std::memcpy(p, &v, sizeof v);
}

template <int W>
KVQ_FORCE_INLINE FloatVec<W> zero_vec() {
  FloatVec<W> v;
  std::memset(&v, 0, sizeof v);
  return v;
}

// Sum of the lanes by halving: lane l + lane l + W/2, then the same on the lower
// half, down to one lane (a shuffle and an add per step). By value, with no address
// taken, so the accumulators stay in registers.
template <int W>
KVQ_FORCE_INLINE float sum_lanes(FloatVec<W> v) {
#if KVQ_GNU_HOST
  if constexpr (W == 16) {
    return sum_lanes<8>(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                        __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  } else if constexpr (W == 8) {
    return sum_lanes<4>(__builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7));
  } else if constexpr (W == 4) {
    const FloatVec<4> pairs = v + __builtin_shufflevector(v, v, 2, 3, 0, 1);
    return pairs[0] + pairs[1];
  } else
#endif
  {
    float lane[W];
    for (int i = 0; i < W; ++i) lane[i] = v[i];
    for (int w = W / 2; w >= 1; w /= 2)
      for (int i = 0; i < w; ++i) lane[i] += lane[i + w];
    return lane[0];
  }
}

// Largest lane by the same halving (a NaN lane may or may not win; callers that must see
// NaN track it apart).
template <int W>
KVQ_FORCE_INLINE float max_lanes(FloatVec<W> v) {
#if KVQ_GNU_HOST
  if constexpr (W == 16) {
    const FloatVec<8> a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
    const FloatVec<8> b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    return max_lanes<8>(b > a ? b : a);
  } else if constexpr (W == 8) {
    const FloatVec<4> a = __builtin_shufflevector(v, v, 0, 1, 2, 3), b = __builtin_shufflevector(v, v, 4, 5, 6, 7);
    return max_lanes<4>(b > a ? b : a);
  } else if constexpr (W == 4) {
    const FloatVec<4> swapped = __builtin_shufflevector(v, v, 2, 3, 0, 1);
    const FloatVec<4> pairs = swapped > v ? swapped : v;
    return pairs[1] > pairs[0] ? pairs[1] : pairs[0];
  } else
#endif
  {
    float lane[W];
    for (int i = 0; i < W; ++i) lane[i] = v[i];
    for (int w = W / 2; w >= 1; w /= 2)
      for (int i = 0; i < w; ++i) lane[i] = lane[i + w] > lane[i] ? lane[i + w] : lane[i];
    return lane[0];
  }
}

#if KVQ_GNU_HOST
// lane m of sums = sum_lanes<8>(x[m]) for m < 8 (the same additions in the same order),
// as one transpose-and-add tree: 21 instructions instead of 8·6. (Results by reference:
// returning a 32-byte vector would change the ABI in translation units without AVX.)
KVQ_FORCE_INLINE void sum_lanes_8x8(const FloatVec<8>* x, FloatVec<8>& sums) {
  FloatVec<8> t[4], u[2];
  KVQ_UNROLL for (int i = 0; i < 4; ++i)  // l + l+4: [x[i] | x[i+4]]
    t[i] = __builtin_shufflevector(x[i], x[i + 4], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(x[i], x[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
  KVQ_UNROLL for (int i = 0; i < 2; ++i)  // l + l+2: pairs of x[i], x[i+2], x[i+4], x[i+6]
    u[i] = __builtin_shufflevector(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
  sums = __builtin_shufflevector(u[0], u[1], 0, 8, 2, 10, 4, 12, 6, 14) +  // l + l+1
         __builtin_shufflevector(u[0], u[1], 1, 9, 3, 11, 5, 13, 7, 15);
}
KVQ_FORCE_INLINE void sum_lanes_8x8(const FloatVec<8>* x, float* out) {
  FloatVec<8> sums;
  sum_lanes_8x8(x, sums);
  std::memcpy(out, &sums, sizeof sums);
}
#endif

#if KVQ_CPU_AVX512
// Four 16-lane reductions folded together, each in the halving order of sum_lanes<16> /
// max_lanes<16> (lane l ∘ l + 8, then l + 4, l + 2, l + 1), so each result equals its
// one-row fold bit for bit; the rows share the shuffles and the latency chain. ∘ is
// b > a ? b : a (max_lanes' select, also for the sign of zero) or a + b; the builtins
// behind the masked forms are never contracted into an FMA. Row q's result is lane 4q.
// vmaxps(b, a) is that select exactly (b where b > a, else a: NaN and ±0 included) in one
// instruction where a compare and a blend took two on the softmax's latency chain (K2V2
// fastest decode ~2% faster on a Zen 4).
KVQ_FORCE_INLINE __m512 fold_op(__m512 a, __m512 b, bool max) {
  return max ? _mm512_maskz_max_ps(0xFFFF, b, a) : _mm512_maskz_add_ps(0xFFFF, a, b);
}

KVQ_FORCE_INLINE __m512 fold_rows4(__m512 v0, __m512 v1, __m512 v2, __m512 v3, bool max) {
  auto op = [max](__m512 a, __m512 b) { return fold_op(a, b, max); };
  // [a.lo256 | b.lo256] ∘ [a.hi256 | b.hi256]: lane l ∘ lane l + 8 of rows a and b.
  auto halves = [&](__m512 a, __m512 b) {
    return op(_mm512_maskz_shuffle_f32x4(0xFFFF, a, b, 0x44), _mm512_maskz_shuffle_f32x4(0xFFFF, a, b, 0xEE));
  };
  const __m512 ab = halves(v0, v1), cd = halves(v2, v3);
  // Lane l ∘ lane l + 4: 128-bit lane q of the result holds row q's four partials.
  __m512 x = op(_mm512_maskz_shuffle_f32x4(0xFFFF, ab, cd, 0x88), _mm512_maskz_shuffle_f32x4(0xFFFF, ab, cd, 0xDD));
  x = op(x, _mm512_maskz_permute_ps(0xFFFF, x, 0x4E));     // l ∘ l + 2
  return op(x, _mm512_maskz_permute_ps(0xFFFF, x, 0xB1));  // l ∘ l + 1
}

// The integer sums of four rows (exact, so any order would do), row q in lane 4q.
KVQ_FORCE_INLINE __m512i fold_rows4_epi32(__m512i v0, __m512i v1, __m512i v2, __m512i v3) {
  auto halves = [](__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_maskz_shuffle_i32x4(0xFFFF, a, b, 0x44), _mm512_maskz_shuffle_i32x4(0xFFFF, a, b, 0xEE));
  };
  const __m512i ab = halves(v0, v1), cd = halves(v2, v3);
  __m512i x = _mm512_add_epi32(_mm512_maskz_shuffle_i32x4(0xFFFF, ab, cd, 0x88), _mm512_maskz_shuffle_i32x4(0xFFFF, ab, cd, 0xDD));
  x = _mm512_add_epi32(x, _mm512_maskz_shuffle_epi32(0xFFFF, x, _MM_PERM_BADC));
  return _mm512_add_epi32(x, _mm512_maskz_shuffle_epi32(0xFFFF, x, _MM_PERM_CDAB));
}
#endif

// out[m] = sum_lanes<W>(v[m]) for m < 16, with the same additions in the same order,
// but the 16 reductions share their shuffles: a transpose-and-add tree of 45
// instructions at W = 16 instead of 16·8.
template <int W>
KVQ_FORCE_INLINE void sum_lanes_16(const FloatVec<W>* v, float* out) {
#if KVQ_GNU_HOST
  if constexpr (W == 16) {
    FloatVec<16> t[8], u[4], w[2];
    KVQ_UNROLL for (int i = 0; i < 8; ++i)  // lanes l + l+8: [v[i] | v[i+8]]
      t[i] = __builtin_shufflevector(v[i], v[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
             __builtin_shufflevector(v[i], v[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    KVQ_UNROLL for (int i = 0; i < 4; ++i)  // l + l+4: [v[i] | v[i+4] | v[i+8] | v[i+12]]
      u[i] = __builtin_shufflevector(t[i], t[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
             __builtin_shufflevector(t[i], t[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    KVQ_UNROLL for (int i = 0; i < 2; ++i)  // l + l+2: pairs of v[i], v[i+2], …, v[i+14]
      w[i] = __builtin_shufflevector(u[i], u[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
             __builtin_shufflevector(u[i], u[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    const FloatVec<16> sums =  // l + l+1: lane m holds v[m]'s sum
        __builtin_shufflevector(w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
        __builtin_shufflevector(w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    std::memcpy(out, &sums, sizeof sums);
    return;
  } else if constexpr (W == 8) {
    sum_lanes_8x8(v, out);
    sum_lanes_8x8(v + 8, out + 8);
    return;
  }
#endif
  for (int m = 0; m < 16; ++m) out[m] = sum_lanes<W>(v[m]);
}

// The products below read their keys and values through an accessor:
//   load<W>(j, i) → FloatVec<W> of elements i .. i+W of token j
// either from an fp32 tile (TileAt) or straight from rows of fp16/bf16/fp32, converted
// in registers (RowsAt); the operations, and so the bits, are the same for both.

// W elements of a row of T at src, as fp32 (every fp16/bf16 value converts exactly).
template <int W, ActivationType T>
KVQ_FORCE_INLINE FloatVec<W> load_as_float(const T* KVQ_RESTRICT src) {
  FloatVec<W> v;
  if constexpr (std::is_same_v<T, float>) {
    v = load_vec<W>(src);
#if KVQ_CPU_AVX512  // the maskz forms: GCC 12's plain ones read an uninitialized source (-Wmaybe-uninitialized)
  } else if constexpr (W == 16 && std::is_same_v<T, half_t>) {
    const __m512 x = _mm512_maskz_cvtph_ps(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
    std::memcpy(&v, &x, sizeof v);
  } else if constexpr (W == 16) {  // bf16 bits << 16 is the fp32 value
    const __m512i x = _mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))), 16);
    std::memcpy(&v, &x, sizeof v);
#endif
#if KVQ_CPU_F16C
  } else if constexpr (W == 8 && std::is_same_v<T, half_t>) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
    std::memcpy(&v, &x, sizeof v);
#endif
#if KVQ_CPU_AVX2
  } else if constexpr (W == 8 && std::is_same_v<T, bfloat16_t>) {
    const __m256i x = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))), 16);
    std::memcpy(&v, &x, sizeof v);
#endif
  } else {
    float lane[W];
    for (int l = 0; l < W; ++l) lane[l] = to_float(src[l]);
    std::memcpy(&v, lane, sizeof v);
  }
  return v;
}

// Accessor of an fp32 tile [n][D].
template <int D>
struct TileAt {
  const float* KVQ_RESTRICT tile;  // [count][D], token first first
  int first;
  template <int W>
  KVQ_FORCE_INLINE FloatVec<W> load(int j, int i) const {
    return load_vec<W>(tile + (j - first) * D + i);
  }
};

// Accessor of rows of T: row[j] points at token j's [D] elements.
template <int D, ActivationType T>
struct RowsAt {
  const T* const* row;
  template <int W>
  KVQ_FORCE_INLINE FloatVec<W> load(int j, int i) const {
    return load_as_float<W>(row[j] + i);
  }
};

// Makes the compiler hold v in a register: GCC otherwise folds a query vector that TB
// products share into each product as a memory operand, one load per product, and 256-bit
// logits then ran 48 instead of 34 cycles per token (Zen 4, 4 rows, d 128).
template <class V>
KVQ_FORCE_INLINE void keep_in_register(V& v) {
#if KVQ_CPU_X86
  asm("" : "+v"(v));
#else
  (void)v;
#endif
}

// S[r][j] for r < RB, j < TB over one row block and one token block, in W-lane vectors.
template <int D, int RB, int TB, int W, class KeyAt>
KVQ_FORCE_INLINE void logits_block(const float* KVQ_RESTRICT q, const KeyAt& key_at, int r0, int j0,
                                   float (*KVQ_RESTRICT s)[kTokensPerBlock]) {
  static_assert(W <= kNativeFloatLanes && D % W == 0);
  FloatVec<W> acc[RB][TB];
  KVQ_UNROLL for (int r = 0; r < RB; ++r)
    KVQ_UNROLL for (int j = 0; j < TB; ++j) acc[r][j] = zero_vec<W>();
  for (int i = 0; i < D; i += W) {
    FloatVec<W> kv[TB];
    KVQ_UNROLL for (int j = 0; j < TB; ++j) kv[j] = key_at.template load<W>(j0 + j, i);
    KVQ_UNROLL for (int r = 0; r < RB; ++r) {
      FloatVec<W> qv = load_vec<W>(q + (r0 + r) * D + i);
      keep_in_register(qv);
      KVQ_UNROLL for (int j = 0; j < TB; ++j) acc[r][j] += qv * kv[j];
    }
  }
  if constexpr (RB * TB == 16) {
    alignas(64) float sums[16];
    sum_lanes_16<W>(&acc[0][0], sums);
    KVQ_UNROLL for (int r = 0; r < RB; ++r) std::memcpy(&s[r0 + r][j0], sums + r * TB, TB * sizeof(float));
  } else {
    KVQ_UNROLL for (int r = 0; r < RB; ++r)
      KVQ_UNROLL for (int j = 0; j < TB; ++j) s[r0 + r][j0 + j] = sum_lanes<W>(acc[r][j]);
  }
}

struct NoGroupHook {
  void operator()(int) const {}
};

// S = Q·Kᵀ for rows_padded rows (1 or a multiple of 4) and tokens first .. first +
// n_padded (n_padded a multiple of 4). Up to 8 rows share each key load (so rows
// converted in registers are converted once); more rows take blocks of 4.
// before_group(j0) runs before each group of 4 tokens (the fp16 source spreads its
// prefetches there). W: the lanes that each logit's products are summed in (the tests
// take both widths of an AVX-512 build).
template <int D, int W = logit_lanes_for(D), class KeyAt, class GroupHook = NoGroupHook>
void logits_of(const float* q, int rows_padded, const KeyAt& key_at, int first, int n_padded,
               float (*s)[kTokensPerBlock], const GroupHook& before_group = {}) {
  for (int j0 = first; j0 < first + n_padded; j0 += 4) {
    before_group(j0);
    if (rows_padded == 1) {
      logits_block<D, 1, 4, W>(q, key_at, 0, j0, s);
    } else if (rows_padded == 8) {
      logits_block<D, 8, 2, W>(q, key_at, 0, j0, s);
      logits_block<D, 8, 2, W>(q, key_at, 0, j0 + 2, s);
    } else {
      for (int r0 = 0; r0 < rows_padded; r0 += 4) logits_block<D, 4, 4, W>(q, key_at, r0, j0, s);
    }
  }
}

// k: the tile [n_padded][D] of tokens first .. first + n_padded.
template <int D, int W = logit_lanes_for(D)>
void tile_logits(const float* q, int rows_padded, const float* k, int first, int n_padded, float (*s)[kTokensPerBlock]) {
  logits_of<D, W>(q, rows_padded, TileAt<D>{k, first}, first, n_padded, s);
}

// Vectors per column chunk of accumulate_rows for RB rows: up to four (RB × C
// accumulators stay in registers).
template <int D, int RB>
constexpr int accumulate_chunk_vectors() {
  constexpr int W = lanes_for(D);
  return D % (4 * W) == 0 && RB <= 4 ? 4 : (D % (2 * W) == 0 ? 2 : 1);
}

// A[r0..r0+RB) += Pᵀ·V over tokens first .. first + n, D in chunks of
// accumulate_chunk_vectors. Tokens in order: two calls over consecutive ranges give the
// bits of one.
template <int D, int RB, class ValueAt>
KVQ_FORCE_INLINE void accumulate_rows(const float (*KVQ_RESTRICT p)[kTokensPerBlock], int r0, const ValueAt& value_at,
                                      int first, int n, float* KVQ_RESTRICT acc) {
  constexpr int W = lanes_for(D);
  constexpr int C = accumulate_chunk_vectors<D, RB>();
  for (int i = 0; i < D; i += C * W) {
    FloatVec<W> a[RB][C];
    KVQ_UNROLL for (int r = 0; r < RB; ++r)
      KVQ_UNROLL for (int c = 0; c < C; ++c) a[r][c] = load_vec<W>(acc + (r0 + r) * D + i + c * W);
    for (int j = first; j < first + n; ++j) {
      FloatVec<W> vv[C];
      KVQ_UNROLL for (int c = 0; c < C; ++c) vv[c] = value_at.template load<W>(j, i + c * W);
      KVQ_UNROLL for (int r = 0; r < RB; ++r) {
        const float w = p[r0 + r][j];
        KVQ_UNROLL for (int c = 0; c < C; ++c) a[r][c] += w * vv[c];
      }
    }
    KVQ_UNROLL for (int r = 0; r < RB; ++r)
      KVQ_UNROLL for (int c = 0; c < C; ++c) store_vec<W>(acc + (r0 + r) * D + i + c * W, a[r][c]);
  }
}

// A += Pᵀ·V for rows_padded rows (1 or a multiple of 4); as in logits_of, up to 8 rows
// share each value load.
template <int D, class ValueAt>
void accumulate_of(const float (*p)[kTokensPerBlock], int rows_padded, const ValueAt& value_at, int first, int n,
                   float* acc) {
  if (rows_padded == 1) {
    accumulate_rows<D, 1>(p, 0, value_at, first, n, acc);
  } else if (rows_padded == 8) {
    accumulate_rows<D, 8>(p, 0, value_at, first, n, acc);
  } else {
    for (int r0 = 0; r0 < rows_padded; r0 += 4) accumulate_rows<D, 4>(p, r0, value_at, first, n, acc);
  }
}

// v: the tile [n][D] of tokens first .. first + n.
template <int D>
void tile_accumulate(const float (*p)[kTokensPerBlock], int rows_padded, const float* v, int first, int n, float* acc) {
  accumulate_of<D>(p, rows_padded, TileAt<D>{v, first}, first, n, acc);
}

// e^x without libm (the libm call per logit cost as much as the products): Cephes'
// degree-6 polynomial after x = k·ln2 + r, |r| ≤ ln2/2, within 1.1 ulp of e^x over every
// float x in [−87, 0], with or without FMA contraction (checked exhaustively). x < −87
// (−∞ included) gives exactly 0, NaN gives NaN; the softmax only calls it with x ≤ 0.
// F is float, or a GNU vector of floats with Bits its uint32 twin: the same operations
// lane by lane (explicit vectors, since GCC's auto-vectorizer stops at 256 bits on
// targets that prefer them).
template <class F, class Bits>
KVQ_FORCE_INLINE F exp_approx(F x) {
  const F t = x * 1.44269504088896341f;
  const F shifted = t + 12582912.f;  // 1.5·2^23: round(t) lands in the low mantissa bits
  const F k = shifted - 12582912.f;
  const F r = (x - k * 0.693359375f) - k * -2.12194440e-4f;
  F p = F{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  Bits k_bits;
  std::memcpy(&k_bits, &shifted, sizeof k_bits);  // k as two's complement
  k_bits -= 0x4B400000u;
  const Bits scale_bits = (k_bits + 127u) << 23;
  F scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return x < -87.f ? F{} : p * scale;
}

// x[j] ← e^x[j] for j < n, a vector at a time.
KVQ_FORCE_INLINE void exp_block(float* x, int n) {
  int j = 0;
#if KVQ_GNU_HOST
  constexpr int W = kNativeFloatLanes;
  using Bits = typename GnuVec<std::uint32_t, W>::type;
  for (; j + W <= n; j += W) store_vec<W>(x + j, exp_approx<FloatVec<W>, Bits>(load_vec<W>(x + j)));
#endif
  for (; j < n; ++j) x[j] = exp_approx<float, std::uint32_t>(x[j]);
}

// True when every element of the n rows [n][D] is finite (x − x is 0 exactly for finite x).
// Four independent sums, so the adds do not wait on each other.
template <int D>
KVQ_FORCE_INLINE bool rows_are_finite(const float* rows, int n) {
  constexpr int W = lanes_for(D);
  FloatVec<W> z[4] = {zero_vec<W>(), zero_vec<W>(), zero_vec<W>(), zero_vec<W>()};
  int i = 0;
  for (; i + 4 * W <= n * D; i += 4 * W) {
    KVQ_UNROLL for (int u = 0; u < 4; ++u) {
      const FloatVec<W> x = load_vec<W>(rows + i + u * W);
      z[u] += x - x;
    }
  }
  for (; i < n * D; i += W) {
    const FloatVec<W> x = load_vec<W>(rows + i);
    z[0] += x - x;
  }
  return sum_lanes<W>((z[0] + z[1]) + (z[2] + z[3])) == 0.f;
}

// The cache level the decode's prefetches fill, as __builtin_prefetch's locality: 2
// (prefetcht1, into L2; the default), 3 (prefetcht0, into L1 too), 1 (prefetcht2), 0
// (prefetchnta). A prefetch into L1 holds one of the core's few L1 miss buffers until its
// line arrives from DRAM; one into L2 does not, and the demand loads then hit L2. On a
// Zen 4 core, cold 32K-token decodes (bench_cpu, 2026-12-05, alternating A/B runs):
// fp16 pages 5.5–5.6 → 3.2–3.5 ms, K4V2 fastest 1.26 → 0.94–0.97 ms with AVX-512;
// 6.5 → 4.2–4.9 and 2.9 → 1.6–1.8 ms with AVX2. On Zen 5 (2026-12-03, before the
// prefetches were spread over the block) L2 hints did not help; not measured there
// since. Engines may define it for their cores.
#ifndef KVQ_CPU_PREFETCH_LOCALITY
#define KVQ_CPU_PREFETCH_LOCALITY 2
#endif
static_assert(KVQ_CPU_PREFETCH_LOCALITY >= 0 && KVQ_CPU_PREFETCH_LOCALITY <= 3,
              "kvq: KVQ_CPU_PREFETCH_LOCALITY must be 0, 1, 2 or 3 (__builtin_prefetch's locality)");

// Asks for [p, p + bytes) to be brought into the cache ahead of use (a hint: nothing
// on targets without one).
//
// The empty volatile asm is load-bearing: GCC's IPA pure-const pass treats a function
// whose only statements are __builtin_prefetch as const and then deletes calls to it,
// so a prefetch inside a per-slot lambda (the decode sources' page walks) compiled to nothing
// (GCC 12, -O3: no prefetch instruction in the decode until this).
KVQ_FORCE_INLINE void prefetch_bytes(const void* p, std::size_t bytes) {
#if KVQ_GNU_HOST
  for (std::size_t offset = 0; offset < bytes; offset += 64)
    __builtin_prefetch(static_cast<const char*>(p) + offset, 0, KVQ_CPU_PREFETCH_LOCALITY);
  asm volatile("" : : "r"(p));
#else
  (void)p, (void)bytes;
#endif
}

// The cache lines of the next block, queued as runs when the block is known and asked
// for (prefetch_bytes) a few at a time between the steps of this block's work: pace(n)
// spreads what is queued over n shares of step() calls. Why not all at once: a software
// prefetch on an Intel core, into L2 as well, takes one of the core's L1 miss buffers
// until its line comes, so a burst of a block's lines (116 for K4V2 at d 128) stalls
// the core for several DRAM latencies while the compute waits behind it.
class PrefetchQueue {
 public:
  // Up to four runs per token: key codes, key metadata, value codes, value metadata of
  // pages of one slot (page size 1). A run past that is not asked for.
  static constexpr int kMaxRuns = 4 * kTokensPerBlock;

  PrefetchQueue() {}  // runs_ stays uninitialized (4 KB): only runs_[0, count_) are read
  void clear() { count_ = at_ = offset_ = left_ = per_share_ = 0; }
  // Queues the lines that hold [p, p + bytes).
  void push(const void* p, std::size_t bytes) {
    if (bytes == 0 || count_ == kMaxRuns) return;
    const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(p) / 64,
                         last = (reinterpret_cast<std::uintptr_t>(p) + bytes - 1) / 64;
    runs_[count_++] = {reinterpret_cast<const char*>(first * 64), int(last - first + 1)};
    left_ += int(last - first + 1);
  }
  // The lines still queued leave over the next `shares` shares of step() calls (each call
  // asks for the shares it is given; at least one line a share).
  void pace(int shares) { per_share_ = shares > 0 ? (left_ + shares - 1) / shares : left_; }
  KVQ_FORCE_INLINE void step(int shares = 1) {
    if (left_ > 0) issue(shares * per_share_);
  }
  void flush() {
    if (left_ > 0) issue(left_);
  }
  int lines_left() const { return left_; }

 private:
  KVQ_FORCE_INLINE void issue(int lines) {
    lines = std::min(lines, left_);
    left_ -= lines;
    while (lines > 0) {
      const Run& run = runs_[at_];
      const int now = std::min(lines, run.lines - offset_);
      prefetch_bytes(run.first + 64 * offset_, std::size_t(now) * 64);
      lines -= now, offset_ += now;
      if (offset_ == run.lines) ++at_, offset_ = 0;
    }
  }
  struct Run {
    const char* first;  // 64-byte aligned
    int lines;
  };
  Run runs_[kMaxRuns];
  int count_ = 0, at_ = 0, offset_ = 0;  // runs; the run and line asked for next
  int left_ = 0, per_share_ = 0;         // lines not asked for yet; lines a share asks for
};

// Pointers strided_rows writes per store: a native vector of them (8 with AVX-512, 4
// with AVX2, 2 with SSE2 / NEON). Eight per store without AVX-512 went through the stack
// (GCC 12 keeps a 512-bit GNU vector in memory on AVX2 and rebuilds it from xmm halves):
// 44% of attend_part's samples in the AVX2 K4V2 fastest decode (Zen 4, -march=haswell).
inline constexpr int kRowPointersPerStore = kNativeFloatLanes / 2;

// Pointer slots a block's rows need: kTokensPerBlock, rounded up for strided_rows' last
// store.
inline constexpr int kRowPointerSlots = kTokensPerBlock + kRowPointersPerStore;

// dst[u] = base + u·stride bytes for u < count, kRowPointersPerStore pointers per store:
// a page run's rows. The decodes fill one pointer per token and row kind; a scalar store,
// two adds and a compare each took 13% of attend_part's samples in the K2V2 fastest
// decode, whose 4K warm call went 97 → 91 µs with this (Zen 4). Up to
// kRowPointersPerStore − 1 slots past count are written too: dst needs count rounded up
// to a whole store, and a later run overwrites them.
template <class T>
KVQ_FORCE_INLINE void strided_rows(const T** dst, const T* base, std::size_t stride, int count) {
#if KVQ_GNU_HOST
  constexpr int L = kRowPointersPerStore;
  using Lanes = typename GnuVec<std::uintptr_t, L>::type;
  const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(base);
  Lanes row = [&]<std::size_t... I>(std::index_sequence<I...>) {
    return Lanes{(first + I * stride)...};
  }(std::make_index_sequence<L>{});
  const Lanes step = Lanes{} + L * stride;
  for (int u = 0; u < count; u += L, row += step) std::memcpy(dst + u, &row, sizeof row);
#else
  for (int u = 0; u < count; ++u) dst[u] = reinterpret_cast<const T*>(reinterpret_cast<const std::byte*>(base) + u * stride);
#endif
}

#if KVQ_CPU_AVX512
// Whether every run of kRun (4, 8 or 16) pointers in p[0 .. n) is strided_rows' output,
// p[kRun·i + t] == p[kRun·i] + t·stride bytes, n a multiple of kRun: a vector compare per
// 8 pointers (pointer by pointer, the checks were 6% of the K2V2 fastest decode at d 64,
// GQA 1, Zen 4).
template <int kRun, class T>
KVQ_FORCE_INLINE bool runs_are_strided(const T* const* p, int n, std::size_t stride) {
  static_assert(kRun == 4 || kRun == 8 || kRun == 16);
  const long long s = static_cast<long long>(stride);
  if constexpr (kRun == 4) {
    const __m512i offsets = _mm512_setr_epi64(0, s, 2 * s, 3 * s, 0, s, 2 * s, 3 * s);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m512i v = _mm512_loadu_si512(p + i);
      // Masked forms with an explicit source throughout (GCC 12 warns on the _undefined_ ones).
      const __m512i first = _mm512_maskz_permutexvar_epi64(0xFF, _mm512_setr_epi64(0, 0, 0, 0, 4, 4, 4, 4), v);
      if (_mm512_cmpneq_epu64_mask(v, _mm512_add_epi64(first, offsets)) != 0) return false;
    }
    if (i < n) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
      const __m256i first = _mm256_permute4x64_epi64(v, 0);
      return _mm256_cmpneq_epu64_mask(v, _mm256_add_epi64(first, _mm256_setr_epi64x(0, s, 2 * s, 3 * s))) == 0;
    }
    return true;
  } else {
    const __m512i offsets = _mm512_setr_epi64(0, s, 2 * s, 3 * s, 4 * s, 5 * s, 6 * s, 7 * s);
    for (int i = 0; i < n; i += kRun) {
      const __m512i first = _mm512_set1_epi64(static_cast<long long>(reinterpret_cast<std::uintptr_t>(p[i])));
      KVQ_UNROLL for (int c = 0; c < kRun; c += 8) {
        const __m512i expected = _mm512_add_epi64(first, _mm512_add_epi64(offsets, _mm512_set1_epi64(c * s)));
        if (_mm512_cmpneq_epu64_mask(_mm512_loadu_si512(p + i + c), expected) != 0) return false;
      }
    }
    return true;
  }
}
#endif

// The smallest OS page: the unit of address translation that touch_os_page warms.
inline constexpr std::uintptr_t kOsPageBytes = 4096;

// Asks for the line at p unless the previous call with the same `page` state (start it
// at 0) was already in p's 4 KB OS page. The prefetch's page walk then happens here: the
// decode sources touch the block after next, so the next block's prefetches find their
// translations cached (kvq/attention/dense.hpp, kvq/attention/decode.hpp).
KVQ_FORCE_INLINE void touch_os_page(const void* p, std::uintptr_t& page) {
  const std::uintptr_t here = reinterpret_cast<std::uintptr_t>(p) / kOsPageBytes + 1;  // never 0
  if (here == page) return;
  prefetch_bytes(p, 1);
  page = here;
}

// touch_os_page for every OS page of the bytes [first, last]: at first, then at each
// page start up to last.
KVQ_FORCE_INLINE void touch_os_span(const void* first, const void* last, std::uintptr_t& page) {
  touch_os_page(first, page);
  const std::uintptr_t end = reinterpret_cast<std::uintptr_t>(last);
  for (std::uintptr_t a = (reinterpret_cast<std::uintptr_t>(first) / kOsPageBytes + 1) * kOsPageBytes; a <= end;
       a += kOsPageBytes)
    touch_os_page(reinterpret_cast<const void*>(a), page);
}

// touch_os_page for each row of a run p, p + stride, …, p + (count − 1)·stride (bytes),
// stepping OS page by OS page where rows are closer than a page (every page the run
// crosses then holds a row; its first line, or the run's, stands for it). Row by row,
// the page arithmetic took ~3% of the fp16 pages' decode (Zen 4, 4K tokens from L3).
KVQ_FORCE_INLINE void touch_os_pages(const void* p, int count, std::size_t stride, std::uintptr_t& page) {
  const std::uintptr_t first = reinterpret_cast<std::uintptr_t>(p);
  if (stride >= kOsPageBytes) {
    for (int u = 0; u < count; ++u) touch_os_page(reinterpret_cast<const void*>(first + u * stride), page);
    return;
  }
  touch_os_span(p, reinterpret_cast<const void*>(first + std::uintptr_t(count - 1) * stride), page);
}

// Max of a block of kTokensPerBlock logits, NaN when any of them is NaN (std::max
// would drop it; a NaN logit must poison its row).
template <int W = kNativeFloatLanes>  // a template, so the folds of other widths are discarded
KVQ_FORCE_INLINE float block_max_of(const float* x) {
  static_assert(kTokensPerBlock % W == 0);
#if KVQ_GNU_HOST
  FloatVec<W> m = load_vec<W>(x);
  auto nan_lanes = m != m;
  for (int j = W; j < kTokensPerBlock; j += W) {
    const FloatVec<W> v = load_vec<W>(x + j);
    m = v > m ? v : m;
    nan_lanes |= v != v;
  }
  // A NaN lane may win the max, but then the result is NaN anyway.
  const float best = max_lanes<W>(m);
  bool nan = false;
  if constexpr (W == 16) {
    const auto a = __builtin_shufflevector(nan_lanes, nan_lanes, 0, 1, 2, 3, 4, 5, 6, 7) |
                   __builtin_shufflevector(nan_lanes, nan_lanes, 8, 9, 10, 11, 12, 13, 14, 15);
    const auto b = __builtin_shufflevector(a, a, 0, 1, 2, 3) | __builtin_shufflevector(a, a, 4, 5, 6, 7);
    nan = (b[0] | b[1] | b[2] | b[3]) != 0;
  } else {
    for (int i = 0; i < W; ++i) nan = nan || nan_lanes[i] != 0;
  }
  return nan ? __builtin_nanf("") : best;
#else
  float best = x[0];
  bool nan = false;
  for (int j = 0; j < kTokensPerBlock; ++j) {
    best = x[j] > best ? x[j] : best;
    nan = nan || x[j] != x[j];
  }
  return nan ? __builtin_nanf("") : best;
#endif
}

// x[j] ← e^(x[j] − shift) over a block of kTokensPerBlock; returns their sum (in a fixed
// order). −∞ entries become 0.
KVQ_FORCE_INLINE float exp_shifted_block(float* x, float shift) {
#if KVQ_GNU_HOST
  constexpr int W = kNativeFloatLanes;
  FloatVec<W> partial = zero_vec<W>();
  for (int j = 0; j < kTokensPerBlock; j += W) {
    const FloatVec<W> e = exp_approx<FloatVec<W>, typename GnuVec<std::uint32_t, W>::type>(load_vec<W>(x + j) - shift);
    store_vec<W>(x + j, e);
    partial += e;
  }
  return sum_lanes<W>(partial);
#else
  for (int j = 0; j < kTokensPerBlock; ++j) x[j] -= shift;
  exp_block(x, kTokensPerBlock);
  constexpr int W = kNativeFloatLanes;
  FloatVec<W> partial = zero_vec<W>();
  for (int j = 0; j < kTokensPerBlock; j += W) partial += load_vec<W>(x + j);
  return sum_lanes<W>(partial);
#endif
}

// dst[i] = src[i] as fp32, i < D.
template <int D, ActivationType T>
KVQ_FORCE_INLINE void convert_row(const T* KVQ_RESTRICT src, float* KVQ_RESTRICT dst) {
  constexpr int W = lanes_for(D);
  if constexpr (D % W == 0) {
    for (int i = 0; i < D; i += W) store_vec<W>(dst + i, load_as_float<W>(src + i));
  } else {
    for (int i = 0; i < D; ++i) dst[i] = to_float(src[i]);
  }
}

}  // namespace kvq::detail
