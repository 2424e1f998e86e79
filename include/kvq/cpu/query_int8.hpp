// kvq/cpu/query_int8.hpp — key scoring with integer dot products on the codes
// for the CPU decode (DESIGN §9, KeyScoring::int8_query).
//
// The rotated query q' (already × τ) is quantized per key group g to int8, as llama.cpp's
// q8 × q4 does: σ_g = max_{i∈g}|q'_i| / 127, q8_i = round(q'_i / σ_g). With the
// rounding residuals ρ_i = q'_i − σ_g·q8_i, whose group sums R_g = Σq'_i − σ_g·Σq8_i
// are known per query, and μ = (2^b − 1)/2 the middle code:
//   logit = Σ_g [ s_g·(σ_g·Σ_{i∈g} q8_i·c_i + μ·R_g) + lo_g·Σ_{i∈g} q'_i ]
// which drops only Σ_g s_g·Σ_{i∈g} ρ_i·(c_i − μ): the μ·R_g term keeps the residuals'
// share of the mean code exactly, for the price of an FMA in place of a multiply.
// The code products are summed exactly in int32, four bytes per lane: vpdpbusd with
// AVX-512 VNNI, vpmaddubsw + vpmaddwd with AVX2 (codes ≤ 4 bits, so no int16
// saturation), plain loops otherwise — the same integers on every target. The lo term
// uses the exact fp32 sums. |ρ_i| ≤ σ_g/2, so the logit moves by at most
// Σ_g s_g·σ_g/2·Σ_{i∈g} |c_i − μ|. Its worst case (every code 0 or 2μ) is half that of
// the uncorrected Σ_g s_g·σ_g/2·Σ c_i; codes cluster near the middle, where it is far
// smaller (codes near 0 are the one case the uncorrected form bounds better).
// Meant for 2- and 4-bit keys: there the attention error it adds is a few percent of the
// cache's own (tests/cpu/test_query_int8.cpp); 8-bit keys are as fine as the int8
// query, which then doubles their error.
//
// Codes are unpacked to one byte each in slab order (slab_position), so each 4-byte
// lane belongs to one group (group·bits/8 ≥ 4 bytes).
// Needs head_dim a multiple of 64 (every kvq preset).
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvq/core/config.hpp"
#include "kvq/core/quantizer.hpp"
#include "kvq/cpu/code_fields.hpp"
#include "kvq/cpu/isa.hpp"
#include "kvq/cpu/tile.hpp"

namespace kvq::detail {

// Slab order, the element order of the CPU decode: slab k holds bit field k of every
// packed byte, so unpacking is one contiguous pass per slab and vectorizes. Element i
// sits at slab_position(i); queries (keys) and accumulators (values) follow it.
template <int Bits, int D>
constexpr int slab_position(int i) {
  constexpr int per_byte = 8 / Bits;
  return (i % per_byte) * (D / per_byte) + i / per_byte;
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
//
// Lanes fold: lane L of the slab-ordered row and lane L + kAccLanes belong to the same
// group, so the integer sums of all D/4 lanes are accumulated into kAccLanes lanes
// (16, or one 64-byte chunk per distinct group pattern when a slab is longer) and only
// those are scaled:
//   logit = Σ_{L<kAccLanes} (isum_L·σ_L + μR_L)·s_L + lo_L·Σq'_L
// where σ_L, s_L, lo_L are those of lane L's group, and Σq'_L and μR_L are the group's
// Σq' and μ·R divided by the number of accumulator lanes of that group.
template <int Bits, int G, int D>
struct Int8Query {
  static constexpr int kGroups = D / G;
  static constexpr int kSlabBytes = D * Bits / 8, kGroupBytes = G * Bits / 8;
  static constexpr int kAccLanes = 16 * (kSlabBytes > 64 ? kSlabBytes / 64 : 1);
  static_assert(kGroupBytes >= 4, "kvq: an int8 lane must not straddle two key groups");
  static_assert(D % 64 == 0 && kGroups <= 16, "kvq: int8 key scoring needs head_dim a multiple of 64");

  alignas(64) std::int8_t q8[kMaxRowsPerPass][D];          // slab order
  alignas(64) float sigma[kMaxRowsPerPass][kAccLanes];     // σ of each lane's group
  alignas(64) float group_sum[kMaxRowsPerPass][kAccLanes]; // Σq' of the group / its lane count
  alignas(64) float residual[kMaxRowsPerPass][kAccLanes];  // μ·R of the group / its lane count
  static constexpr float kMidCode = float((1 << Bits) - 1) / 2.f;  // μ

  // Group of each accumulator lane (lane L covers slab-order bytes 4L..4L+3 mod the
  // slab), and how many lanes each group has.
  static constexpr std::array<int, kAccLanes> kLaneGroup = [] {
    std::array<int, kAccLanes> g{};
    for (int lane = 0; lane < kAccLanes; ++lane) g[lane] = ((4 * lane) % kSlabBytes) / kGroupBytes;
    return g;
  }();
  static constexpr std::array<int, kGroups> kGroupLanes = [] {
    std::array<int, kGroups> n{};
    for (int lane = 0; lane < kAccLanes; ++lane) ++n[kLaneGroup[lane]];
    return n;
  }();
  // The metadata index of each lane's scale (its lo is at +1), for the SIMD block paths'
  // permutes.
  alignas(64) static constexpr std::array<std::int32_t, kAccLanes> kScaleIndex = [] {
    std::array<std::int32_t, kAccLanes> idx{};
    for (int lane = 0; lane < kAccLanes; ++lane) idx[lane] = 2 * kLaneGroup[lane];
    return idx;
  }();

  // The transposed block layout (score_block on AVX-512 VNNI, kTransposed). A token's
  // slab-ordered row is read in parts of up to 64 bytes (kParts: two for 128-byte rows,
  // four for 256-byte ones). Four 64-byte registers of one part (a "quad": four tokens
  // with 64-byte parts, eight with 32-byte rows, two per register, sixteen with 16-byte
  // rows, four per register) go through two unpack stages of a 4×4 dword transpose, so
  // lane (c, t) (128-bit lane c, dword t) of u_m holds dword 4·(c mod kRowLanes) + m of
  // the part of the quad's token 4·⌊c / kRowLanes⌋ + t. vpdpbusd then sums codes × query
  // dwords per (token, group) in each lane; one convert and three FMAs per vector scale
  // 16 such lanes, and up to two shuffle levels add each token's groups.
  static constexpr int kSlabs = 8 / Bits;
  static constexpr int kPartBytes = kSlabBytes < 64 ? kSlabBytes : 64;
  static constexpr int kParts = kSlabBytes / kPartBytes;
  static constexpr int kRowLanes = kPartBytes / 16;        // 128-bit lanes per token part
  static constexpr int kTokensPerRow = 64 / kPartBytes;    // tokens per 64-byte register
  static constexpr int kClasses = kGroupBytes >= 16 ? 1 : 16 / kGroupBytes;  // accumulators per part
  static constexpr int kAccClasses = kParts * kClasses;    // (part, class) accumulators per quad
  static constexpr bool kTransposed = kSlabBytes >= 16 && kGroupBytes % 8 == 0 && kParts * kSlabs <= 4 &&
                                      4 * kTokensPerRow * 2 * kGroups <= 64;
  static constexpr int kTRows = kTransposed ? kMaxRowsPerPass : 1;
  // Vector registers score_block_transposed needs to keep rows in registers: a
  // quad's transposed codes (kParts·4), its metadata, each row's accumulators and pending
  // lane sums, one slab. Of the 32, 2 rows fit for keys of up to 128 bytes a row, 4 for
  // 2- and 4-bit keys at d 64 and 128.
  static constexpr int kRegistersBesideRows = kParts * 4 + 2 * kAccClasses + 1;
  static constexpr int kRegistersPerRow = 2 * kAccClasses + (kTokensPerRow == 1 ? 2 : 1);
  static constexpr bool kTwoRowsInRegisters = kRegistersBesideRows + 2 * kRegistersPerRow <= 30;
  static constexpr bool kFourRowsInRegisters = kRegistersBesideRows + 4 * kRegistersPerRow <= 30;
  // Group of lane c in part p and accumulator class a: dword m of a part holds bytes
  // 64·p + 16·(c mod kRowLanes) + 4m .. + 3, and with groups under 16 bytes class a
  // gathers the dwords m of group offset a.
  static constexpr int transposed_group(int p, int c, int a) {
    return (64 * p + 16 * (c % kRowLanes)) / kGroupBytes + (kClasses > 1 ? a : 0);
  }
  // Class of dword m: dwords of one class share each lane's group.
  static constexpr int transposed_class(int m) { return kClasses == 1 ? 0 : m / (kGroupBytes / 4); }
  // Lanes (p, c, a) of one token carrying group g.
  static constexpr std::array<int, kGroups> kTransposedLanes = [] {
    std::array<int, kGroups> count{};
    for (int p = 0; p < kParts; ++p)
      for (int c = 0; c < kRowLanes; ++c)
        for (int a = 0; a < kClasses; ++a) ++count[transposed_group(p, c, a)];
    return count;
  }();
  // Query dword of lane (c, t) for part p, slab k, dword m.
  alignas(64) std::int32_t q_lanes[kTRows][kTransposed ? kParts : 1][kTransposed ? kSlabs : 1][4][16];
  alignas(64) float sigma_lanes[kTRows][kAccClasses][16];     // σ of the lane's group
  alignas(64) float residual_lanes[kTRows][kAccClasses][16];  // μ·R of the group / its lanes per token
  alignas(64) float sum_lanes_t[kTRows][kAccClasses][16];     // Σq' of the group / its lanes per token

  // Σ x_i over a group [G] as eight partial sums (i mod 8) added pairwise: a fixed order
  // that does not wait on one addition chain (the sequential sums took half of set_row).
  template <class T>
  static KVQ_FORCE_INLINE T sum_strided(const T* x) {
    static_assert(G % 8 == 0);
    T part[8] = {};
    for (int i = 0; i < G; i += 8)
      for (int u = 0; u < 8; ++u) part[u] += x[i + u];
    return ((part[0] + part[4]) + (part[2] + part[6])) + ((part[1] + part[5]) + (part[3] + part[7]));
  }

  // Quantizes row r from q' [D] (natural order, already × τ). A non-finite group makes
  // its lanes' factor NaN, so every logit of the row is NaN, as in the fp32 path.
  void set_row(int r, const float* q) {
    float sig[kGroups], sum[kGroups], res[kGroups];
    alignas(64) std::int8_t codes[D];  // natural order
    // Each step in its own loop, so that they vectorize; the sums run in eight
    // independent chains (sum_strided), the same order on every target.
    for (int g = 0; g < kGroups; ++g) {
      const float* x = q + g * G;
      // max |x| on the IEEE bits of |x|, which order as the values do (Inf and NaN above
      // every finite one): one integer reduction that vectorizes gives both the maximum
      // and whether the group is finite (a float max with a finite test per element ran
      // element by element: a third of set_row).
      std::uint32_t top = 0;
      for (int i = 0; i < G; ++i) top = std::max(top, std::bit_cast<std::uint32_t>(x[i]) & 0x7fffffffu);
      const bool finite = top < 0x7f800000u;
      const float amax = std::bit_cast<float>(top);
      const float total = sum_strided<float>(x);
      sig[g] = !finite ? __builtin_nanf("") : amax / 127.f;
      sum[g] = total;
      const float inv = amax > 0.f && finite ? 127.f / amax : 0.f;
      // |x·inv| ≤ 127 for finite groups; a non-finite group's codes are 0.
      for (int i = 0; i < G; ++i) codes[g * G + i] = std::int8_t(finite ? std::nearbyint(x[i] * inv) : 0.f);
      double terms[G];  // q'_i − σ·q8_i, each exact in fp64
      for (int i = 0; i < G; ++i) terms[i] = double(x[i]) - double(sig[g]) * codes[g * G + i];
      const double rounding = sum_strided<double>(terms);  // R_g
      res[g] = finite ? kMidCode * float(rounding) : sig[g];  // NaN for a non-finite group
    }
    // Slab order (slab_position): slab k takes every (8/Bits)-th code from k, a strided
    // copy (a scatter through a position table was a fifth of set_row).
    constexpr int kPerByte = 8 / Bits;
    for (int k = 0; k < kPerByte; ++k)
      for (int j = 0; j < kSlabBytes; ++j) q8[r][k * kSlabBytes + j] = codes[kPerByte * j + k];
    // Each group's shares once, not once per lane (the same quotients).
    float sum_share[kGroups], res_share[kGroups];
    for (int g = 0; g < kGroups; ++g) {
      sum_share[g] = sum[g] / float(kGroupLanes[g]);
      res_share[g] = res[g] / float(kGroupLanes[g]);
    }
    for (int lane = 0; lane < kAccLanes; ++lane) {
      const int g = kLaneGroup[lane];
      sigma[r][lane] = sig[g];
      group_sum[r][lane] = sum_share[g];
      residual[r][lane] = res_share[g];
    }
    set_epilogue_factors(r);
    if constexpr (kTransposed) {
      for (int g = 0; g < kGroups; ++g) {
        sum_share[g] = sum[g] / float(kTransposedLanes[g]);
        res_share[g] = res[g] / float(kTransposedLanes[g]);
      }
      for (int lane = 0; lane < 16; ++lane) {
        const int c = lane / 4;
        for (int p = 0; p < kParts; ++p) {
          for (int k = 0; k < kSlabs; ++k)
            for (int m = 0; m < 4; ++m)
              std::memcpy(&q_lanes[r][p][k][m][lane], &q8[r][k * kSlabBytes + 64 * p + 4 * (4 * (c % kRowLanes) + m)], 4);
          for (int a = 0; a < kClasses; ++a) {
            const int g = transposed_group(p, c, a), A = p * kClasses + a;
            sigma_lanes[r][A][lane] = sig[g];
            residual_lanes[r][A][lane] = res_share[g];
            sum_lanes_t[r][A][lane] = sum_share[g];
          }
        }
      }
    }
  }

  // logits[r·stride] for r < rows of one token. codes: the packed row [D·Bits/8];
  // meta: its decoded {scale, lo} pairs [2·kGroups].
  void score(const std::uint8_t* KVQ_RESTRICT codes, const float* meta, int rows, float* KVQ_RESTRICT logits,
             int stride) const {
#if KVQ_CPU_AVX512_VNNI
    alignas(64) float s_lane[kAccLanes], lo_lane[kAccLanes];
    spread_meta(meta, s_lane, lo_lane);
    score_vnni(codes, s_lane, lo_lane, rows, logits, stride);
#else
    alignas(64) float s_lane[kAccLanes], lo_lane[kAccLanes];
    spread_meta(meta, s_lane, lo_lane);
    alignas(64) std::uint8_t unpacked[D];
    unpack_codes_slabs<Bits, D>(codes, unpacked);
    for (int r = 0; r < rows; ++r) logits[r * stride] = score_row<true>(unpacked, r, s_lane, lo_lane);
#endif
  }

  // The portable path, always compiled: what every SIMD path must reproduce (the integer
  // sums exactly, the fp32 factors up to summation order).
  void score_generic(const std::uint8_t* KVQ_RESTRICT codes, const float* meta, int rows, float* KVQ_RESTRICT logits,
                     int stride) const {
    alignas(64) float s_lane[kAccLanes], lo_lane[kAccLanes];
    spread_meta(meta, s_lane, lo_lane);
    alignas(64) std::uint8_t unpacked[D];
    unpack_codes_slabs<Bits, D>(codes, unpacked);
    for (int r = 0; r < rows; ++r) logits[r * stride] = score_row<false>(unpacked, r, s_lane, lo_lane);
  }

  // s[r][first + j] for r < rows, j < n ≤ kTokensPerBlock − first: a block of tokens
  // whose packed rows and stored metadata (2·kGroups values of M) are codes[j] and
  // meta[j]. With AVX-512 VNNI the metadata is widened in registers and the lane sums
  // of 16 tokens are reduced together: in the transposed layout by folding each token's
  // lanes (score_block_transposed), else by one transpose (reduce_16x16) instead of 16
  // horizontal sums; AVX2 does the same 8 tokens at a time where kAvx2Block holds.
  template <MetaType M>
  void score_block(int n, const std::uint8_t* const* codes, const meta_storage_t<M>* const* meta, int rows,
                   float (*s)[kTokensPerBlock], int first = 0) const {
#if KVQ_CPU_AVX512_VNNI
    if constexpr (kTransposed && M != MetaType::fp32) {
      score_block_transposed<M>(n, codes, meta, rows, s, first);
    } else {
      score_block_vnni<M>(n, codes, meta, rows, s, first);
    }
#else
#if KVQ_CPU_AVX2 && KVQ_CPU_F16C
    if constexpr (kAvx2Block) {
      score_block_avx2<M>(n, codes, meta, rows, s, first);
      return;
    }
#endif
    float decoded[2 * kGroups];
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < 2 * kGroups; ++i) decoded[i] = MetaTraits<M>::decode(meta[j][i]);
      score(codes[j], decoded, rows, &s[0][first + j], kTokensPerBlock);
    }
#endif
  }

 private:
  static void spread_meta(const float* meta, float* s_lane, float* lo_lane) {
    for (int lane = 0; lane < kAccLanes; ++lane) {
      s_lane[lane] = meta[2 * kLaneGroup[lane]];
      lo_lane[lane] = meta[2 * kLaneGroup[lane] + 1];
    }
  }

  // The AVX2 block path's shapes (score_block_avx2), and its per-row constants: plain C++,
  // so that the layout is the same in every build.
  static constexpr int kAcc8 = kAccLanes / 8;  // 8-lane accumulators of the block path
  // When lanes L and L + 8 carry the same group (32-byte or 16-byte slabs: 2-bit keys at
  // d ≤ 128, 4-bit at d 64), all chunks go into one int16 sum and the fp32 factors are
  // applied to 8 lanes instead of 16 (a summation order only); where those 8 lanes hold
  // one group per half or per lane pair, the epilogues below apply them per group.
  static constexpr bool kFold8 = [] {  // (no early return: nvcc warns of unreachable loops)
    bool same = kAccLanes == 16;
    for (int lane = 0; same && lane < 8; ++lane) same = kLaneGroup[lane] == kLaneGroup[lane + 8];
    return same;
  }();
  // Otherwise, where each 128-bit half of the accumulators is one group (groups of ≥ 16
  // bytes: 4-bit keys at d 128 and 256), the four lanes of a half are added in int32
  // first, over 8 tokens at once (two vphaddd levels), so that the fp32 factors take one
  // lane per (token, group): 2·kAcc8 vectors per row and 8 tokens instead of kAcc8 per
  // row and token.
  // Folded (kFold8) sums take this path too where each half of their 8 lanes is one group
  // (4-bit keys at d 64).
  static constexpr int kHalfVectors = kFold8 ? 1 : kAcc8;  // int32 sum vectors per token and row
  static constexpr bool kHalfGroups = [] {
    for (int lane = 0; lane < 8 * kHalfVectors; ++lane)
      if (kLaneGroup[lane] != kLaneGroup[lane / 4 * 4]) return false;
    return true;
  }();
  // Folded sums whose lane pairs (2p, 2p + 1) carry one group each (8-byte groups: 2-bit
  // keys at d 64 and 128): one vphaddd of two tokens' sums leaves one (token, pair) per
  // lane, and the fp32 factors take 4 vectors per row and 8 tokens instead of 8.
  static constexpr bool kPairGroups = [] {
    bool pairs = kFold8 && !kHalfGroups && 2 * kGroups <= 8;
    for (int lane = 0; pairs && lane < 8; ++lane) pairs = kLaneGroup[lane] == kLaneGroup[lane / 2 * 2];
    return pairs;
  }();
  // Per row, the factors of the half-group and pair-group epilogues, derived from sigma,
  // residual and group_sum by set_row (the same sums; computed in each score_block call
  // they were 10% of the AVX2 d-256 K4V2 decode, whose blocks are scored in 4 calls).
  static constexpr int kHalves = kHalfGroups ? 2 * kHalfVectors : 1, kPairLanes = kPairGroups ? 8 : 1;
  float half_sigma[kMaxRowsPerPass][kHalves], half_residual[kMaxRowsPerPass][kHalves],
      half_sum[kMaxRowsPerPass][kHalves];
  alignas(32) float pair_sigma[kMaxRowsPerPass][kPairLanes], pair_residual[kMaxRowsPerPass][kPairLanes],
      pair_sum[kMaxRowsPerPass][kPairLanes];
  void set_epilogue_factors(int r) {
    if constexpr (kHalfGroups) {
      // Half h (lanes 4h .. 4h+3: chunks z ≡ h / 2 (mod kHalfVectors), 128-bit half h % 2)
      // carries group kLaneGroup[4h]; its σ is the group's, its μR and Σq' the sums of
      // its four lanes' (folded: of its eight, lanes 4h + i and 4h + 8 + i).
      auto four = [](const float* x) { return (x[0] + x[1]) + (x[2] + x[3]); };
      for (int h = 0; h < kHalves; ++h) {
        half_sigma[r][h] = sigma[r][4 * h];
        half_residual[r][h] = four(residual[r] + 4 * h);
        half_sum[r][h] = four(group_sum[r] + 4 * h);
        if constexpr (kFold8) {
          half_residual[r][h] += four(residual[r] + 4 * h + 8);
          half_sum[r][h] += four(group_sum[r] + 4 * h + 8);
        }
      }
    }
    if constexpr (kPairGroups) {
      // Lane k of the pair epilogue carries pair p = 2·(k / 4) + k % 2: σ of the pair's
      // group, μR and Σq' of its two lanes and their folded partners (lanes + 8).
      for (int k = 0; k < 8; ++k) {
        const int p = 2 * (k / 4) + k % 2;
        pair_sigma[r][k] = sigma[r][2 * p];
        pair_residual[r][k] = (residual[r][2 * p] + residual[r][2 * p + 1]) + (residual[r][2 * p + 8] + residual[r][2 * p + 9]);
        pair_sum[r][k] = (group_sum[r][2 * p] + group_sum[r][2 * p + 1]) + (group_sum[r][2 * p + 8] + group_sum[r][2 * p + 9]);
      }
    }
  }

#if KVQ_CPU_AVX2 && KVQ_CPU_F16C
  // The AVX2 block path: codes ≤ 4 bits (vpmaddubsw's int16 pairs cannot overflow),
  // 16 or 32 accumulator lanes, and at most 16 metadata values per token (vpermps spread
  // them over the lanes), so every int8-scored preset shape at d 64–256. Other shapes
  // take score() token by token.
  static constexpr bool kAvx2Block = Bits <= 4 && (kAccLanes == 16 || kAccLanes == 32) && 2 * kGroups <= 16;

  // Chunk z (32 bytes) of the slab-ordered codes, unpacked in registers.
  static KVQ_FORCE_INLINE __m256i code_chunk_avx2(const std::uint8_t* codes, int z) {
    const __m256i mask = _mm256_set1_epi8(char((1u << Bits) - 1u));
    if constexpr (kSlabBytes >= 32) {
      const int k = 32 * z / kSlabBytes, j0 = 32 * z % kSlabBytes;
      return _mm256_and_si256(_mm256_srli_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + j0)),
                                                int(k * Bits)), mask);
    } else {  // 16-byte slabs: two per chunk
      static_assert(kSlabBytes == 16);
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
      return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(x, int((2 * z + 1) * Bits)), _mm_srli_epi16(x, int(2 * z * Bits))),
                              mask);
    }
  }

  // The token's metadata values 8·part .. of its 2·kGroups (2, 4, 8 or 16) as fp32 lanes;
  // lanes past them are 0. Loads of exactly their bytes, never past the token. (Through
  // a zeroed 8-value buffer, a load wider than the copy into it stalled on store
  // forwarding: K4V2 at d 64, -march=haswell on a Zen 4, took longer than fp16 pages.)
  template <MetaType M>
  static KVQ_FORCE_INLINE __m256 load_meta_avx2(const meta_storage_t<M>* meta, int part = 0) {
    constexpr int kCount = 2 * kGroups < 8 ? 2 * kGroups : 8;
    static_assert(kCount == 2 || kCount == 4 || kCount == 8);
    meta += 8 * part;
    if constexpr (M == MetaType::fp32) {
      if constexpr (kCount == 8) return _mm256_loadu_ps(meta);
      const __m128 x = kCount == 4 ? _mm_loadu_ps(meta)
                                   : _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta)));
      return _mm256_insertf128_ps(_mm256_setzero_ps(), x, 0);
    } else {
      __m128i bits;
      if constexpr (kCount == 8) bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta));
      else if constexpr (kCount == 4) bits = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta));
      else bits = _mm_cvtsi32_si128(static_cast<int>(load_u32(meta)));
      if constexpr (M == MetaType::fp16) return _mm256_cvtph_ps(bits);
      else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));  // bf16
    }
  }
  static KVQ_FORCE_INLINE std::uint32_t load_u32(const void* p) {
    std::uint32_t x;
    std::memcpy(&x, p, sizeof x);
    return x;
  }

  static KVQ_FORCE_INLINE __m256 fmadd_avx2(__m256 a, __m256 b, __m256 c) {
#if KVQ_CPU_FMA
    return _mm256_fmadd_ps(a, b, c);
#else
    return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
  }

  // score_block on AVX2: per token the codes are unpacked once, each row's lane sums
  // come from vpmaddubsw, added in int16 across the chunks that share lanes (|pair| ≤
  // 2·127·(2^b − 1), so up to four chunks cannot overflow) before one vpmaddwd, and the
  // 8-lane factors of 8 tokens are reduced together by one transpose (sum_lanes_8x8);
  // kFold8, kHalfGroups and kPairGroups (above) choose its epilogue.

  // dst[0 .. m) = lanes 0 .. m of v (m ≤ 8), stored from the register: a store of v to a
  // buffer and an m-float copy out of it stalled on store forwarding, its 8-byte loads
  // waiting on the 32-byte store (16% of the AVX2 d-64 K4V2 decode's samples, Zen 4).
  static KVQ_FORCE_INLINE void store_logits_avx2(float* dst, __m256 v, int m) {
    if (m == 8) {
      _mm256_storeu_ps(dst, v);
    } else {
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      _mm256_maskstore_ps(dst, live, v);
    }
  }
  // Row r's int32 lane sums over one token's unpacked chunks c[D / 32] that share 8-lane
  // vector a of V (chunks z ≡ a mod V): vpmaddubsw pairs added in int16 (the bound in
  // score_block_avx2), then one vpmaddwd.
  template <int V>
  KVQ_FORCE_INLINE __m256i lane_sums_avx2(const __m256i* c, int r, int a) const {
    auto products = [&](int z) {
      return _mm256_maddubs_epi16(c[z], _mm256_load_si256(reinterpret_cast<const __m256i*>(q8[r] + 32 * z)));
    };
    __m256i pairs = products(a);
    KVQ_UNROLL for (int z = a + V; z < D / 32; z += V) pairs = _mm256_add_epi16(pairs, products(z));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
  }
  template <MetaType M>
  KVQ_FORCE_INLINE void score_block_avx2(int n, const std::uint8_t* const* codes, const meta_storage_t<M>* const* meta,
                                         int rows, float (*s)[kTokensPerBlock], int first) const {
    constexpr int kChunks = D / 32, kPairMax = 2 * 127 * ((1 << Bits) - 1);
    static_assert((kFold8 ? kChunks : kChunks / kAcc8) * kPairMax <= 32767, "kvq: int16 pre-sums would overflow");
    constexpr bool kTwoHalves = 2 * kGroups > 8;  // metadata values 8 .. 15 in a second vector
    if constexpr (kHalfGroups) {
      // Half h (lanes 4h .. 4h+3) carries group kLaneGroup[4h], with factors half_*[r][h].
      constexpr int kVecs = kHalfVectors;
      alignas(32) __m256i sums[kMaxRowsPerPass][8][kVecs];  // [row][token of the 8][sum vector]
      for (int j0 = 0; j0 < n; j0 += 8) {
        const int m = n - j0 < 8 ? n - j0 : 8;
        __m256 meta8[kTwoHalves ? 2 : 1][8];  // token j's metadata values 8·part .., zero past the block
        for (int j = 0; j < 8; ++j) {
          if (j >= m) {
            for (auto& part : meta8) part[j] = _mm256_setzero_ps();
            for (int r = 0; r < rows; ++r)
              for (int a = 0; a < kVecs; ++a) sums[r][j][a] = _mm256_setzero_si256();
            continue;
          }
          __m256i c[kChunks];
          KVQ_UNROLL for (int z = 0; z < kChunks; ++z) c[z] = code_chunk_avx2(codes[j0 + j], z);
          KVQ_UNROLL for (int part = 0; part < (kTwoHalves ? 2 : 1); ++part) meta8[part][j] = load_meta_avx2<M>(meta[j0 + j], part);
          for (int r = 0; r < rows; ++r)
            KVQ_UNROLL for (int a = 0; a < kVecs; ++a) sums[r][j][a] = lane_sums_avx2<kVecs>(c, r, a);
        }
        // by_value[v] lane t = metadata value v of token t (8×8 transposes).
        __m256 by_value[kTwoHalves ? 16 : 8];
        KVQ_UNROLL for (int part = 0; part < (kTwoHalves ? 2 : 1); ++part) {
          __m256 t[8], u[8];
          KVQ_UNROLL for (int i = 0; i < 4; ++i) {
            t[2 * i] = _mm256_unpacklo_ps(meta8[part][2 * i], meta8[part][2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_ps(meta8[part][2 * i], meta8[part][2 * i + 1]);
          }
          KVQ_UNROLL for (int i = 0; i < 2; ++i)
            KVQ_UNROLL for (int k = 0; k < 2; ++k) {
              u[4 * i + 2 * k] = _mm256_shuffle_ps(t[4 * i + k], t[4 * i + 2 + k], _MM_SHUFFLE(1, 0, 1, 0));
              u[4 * i + 2 * k + 1] = _mm256_shuffle_ps(t[4 * i + k], t[4 * i + 2 + k], _MM_SHUFFLE(3, 2, 3, 2));
            }
          // u[4i + v] holds value v (low halves) and v + 4 (high halves) of tokens 4i .. 4i+3.
          KVQ_UNROLL for (int v = 0; v < 4; ++v) {
            by_value[8 * part + v] = _mm256_permute2f128_ps(u[v], u[4 + v], 0x20);
            by_value[8 * part + v + 4] = _mm256_permute2f128_ps(u[v], u[4 + v], 0x31);
          }
        }
        for (int r = 0; r < rows; ++r) {
          // halves[h] lane t = token t's int32 sum of half h.
          __m256i halves[kHalves];
          KVQ_UNROLL for (int a = 0; a < kVecs; ++a) {
            const __m256i p01 = _mm256_hadd_epi32(sums[r][0][a], sums[r][1][a]), p23 = _mm256_hadd_epi32(sums[r][2][a], sums[r][3][a]);
            const __m256i p45 = _mm256_hadd_epi32(sums[r][4][a], sums[r][5][a]), p67 = _mm256_hadd_epi32(sums[r][6][a], sums[r][7][a]);
            const __m256i q03 = _mm256_hadd_epi32(p01, p23), q47 = _mm256_hadd_epi32(p45, p67);
            halves[2 * a] = _mm256_permute2x128_si256(q03, q47, 0x20);
            halves[2 * a + 1] = _mm256_permute2x128_si256(q03, q47, 0x31);
          }
          __m256 f[kHalves];
          KVQ_UNROLL for (int h = 0; h < kHalves; ++h) {
            const int g = kLaneGroup[4 * h];
            const __m256 code_term = fmadd_avx2(_mm256_cvtepi32_ps(halves[h]), _mm256_set1_ps(half_sigma[r][h]),
                                                _mm256_set1_ps(half_residual[r][h]));
            f[h] = fmadd_avx2(code_term, by_value[2 * g], _mm256_mul_ps(by_value[2 * g + 1], _mm256_set1_ps(half_sum[r][h])));
          }
          // Neighbours first: ((f0 + f1) + (f2 + f3)) + ….
          KVQ_UNROLL for (int w = kHalves; w > 1; w /= 2)
            KVQ_UNROLL for (int h = 0; h < w / 2; ++h) f[h] = _mm256_add_ps(f[2 * h], f[2 * h + 1]);
          store_logits_avx2(&s[r][first + j0], f[0], m);
        }
      }
      return;
    }
    if constexpr (kPairGroups) {
      // vphaddd(sums of tokens a, b) holds in 128-bit half h the lane pairs 2h, 2h + 1 of
      // a, then of b: lane k carries pair p = 2·(k / 4) + k % 2 of token a + (k % 4) / 2,
      // with factors pair_*[r][k].
      static_assert([] {  // pair p's group is the one whose {scale, lo} the shuffles below pick
        for (int p = 0; p < 4; ++p)
          if (kLaneGroup[2 * p] != (2 * kGroups == 8 ? p : p % 2)) return false;
        return true;
      }());
      alignas(32) __m256i sums[kMaxRowsPerPass][8];  // [row][token of the 8]
      for (int j0 = 0; j0 < n; j0 += 8) {
        const int m = n - j0 < 8 ? n - j0 : 8;
        __m256 meta8[8];  // token j's {scale, lo} pairs, groups 0, 1 | 2, 3 (4 values: twice)
        for (int j = 0; j < 8; ++j) {
          if (j >= m) {
            meta8[j] = _mm256_setzero_ps();
            for (int r = 0; r < rows; ++r) sums[r][j] = _mm256_setzero_si256();
            continue;
          }
          __m256i c[kChunks];
          KVQ_UNROLL for (int z = 0; z < kChunks; ++z) c[z] = code_chunk_avx2(codes[j0 + j], z);
          meta8[j] = load_meta_avx2<M>(meta[j0 + j]);
          if constexpr (2 * kGroups == 4) meta8[j] = _mm256_permute2f128_ps(meta8[j], meta8[j], 0x00);
          for (int r = 0; r < rows; ++r) sums[r][j] = lane_sums_avx2<1>(c, r, 0);
        }
        // Scale and lo in the lane order of vphaddd(token 2i, token 2i + 1).
        __m256 scale2[4], lo2[4];
        KVQ_UNROLL for (int i = 0; i < 4; ++i) {
          scale2[i] = _mm256_shuffle_ps(meta8[2 * i], meta8[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0));
          lo2[i] = _mm256_shuffle_ps(meta8[2 * i], meta8[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1));
        }
        for (int r = 0; r < rows; ++r) {
          const __m256 sig = _mm256_load_ps(pair_sigma[r]), res = _mm256_load_ps(pair_residual[r]), sum = _mm256_load_ps(pair_sum[r]);
          __m256 f[4];
          KVQ_UNROLL for (int i = 0; i < 4; ++i) {
            const __m256 isum = _mm256_cvtepi32_ps(_mm256_hadd_epi32(sums[r][2 * i], sums[r][2 * i + 1]));
            f[i] = fmadd_avx2(fmadd_avx2(isum, sig, res), scale2[i], _mm256_mul_ps(lo2[i], sum));
          }
          // Halves added: x lane 4h + k / 2 ... = token 2·(2h + …); then each token's two
          // pairs, and the tokens back in order.
          const __m256 x = _mm256_add_ps(_mm256_permute2f128_ps(f[0], f[1], 0x20), _mm256_permute2f128_ps(f[0], f[1], 0x31));
          const __m256 y = _mm256_add_ps(_mm256_permute2f128_ps(f[2], f[3], 0x20), _mm256_permute2f128_ps(f[2], f[3], 0x31));
          const __m256 t = _mm256_hadd_ps(x, y);  // tokens 0, 1, 4, 5 | 2, 3, 6, 7
          store_logits_avx2(&s[r][first + j0], _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(t), _MM_SHUFFLE(3, 1, 2, 0))), m);
        }
      }
      return;
    }
    // Lane L's scale is metadata value kScaleIndex[L] (its lo the next): with more than 8
    // values, vpermps picks from both halves and bit 3 of the index (moved to the sign
    // bit) chooses.
    __m256i s_index[kAcc8], lo_index[kAcc8];
    for (int a = 0; a < kAcc8; ++a) {
      s_index[a] = _mm256_load_si256(reinterpret_cast<const __m256i*>(kScaleIndex.data() + 8 * a));
      lo_index[a] = _mm256_add_epi32(s_index[a], _mm256_set1_epi32(1));
    }
    auto spread = [&](__m256 low, __m256 high, __m256i index) {
      const __m256 from_low = _mm256_permutevar8x32_ps(low, index);
      if constexpr (!kTwoHalves) return from_low;
      return _mm256_blendv_ps(from_low, _mm256_permutevar8x32_ps(high, index),
                              _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
    };
    // Folded factors: σ is the same in lanes L and L + 8; μR and Σq' (split evenly over a
    // group's lanes) add.
    struct Folded {
      __m256 sigma, residual, group_sum;
    };
    Folded folded[kFold8 ? kMaxRowsPerPass : 1];
    if constexpr (kFold8)
      for (int r = 0; r < rows; ++r)
        folded[r] = {_mm256_load_ps(sigma[r]), _mm256_add_ps(_mm256_load_ps(residual[r]), _mm256_load_ps(residual[r] + 8)),
                     _mm256_add_ps(_mm256_load_ps(group_sum[r]), _mm256_load_ps(group_sum[r] + 8))};
    FloatVec<8> partial[kMaxRowsPerPass][8];  // [row][token of the 8]
    for (int j0 = 0; j0 < n; j0 += 8) {
      const int m = n - j0 < 8 ? n - j0 : 8;
      for (int j = 0; j < 8; ++j) {
        if (j >= m) {
          for (int r = 0; r < rows; ++r) partial[r][j] = FloatVec<8>{};
          continue;
        }
        __m256i c[kChunks];
        KVQ_UNROLL for (int z = 0; z < kChunks; ++z) c[z] = code_chunk_avx2(codes[j0 + j], z);
        const __m256 meta8 = load_meta_avx2<M>(meta[j0 + j]);
        const __m256 meta8_high = kTwoHalves ? load_meta_avx2<M>(meta[j0 + j], 1) : meta8;
        if constexpr (kFold8) {
          const __m256 s8 = _mm256_permutevar8x32_ps(meta8, s_index[0]), lo8 = _mm256_permutevar8x32_ps(meta8, lo_index[0]);
          for (int r = 0; r < rows; ++r) {
            const __m256 code_term = fmadd_avx2(_mm256_cvtepi32_ps(lane_sums_avx2<1>(c, r, 0)), folded[r].sigma,
                                                folded[r].residual);
            partial[r][j] = FloatVec<8>(fmadd_avx2(code_term, s8, _mm256_mul_ps(lo8, folded[r].group_sum)));
          }
          continue;
        }
        __m256 s_vec[kAcc8], lo_vec[kAcc8];
        KVQ_UNROLL for (int a = 0; a < kAcc8; ++a) {
          s_vec[a] = spread(meta8, meta8_high, s_index[a]);
          lo_vec[a] = spread(meta8, meta8_high, lo_index[a]);
        }
        for (int r = 0; r < rows; ++r) {
          __m256i acc[kAcc8];
          KVQ_UNROLL for (int a = 0; a < kAcc8; ++a) acc[a] = lane_sums_avx2<kAcc8>(c, r, a);  // lanes 8a .. 8a + 7
          // Each accumulator's s·(σ·isum + μR) + lo·Σq' on its own, then added neighbours
          // first (one chain through all of them waited on 2·kAcc8 FMA latencies).
          __m256 f[kAcc8];
          KVQ_UNROLL for (int a = 0; a < kAcc8; ++a) {
            const __m256 code_term =
                fmadd_avx2(_mm256_cvtepi32_ps(acc[a]), _mm256_load_ps(sigma[r] + 8 * a), _mm256_load_ps(residual[r] + 8 * a));
            f[a] = fmadd_avx2(code_term, s_vec[a], _mm256_mul_ps(lo_vec[a], _mm256_load_ps(group_sum[r] + 8 * a)));
          }
          KVQ_UNROLL for (int w = kAcc8; w > 1; w /= 2)
            KVQ_UNROLL for (int a = 0; a < w / 2; ++a) f[a] = _mm256_add_ps(f[2 * a], f[2 * a + 1]);
          partial[r][j] = FloatVec<8>(f[0]);
        }
      }
      for (int r = 0; r < rows; ++r) {
        FloatVec<8> sums;
        sum_lanes_8x8(partial[r], sums);
        store_logits_avx2(&s[r][first + j0], __m256(sums), m);
      }
    }
  }
#endif

#if KVQ_CPU_AVX512_VNNI
  // Chunk z (64 bytes) of the slab-ordered codes, unpacked in registers.
  static KVQ_FORCE_INLINE __m512i code_chunk(const std::uint8_t* codes, int z) {
    if constexpr (Bits == 8) {
      return _mm512_loadu_si512(codes + 64 * z);
    } else if constexpr (kSlabBytes >= 64) {
      const int k = 64 * z / kSlabBytes, j0 = 64 * z % kSlabBytes;
      return code_field<Bits>(_mm512_loadu_si512(codes + j0), k);
    } else if constexpr (kSlabBytes == 32) {  // two slabs per chunk
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
      const __m256i m = _mm256_set1_epi8(char((1u << Bits) - 1u));
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(x, unsigned(2 * z * Bits)), m);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(x, unsigned((2 * z + 1) * Bits)), m);
      // Masked inserts with an explicit source: the plain ones (and the casts and zext
      // built on them) use _mm512_undefined_*, which GCC 12 reports as
      // maybe-uninitialized under -Wall.
      const __m512i zero = _mm512_setzero_si512();
      const __m512i low = _mm512_mask_inserti64x4(zero, 0xFF, zero, lo, 0);
      return _mm512_mask_inserti64x4(low, 0xFF, low, hi, 1);
    } else {  // 16-byte slabs: four per chunk
      static_assert(kSlabBytes == 16);
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
      const __m128i m = _mm_set1_epi8(char((1u << Bits) - 1u));
      auto slab = [&](int k) { return _mm_and_si128(_mm_srli_epi16(x, unsigned((4 * z + k) * Bits)), m); };
      __m512i out = _mm512_setzero_si512();  // the insert positions must be immediates
      out = _mm512_mask_inserti32x4(out, 0xFFFF, out, slab(0), 0);
      out = _mm512_mask_inserti32x4(out, 0xFFFF, out, slab(1), 1);
      out = _mm512_mask_inserti32x4(out, 0xFFFF, out, slab(2), 2);
      return _mm512_mask_inserti32x4(out, 0xFFFF, out, slab(3), 3);
    }
  }

  // Lane j of the result is the sum of the 16 lanes of v[kReducePos[j]] (a 4-level
  // shuffle-and-add tree; kReducePos is its own inverse). Intrinsics here and below use
  // masked forms with an explicit source: the plain ones are built on _mm512_undefined_*,
  // which GCC 12 reports as maybe-uninitialized under -Wall.
  static constexpr int kReducePos[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
  static KVQ_FORCE_INLINE __m512 reduce_16x16(const __m512* v) {
    __m512 t[8], u[4], w[2];
    KVQ_UNROLL for (int i = 0; i < 8; ++i)
      t[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(0xFFFF, v[i], v[i + 8], 0x44), _mm512_maskz_shuffle_f32x4(0xFFFF, v[i], v[i + 8], 0xEE));
    KVQ_UNROLL for (int i = 0; i < 4; ++i)
      u[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(0xFFFF, t[i], t[i + 4], 0x88), _mm512_maskz_shuffle_f32x4(0xFFFF, t[i], t[i + 4], 0xDD));
    KVQ_UNROLL for (int i = 0; i < 2; ++i)
      w[i] = _mm512_add_ps(_mm512_maskz_shuffle_ps(0xFFFF, u[i], u[i + 2], 0x44), _mm512_maskz_shuffle_ps(0xFFFF, u[i], u[i + 2], 0xEE));
    return _mm512_add_ps(_mm512_maskz_shuffle_ps(0xFFFF, w[0], w[1], 0x88), _mm512_maskz_shuffle_ps(0xFFFF, w[0], w[1], 0xDD));
  }

  // The 2·kGroups stored metadata values of one token as fp32 lanes (two vectors when
  // there are more than 16).
  template <MetaType M>
  static KVQ_FORCE_INLINE void load_meta(const meta_storage_t<M>* meta, __m512& lo16, __m512& hi16) {
    constexpr int kCount = 2 * kGroups;
    constexpr __mmask16 kLow = kCount >= 16 ? 0xFFFF : __mmask16((1u << kCount) - 1u);
    constexpr __mmask16 kHigh = kCount <= 16 ? 0 : __mmask16((1u << (kCount - 16)) - 1u);
    auto widen = [](const meta_storage_t<M>* p, __mmask16 mask) {
      if constexpr (M == MetaType::fp32) {
        return _mm512_maskz_loadu_ps(mask, p);
      } else if constexpr (M == MetaType::fp16) {
        return _mm512_maskz_cvtph_ps(0xFFFF, _mm256_maskz_loadu_epi16(mask, p));
      } else {  // bf16: the high half of an fp32
        return _mm512_castsi512_ps(
            _mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_maskz_loadu_epi16(mask, p)), 16));
      }
    };
    lo16 = widen(meta, kLow);
    hi16 = kHigh != 0 ? widen(meta + 16, kHigh) : _mm512_setzero_ps();
  }

  template <MetaType M>
  KVQ_FORCE_INLINE void score_block_vnni(int n, const std::uint8_t* const* codes, const meta_storage_t<M>* const* meta,
                                         int rows, float (*s)[kTokensPerBlock], int first) const {
    constexpr int kChunks = D / 64, kAcc = kAccLanes / 16;
    alignas(64) __m512 partial[kMaxRowsPerPass][16];  // [row][reduce position]
    for (int j0 = 0; j0 < n; j0 += 16) {
      const int m = n - j0 < 16 ? n - j0 : 16;
      for (int j = 0; j < m; ++j) {
        const int pos = kReducePos[j];
        __m512i c[kChunks];
        KVQ_UNROLL for (int z = 0; z < kChunks; ++z) c[z] = code_chunk(codes[j0 + j], z);
        __m512 meta_lo, meta_hi;
        load_meta<M>(meta[j0 + j], meta_lo, meta_hi);
        __m512 s_vec[kAcc], lo_vec[kAcc];
        KVQ_UNROLL for (int a = 0; a < kAcc; ++a) {
          const __m512i idx = _mm512_load_si512(kScaleIndex.data() + 16 * a);
          s_vec[a] = _mm512_permutex2var_ps(meta_lo, idx, meta_hi);
          lo_vec[a] = _mm512_permutex2var_ps(meta_lo, _mm512_add_epi32(idx, _mm512_set1_epi32(1)), meta_hi);
        }
        for (int r = 0; r < rows; ++r) partial[r][pos] = lane_factors(c, s_vec, lo_vec, r);
      }
      for (int j = m; j < 16; ++j)
        for (int r = 0; r < rows; ++r) partial[r][kReducePos[j]] = _mm512_setzero_ps();
      const __mmask16 store = __mmask16((1u << m) - 1u);
      for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(&s[r][first + j0], store, reduce_16x16(partial[r]));
    }
  }

  // score_block in the transposed layout (see kTransposed), 16 tokens per step. 1 row,
  // and 2 or 4 where they fit, are scored with everything in registers: the rows' accumulators, and
  // each token's lanes added as the quads come. Other row counts unpack each quad once
  // and score it row by row, the lane sums going through memory. (Over the runtime row
  // count, 4 rows took 17.0 cycles per token against 14.3 in registers: K4V2, d 128,
  // 64-token blocks from L2, Zen 4. Unpacking each quad again for every 4 rows lost as
  // much at 8 rows: the unpacking and the metadata are ~5 cycles per token.)
  template <MetaType M>
  KVQ_FORCE_INLINE void score_block_transposed(int n, const std::uint8_t* const* codes,
                                               const meta_storage_t<M>* const* meta, int rows,
                                               float (*s)[kTokensPerBlock], int first) const {
    for (int j0 = 0; j0 < n; j0 += 16) {
      const int count = n - j0 < 16 ? n - j0 : 16;
      if (rows == 1) {
        score_step_registers<M, 1>(count, codes + j0, meta + j0, s, first + j0);
      } else if (rows == 2 && kTwoRowsInRegisters) {
        score_step_registers<M, 2>(count, codes + j0, meta + j0, s, first + j0);
      } else if (rows == 4 && kFourRowsInRegisters) {
        score_step_registers<M, 4>(count, codes + j0, meta + j0, s, first + j0);
      } else {
        score_step_memory<M>(count, codes + j0, meta + j0, rows, s, first + j0);
      }
    }
  }

  static constexpr int kQuads = 4 / kTokensPerRow;  // quads per 16 tokens

  // Lane (c, t) of quad q is token 4q + t (64-byte parts), 8q + 4·(c/2) + t (32-byte
  // rows) or 4c + t (16-byte rows): adding each token's lanes leaves the tokens in order.
  static KVQ_FORCE_INLINE __m512 lane_pairs(__m512 a, __m512 b) {  // [a0+a1, a2+a3, b0+b1, b2+b3] over 128-bit lanes
    return _mm512_add_ps(_mm512_maskz_shuffle_f32x4(0xFFFF, a, b, 0x88), _mm512_maskz_shuffle_f32x4(0xFFFF, a, b, 0xDD));
  }
  static KVQ_FORCE_INLINE __m512 lane_halves(__m512 a, __m512 b) {  // [a0+a2, a1+a3, b0+b2, b1+b3]
    return _mm512_add_ps(_mm512_maskz_shuffle_f32x4(0xFFFF, a, b, 0x44), _mm512_maskz_shuffle_f32x4(0xFFFF, a, b, 0xEE));
  }

  // Rows 0 .. RB of one step (count ≤ 16 tokens), all in registers: quad 0 or 2's lanes
  // wait in `pending`, the halves of quads 0–1 in `folded`, so at most two vectors per row
  // are live across quads.
  template <MetaType M, int RB>
  KVQ_FORCE_INLINE void score_step_registers(int count, const std::uint8_t* const* codes,
                                             const meta_storage_t<M>* const* meta, float (*s)[kTokensPerBlock],
                                             int first) const {
    __m512 pending[RB], folded[RB], y[RB];
    KVQ_UNROLL for (int q = 0; q < kQuads; ++q) {
      __m512i u[kParts][4];
      __m512 s_vec[kAccClasses], lo_vec[kAccClasses];
      load_quad<M>(count, codes, meta, q, u, s_vec, lo_vec);
      __m512 total[RB];
      score_quad_rows<RB>([&](int p, int m, int k) { return code_field<Bits>(u[p][m], k); }, s_vec, lo_vec, 0, total);
      KVQ_UNROLL for (int i = 0; i < RB; ++i) {
        if constexpr (kQuads == 1) {
          y[i] = total[i];
        } else if (q % 2 == 0) {
          pending[i] = total[i];
        } else if constexpr (kQuads == 2) {
          y[i] = lane_pairs(pending[i], total[i]);
        } else if (q == 1) {
          folded[i] = lane_halves(pending[i], total[i]);
        } else {
          y[i] = lane_pairs(folded[i], lane_halves(pending[i], total[i]));
        }
      }
    }
    const __mmask16 store = __mmask16((1u << count) - 1u);
    KVQ_UNROLL for (int i = 0; i < RB; ++i) _mm512_mask_storeu_ps(&s[i][first], store, y[i]);
  }

  // Any number of rows in one step: each quad is unpacked once, all its slabs, and
  // scored row by row; the lanes wait in memory until the step's quads are done.
  template <MetaType M>
  KVQ_FORCE_INLINE void score_step_memory(int count, const std::uint8_t* const* codes,
                                          const meta_storage_t<M>* const* meta, int rows, float (*s)[kTokensPerBlock],
                                          int first) const {
    alignas(64) __m512 partial[kQuads][kMaxRowsPerPass];
    KVQ_UNROLL for (int q = 0; q < kQuads; ++q) {
      __m512i u[kParts][4];
      __m512 s_vec[kAccClasses], lo_vec[kAccClasses];
      load_quad<M>(count, codes, meta, q, u, s_vec, lo_vec);
      __m512i c[kParts][4][kSlabs];  // every slab, once for all rows
      KVQ_UNROLL for (int p = 0; p < kParts; ++p)
        KVQ_UNROLL for (int m = 0; m < 4; ++m)
          KVQ_UNROLL for (int k = 0; k < kSlabs; ++k) c[p][m][k] = code_field<Bits>(u[p][m], k);
      for (int r = 0; r < rows; ++r)
        score_quad_rows<1>([&](int p, int m, int k) { return c[p][m][k]; }, s_vec, lo_vec, r, partial[q] + r);
    }
    const __mmask16 store = __mmask16((1u << count) - 1u);
    for (int r = 0; r < rows; ++r) {
      __m512 y;
      if constexpr (kQuads == 4) {
        y = lane_pairs(lane_halves(partial[0][r], partial[1][r]), lane_halves(partial[2][r], partial[3][r]));
      } else if constexpr (kQuads == 2) {
        y = lane_pairs(partial[0][r], partial[1][r]);
      } else {
        y = partial[0][r];
      }
      _mm512_mask_storeu_ps(&s[r][first], store, y);
    }
  }

  // Quad q of a step of count ≤ 16 tokens (codes[j], meta[j] for j < count): its codes
  // transposed, u[p][m] = dword m of part p in every lane (the register path takes each
  // slab out just before its products, so that they are not all live at once), and the
  // scale and lo of each lane's (token, group) widened to fp32.
  template <MetaType M>
  KVQ_FORCE_INLINE void load_quad(int count, const std::uint8_t* const* codes, const meta_storage_t<M>* const* meta,
                                  int q, __m512i (&u)[kParts][4], __m512 (&s_vec)[kAccClasses],
                                  __m512 (&lo_vec)[kAccClasses]) const {
    constexpr int kMetaPerToken = 2 * kGroups;
    constexpr int kQuadMeta = 4 * kTokensPerRow * kMetaPerToken;  // ≤ 64 16-bit values
    alignas(64) static constexpr std::uint8_t kZeroRow[kSlabBytes] = {};
    // vpermw indices: lane (c, t) of accumulator class A = (part p, class a) ← the scale
    // (lo: + 1) of its token and group in the quad's metadata, tokens 4·(c / kRowLanes) + t.
    alignas(64) static constexpr auto kMetaIndex = [] {
      std::array<std::array<std::uint16_t, 32>, 2 * kAccClasses> idx{};
      for (int p = 0; p < kParts; ++p)
        for (int a = 0; a < kClasses; ++a)
          for (int lane = 0; lane < 16; ++lane) {
            const int c = lane / 4, t = lane % 4, token = 4 * (c / kRowLanes) + t, A = p * kClasses + a;
            idx[2 * A][lane] = std::uint16_t(token * kMetaPerToken + 2 * transposed_group(p, c, a));
            idx[2 * A + 1][lane] = std::uint16_t(idx[2 * A][lane] + 1);
          }
      return idx;
    }();
    constexpr int kQuadTokens = 4 * kTokensPerRow;
    auto row = [&](int j) { return j < count ? codes[j] : kZeroRow; };
    KVQ_UNROLL for (int p = 0; p < kParts; ++p) {
      // Part p of the quad's tokens: one token per register (64-byte parts), two
      // (32-byte rows: 256-bit halves) or four (16-byte rows: 128-bit lanes).
      __m512i x[4];
      KVQ_UNROLL for (int t = 0; t < 4; ++t) {
        if constexpr (kPartBytes == 64) {
          x[t] = _mm512_loadu_si512(row(4 * q + t) + 64 * p);
        } else if constexpr (kPartBytes == 32) {
          const __m512i zero = _mm512_setzero_si512();
          const __m512i low = _mm512_mask_inserti64x4(zero, 0xFF, zero, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row(8 * q + t))), 0);
          x[t] = _mm512_mask_inserti64x4(low, 0xFF, low, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row(8 * q + 4 + t))), 1);
        } else {
          static_assert(kPartBytes == 16);
          auto lane = [&](int cl) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(row(4 * cl + t))); };
          const __m512i zero = _mm512_setzero_si512();  // the insert positions must be immediates
          __m512i v = _mm512_mask_inserti32x4(zero, 0xFFFF, zero, lane(0), 0);
          v = _mm512_mask_inserti32x4(v, 0xFFFF, v, lane(1), 1);
          v = _mm512_mask_inserti32x4(v, 0xFFFF, v, lane(2), 2);
          x[t] = _mm512_mask_inserti32x4(v, 0xFFFF, v, lane(3), 3);
        }
      }
      // Two stages of a 4×4 dword transpose in each 128-bit lane.
      const __m512i t0 = _mm512_maskz_unpacklo_epi32(0xFFFF, x[0], x[1]), t1 = _mm512_maskz_unpackhi_epi32(0xFFFF, x[0], x[1]);
      const __m512i t2 = _mm512_maskz_unpacklo_epi32(0xFFFF, x[2], x[3]), t3 = _mm512_maskz_unpackhi_epi32(0xFFFF, x[2], x[3]);
      u[p][0] = _mm512_maskz_unpacklo_epi64(0xFF, t0, t2), u[p][1] = _mm512_maskz_unpackhi_epi64(0xFF, t0, t2);
      u[p][2] = _mm512_maskz_unpacklo_epi64(0xFF, t1, t3), u[p][3] = _mm512_maskz_unpackhi_epi64(0xFF, t1, t3);
    }
    // The quad's metadata in place when its tokens are consecutive slots of one page
    // (the usual case), else gathered.
    alignas(64) std::uint16_t quad_copy[64];  // zero past count
    const meta_storage_t<M>* const* quad = meta + q * kQuadTokens;
    const bool in_place = q * kQuadTokens + kQuadTokens <= count &&
                          runs_are_strided<kQuadTokens>(quad, kQuadTokens, kMetaPerToken * sizeof(meta_storage_t<M>));
    const std::uint16_t* quad_meta = in_place ? reinterpret_cast<const std::uint16_t*>(quad[0]) : quad_copy;
    if (!in_place)
      for (int t = 0; t < kQuadTokens; ++t) {
        if (q * kQuadTokens + t < count) std::memcpy(quad_copy + t * kMetaPerToken, quad[t], kMetaPerToken * sizeof(std::uint16_t));
        else std::memset(quad_copy + t * kMetaPerToken, 0, kMetaPerToken * sizeof(std::uint16_t));
      }
    // Masked loads: nothing past the quad's kQuadMeta values is read.
    constexpr __mmask32 kLowMask = kQuadMeta >= 32 ? ~__mmask32(0) : __mmask32((1u << kQuadMeta) - 1u);
    constexpr __mmask32 kHighMask = kQuadMeta >= 64 ? ~__mmask32(0) : kQuadMeta > 32 ? __mmask32((1u << (kQuadMeta - 32)) - 1u) : 0;
    const __m512i meta_lo = _mm512_maskz_loadu_epi16(kLowMask, quad_meta);
    const __m512i meta_hi = _mm512_maskz_loadu_epi16(kHighMask, quad_meta + 32);
    KVQ_UNROLL for (int A = 0; A < kAccClasses; ++A)
      KVQ_UNROLL for (int h = 0; h < 2; ++h) {
        const __m512i idx = _mm512_load_si512(kMetaIndex[2 * A + h].data());
        const __m512i bits = kQuadMeta <= 32 ? _mm512_maskz_permutexvar_epi16(~__mmask32(0), idx, meta_lo)
                                             : _mm512_maskz_permutex2var_epi16(~__mmask32(0), meta_lo, idx, meta_hi);
        const __m256i half = _mm512_mask_extracti64x4_epi64(_mm256_setzero_si256(), 0xF, bits, 0);
        __m512 v;
        if constexpr (M == MetaType::fp16) v = _mm512_maskz_cvtph_ps(0xFFFF, half);
        else v = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, half), 16));
        (h == 0 ? s_vec : lo_vec)[A] = v;
      }
  }

  // total[i] = the 16 lanes (token, group) of row r0 + i for one quad, i < RB: vpdpbusd
  // sums codes × query dwords per (token, group) in each lane, then one convert and
  // three FMAs per vector scale them. The RB rows' chains interleave.
  template <int RB, class Slab>
  KVQ_FORCE_INLINE void score_quad_rows(Slab&& slab_of, const __m512 (&s_vec)[kAccClasses],
                                        const __m512 (&lo_vec)[kAccClasses], int r0, __m512* total) const {
    // Fewer than four rows: two chains per row and accumulator class, not one chain of 8
    // vpdpbusd latencies. Four rows have ≥ 4 independent chains already, and a second set
    // spilled (K4V2 / K2V2 fastest, d 128, GQA 4, 4K warm, Zen 4: −0.5% / −1.8%); at two
    // rows one chain each lost 13% (K2V2, d 64). The integer sums are the same.
    constexpr int kChains = RB >= 4 ? 1 : 2;
    __m512i acc[RB][kAccClasses][kChains];
    KVQ_UNROLL for (int i = 0; i < RB; ++i)
      KVQ_UNROLL for (int A = 0; A < kAccClasses; ++A)
        KVQ_UNROLL for (int c = 0; c < kChains; ++c) acc[i][A][c] = _mm512_setzero_si512();
    KVQ_UNROLL for (int p = 0; p < kParts; ++p)
      KVQ_UNROLL for (int m = 0; m < 4; ++m)
        KVQ_UNROLL for (int k = 0; k < kSlabs; ++k) {
          const __m512i slab = slab_of(p, m, k);
          KVQ_UNROLL for (int i = 0; i < RB; ++i) {
            __m512i& chain = acc[i][p * kClasses + transposed_class(m)][(m * kSlabs + k) % kChains];
            chain = dpbusd_tied(chain, slab, *reinterpret_cast<const __m512i*>(q_lanes[r0 + i][p][k][m]));
          }
        }
    KVQ_UNROLL for (int i = 0; i < RB; ++i) {
      const int r = r0 + i;
      // The lo terms do not wait on the sums: each class is s·(σ·isum + μR) + lo·Σq'
      // with lo·Σq' computed aside, and the classes are added last, in order.
      __m512 f[kAccClasses];
      KVQ_UNROLL for (int A = 0; A < kAccClasses; ++A) {
        const __m512 lo_term = _mm512_mul_ps(lo_vec[A], _mm512_load_ps(sum_lanes_t[r][A]));
        __m512i sum = acc[i][A][0];
        KVQ_UNROLL for (int c = 1; c < kChains; ++c) sum = _mm512_add_epi32(sum, acc[i][A][c]);
        const __m512 isum = _mm512_mask_cvtepi32_ps(_mm512_setzero_ps(), 0xFFFF, sum);
        const __m512 code_term = _mm512_fmadd_ps(isum, _mm512_load_ps(sigma_lanes[r][A]), _mm512_load_ps(residual_lanes[r][A]));
        f[A] = _mm512_fmadd_ps(code_term, s_vec[A], lo_term);
      }
      static_assert(kClasses <= 2, "kTransposed groups hold ≥ 8 bytes");
      total[i] = f[0];
      KVQ_UNROLL for (int A = 1; A < kAccClasses; ++A) total[i] = _mm512_add_ps(total[i], f[A]);
    }
  }

  // The 16 lanes whose sum is row r's logit for one token (codes already unpacked).
  template <int kChunks, int kAcc>
  KVQ_FORCE_INLINE __m512 lane_factors(const __m512i (&c)[kChunks], const __m512 (&s_vec)[kAcc],
                                       const __m512 (&lo_vec)[kAcc], int r) const {
    __m512i acc[kAcc];
    KVQ_UNROLL for (int a = 0; a < kAcc; ++a) acc[a] = _mm512_setzero_si512();
    KVQ_UNROLL for (int z = 0; z < kChunks; ++z)
      acc[z % kAcc] = _mm512_dpbusd_epi32(acc[z % kAcc], c[z], _mm512_loadu_si512(q8[r] + 64 * z));
    __m512 f = _mm512_setzero_ps();
    KVQ_UNROLL for (int a = 0; a < kAcc; ++a) {
      // Masked forms with an explicit source throughout (see code_chunk).
      const __m512 isum = _mm512_mask_cvtepi32_ps(_mm512_setzero_ps(), 0xFFFF, acc[a]);
      const __m512 code_term = _mm512_fmadd_ps(isum, _mm512_loadu_ps(sigma[r] + 16 * a), _mm512_loadu_ps(residual[r] + 16 * a));
      f = _mm512_fmadd_ps(code_term, s_vec[a], f);
      f = _mm512_fmadd_ps(lo_vec[a], _mm512_loadu_ps(group_sum[r] + 16 * a), f);
    }
    return f;
  }

  KVQ_FORCE_INLINE void score_vnni(const std::uint8_t* codes, const float* s_lane, const float* lo_lane, int rows,
                                   float* logits, int stride) const {
    constexpr int kChunks = D / 64, kAcc = kAccLanes / 16;
    __m512i c[kChunks];
    KVQ_UNROLL for (int z = 0; z < kChunks; ++z) c[z] = code_chunk(codes, z);
    __m512 s_vec[kAcc], lo_vec[kAcc];
    KVQ_UNROLL for (int a = 0; a < kAcc; ++a) {
      s_vec[a] = _mm512_loadu_ps(s_lane + 16 * a);
      lo_vec[a] = _mm512_loadu_ps(lo_lane + 16 * a);
    }
    for (int r = 0; r < rows; ++r) {
      const __m512 f = lane_factors(c, s_vec, lo_vec, r);
      const __m512d fd = _mm512_castps_pd(f);
      __m256 h = _mm256_add_ps(_mm256_castpd_ps(_mm512_mask_extractf64x4_pd(_mm256_setzero_pd(), 0xF, fd, 0)),
                               _mm256_castpd_ps(_mm512_mask_extractf64x4_pd(_mm256_setzero_pd(), 0xF, fd, 1)));
      __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      x = _mm_add_ps(x, _mm_movehl_ps(x, x));
      x = _mm_add_ss(x, _mm_movehdup_ps(x));
      logits[r * stride] = _mm_cvtss_f32(x);
    }
  }
#endif

  // One row from codes unpacked one per byte; with kSimd and AVX2, 32 bytes per step
  // (vpmaddubsw: 15·127·2 fits int16 for codes ≤ 4 bits), plain loops otherwise.
  template <bool kSimd>
  KVQ_FORCE_INLINE float score_row(const std::uint8_t* KVQ_RESTRICT c, int r, const float* s_lane,
                                   const float* lo_lane) const {
    alignas(64) std::int32_t isum[kAccLanes] = {};
#if KVQ_CPU_AVX2
    if constexpr (kSimd && Bits <= 4) {
      const __m256i ones = _mm256_set1_epi16(1);
      for (int z = 0; z < D / 32; ++z) {
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * z)),
                                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8[r] + 32 * z)));
        std::int32_t* dst = isum + (8 * z) % kAccLanes;
        const __m256i prev = _mm256_load_si256(reinterpret_cast<const __m256i*>(dst));
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst), _mm256_add_epi32(prev, _mm256_madd_epi16(pairs, ones)));
      }
    } else
#endif
    {
      for (int lane = 0; lane < D / 4; ++lane) {
        std::int32_t s = 0;
        for (int b = 0; b < 4; ++b) s += std::int32_t(c[4 * lane + b]) * std::int32_t(q8[r][4 * lane + b]);
        isum[lane % kAccLanes] += s;
      }
    }
    float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int lane = 0; lane < kAccLanes; ++lane)
      f[lane % 8] += (float(isum[lane]) * sigma[r][lane] + residual[r][lane]) * s_lane[lane] + lo_lane[lane] * group_sum[r][lane];
    return ((f[0] + f[1]) + (f[2] + f[3])) + ((f[4] + f[5]) + (f[6] + f[7]));
  }
};

}  // namespace kvq::detail
