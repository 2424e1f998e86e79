// kvq/core/quantizer.hpp — the group quantizer Q(b, G, clip) of DESIGN §2.
//
// Written once for host and device: the CUDA warp quantizer (kvq/cuda/kernel/rows.cuh)
// reuses MetaTraits, clip_rank and quantize_value and reproduces quantize_group's steps,
// so codes and metadata are bit-identical to the CPU's. All arithmetic goes
// through mul_rn/add_rn/... (no contraction) and never converts NaN to an integer.
//
// Per group of G elements the stored metadata is a pair {scale, lo} in the policy's
// MetaType; codes are packed little-endian (kvq/core/packing.hpp).
#pragma once

#include <type_traits>

#include "kvq/core/config.hpp"
#include "kvq/core/numeric.hpp"
#include "kvq/core/packing.hpp"
#include "kvq/core/policy.hpp"

namespace kvq {

// Storage of one metadata value and its conversions (saturating, DESIGN §2.3).
template <MetaType M>
struct MetaTraits;

template <>
struct MetaTraits<MetaType::fp16> {
  using storage = std::uint16_t;
  KVQ_HOST_DEVICE static storage encode(float f) { return float_to_half_bits(f, true); }
  KVQ_HOST_DEVICE static float decode(storage s) { return half_bits_to_float(s); }
};
template <>
struct MetaTraits<MetaType::bf16> {
  using storage = std::uint16_t;
  KVQ_HOST_DEVICE static storage encode(float f) { return float_to_bf16_bits(f, true); }
  KVQ_HOST_DEVICE static float decode(storage s) { return bf16_bits_to_float(s); }
};
template <>
struct MetaTraits<MetaType::fp32> {
  using storage = float;
  KVQ_HOST_DEVICE static storage encode(float f) { return saturate_f32(f); }
  KVQ_HOST_DEVICE static float decode(storage s) { return s; }
};

template <MetaType M>
using meta_storage_t = typename MetaTraits<M>::storage;

// Decoded metadata of one group.
struct GroupMeta {
  float scale;
  float lo;
};

// Index of the clip threshold among the G ascending |x|: ⌊c·G⌋ clamped to [0, G−1],
// in exact integer arithmetic (c = permille/1000).
KVQ_HOST_DEVICE constexpr int clip_rank(int group, int clip_permille) {
  const int k = clip_permille * group / 1000;
  return k < 0 ? 0 : (k > group - 1 ? group - 1 : k);
}

// The k-th smallest |x_i| (0-based). Rank counting with index tie-breaking: O(G²)
// compares but no scratch memory, the reference's plainest form. Any selection returns
// the same value: the CPU SIMD append (cpu/quantize.hpp, clip_rows) and the CUDA warp
// quantizer (cuda/kernel/rows.cuh) select it for many groups, or with many lanes, at once.
KVQ_HOST_DEVICE float kth_smallest_abs(const float* x, int n, int k) {
  for (int i = 0; i < n; ++i) {
    const float ai = x[i] < 0.f ? -x[i] : x[i];
    int rank = 0;
    for (int j = 0; j < n; ++j) {
      const float aj = x[j] < 0.f ? -x[j] : x[j];
      rank += (aj < ai) || (aj == ai && j < i);
    }
    if (rank == k) return ai;
  }
  return 0.f;  // unreachable for finite input
}

// Code of one element given the stored (decoded) metadata: ⌊(x − lo)·inv + 0.5⌋
// clamped to [0, levels]. `inv` = 1/scale in IEEE fp32.
KVQ_HOST_DEVICE unsigned quantize_value(float x, float lo, float inv, int levels) {
  const float v = floor_f(add_rn(mul_rn(sub_rn(x, lo), inv), 0.5f));
  if (!(v > 0.f)) return 0u;  // also catches NaN: never converted to an integer
  if (v >= static_cast<float>(levels)) return static_cast<unsigned>(levels);
  return static_cast<unsigned>(v);
}

// x̂ = lo + s·c, unfused (explicitly rounded product, then sum).
KVQ_HOST_DEVICE float dequantize_value(unsigned code, float scale, float lo) {
  return add_rn(lo, mul_rn(scale, static_cast<float>(code)));
}

// Quantizes one group.
//   x      : [G] fp32 input (already centered/rotated)
//   packed : [G·Bits/8] bytes, fully overwritten
//   meta   : [2] = {scale, lo} in the spec's MetaType
// Returns the decoded metadata (what dequantization will use).
template <QuantSpec S>
KVQ_HOST_DEVICE GroupMeta quantize_group(const float* x, std::uint8_t* packed,
                                         meta_storage_t<S.meta>* meta) {
  using Meta = MetaTraits<S.meta>;
  constexpr int G = S.group;
  constexpr int kLevels = S.levels();
  constexpr int kPerByte = 8 / S.bits;

  bool finite = true;
  for (int i = 0; i < G; ++i) finite = finite && is_finite_f(x[i]);
  if (!finite) {
    // DESIGN §2: a non-finite group stores s = NaN and codes 0; it dequantizes to NaN.
    const float qnan = bits_float(0x7fc00000u);
    meta[0] = Meta::encode(qnan);
    meta[1] = Meta::encode(qnan);
    for (int b = 0; b < G / kPerByte; ++b) packed[b] = 0;
    return {Meta::decode(meta[0]), Meta::decode(meta[1])};
  }

  // 1. clip threshold t (only when clipping can change anything)
  float t = 0.f;
  constexpr bool kClip = S.clips() && clip_rank(G, S.clip_permille) < G - 1;
  if constexpr (kClip) t = kth_smallest_abs(x, G, clip_rank(G, S.clip_permille));
  auto clipped = [&](int i) {
    float v = x[i];
    if constexpr (kClip) v = v > t ? t : (v < -t ? -t : v);
    return v;
  };

  // 2. range and scale
  float lo = clipped(0), hi = lo;
  for (int i = 1; i < G; ++i) {
    const float v = clipped(i);
    lo = fmin_f(lo, v);
    hi = fmax_f(hi, v);
  }
  const float scale = div_rn(fmax_f(sub_rn(hi, lo), 1e-8f), static_cast<float>(kLevels));

  // 3. store metadata, then quantize against the stored values
  meta[0] = Meta::encode(scale);
  meta[1] = Meta::encode(lo);
  const float s_stored = Meta::decode(meta[0]);
  const float lo_stored = Meta::decode(meta[1]);
  if (s_stored == 0.f) {
    for (int b = 0; b < G / kPerByte; ++b) packed[b] = 0;
    return {s_stored, lo_stored};
  }
  const float inv = div_rn(1.f, s_stored);
  for (int b = 0; b < G / kPerByte; ++b) {
    unsigned byte = 0;
    for (int k = 0; k < kPerByte; ++k)
      byte |= quantize_value(clipped(b * kPerByte + k), lo_stored, inv, kLevels) << (k * S.bits);
    packed[b] = static_cast<std::uint8_t>(byte);
  }
  return {s_stored, lo_stored};
}

// Dequantizes one group: out[i] = lo + s·c_i.
template <QuantSpec S>
KVQ_HOST_DEVICE void dequantize_group(const std::uint8_t* packed, const meta_storage_t<S.meta>* meta,
                                      float* out) {
  using Meta = MetaTraits<S.meta>;
  const float s = Meta::decode(meta[0]);
  const float lo = Meta::decode(meta[1]);
  for (int i = 0; i < S.group; ++i) out[i] = dequantize_value(unpack_code<S.bits>(packed, i), s, lo);
}

// Row helpers over head_dim D = the number of elements in the row.
//   x      : [D] fp32
//   packed : [D·bits/8]
//   meta   : [D/G][2] {scale, lo}
template <QuantSpec S, int D>
KVQ_HOST_DEVICE void quantize_row(const float* x, std::uint8_t* packed, meta_storage_t<S.meta>* meta) {
  static_assert(D % S.group == 0, "kvq: group must divide the row length");
  for (int g = 0; g < D / S.group; ++g)
    quantize_group<S>(x + g * S.group, packed + g * (S.group * S.bits / 8), meta + 2 * g);
}

template <QuantSpec S, int D>
KVQ_HOST_DEVICE void dequantize_row(const std::uint8_t* packed, const meta_storage_t<S.meta>* meta,
                                    float* out) {
  static_assert(D % S.group == 0, "kvq: group must divide the row length");
  for (int g = 0; g < D / S.group; ++g)
    dequantize_group<S>(packed + g * (S.group * S.bits / 8), meta + 2 * g, out + g * S.group);
}

}  // namespace kvq
