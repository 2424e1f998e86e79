// kvq/calib/fake_quant.hpp — the deployment group quantizer with run-time parameters.
//
// Calibration chooses bits, group, clip and metadata dtype at run time (from a
// Policy value or a CLI flag), while kvq::quantize_group<S> takes them as template
// arguments. This wrapper walks the same control flow as quantize_group and calls
// the very same scalar primitives (quantize_value, dequantize_value, MetaTraits; the
// clip threshold is the same order statistic, selected in O(G)), so the dequantized
// values are bit-identical to what the cache stores; tests/calib checks that against
// quantize_group<S>.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

#include "kvq/core/policy.hpp"
#include "kvq/core/quantizer.hpp"
#include "kvq/core/status.hpp"

namespace kvq::calib {

namespace detail {

template <MetaType M>
inline float meta_roundtrip(float f) {
  return MetaTraits<M>::decode(MetaTraits<M>::encode(f));
}

inline float meta_roundtrip(MetaType m, float f) {
  switch (m) {
    case MetaType::fp16: return meta_roundtrip<MetaType::fp16>(f);
    case MetaType::bf16: return meta_roundtrip<MetaType::bf16>(f);
    case MetaType::fp32: return meta_roundtrip<MetaType::fp32>(f);
  }
  return f;
}

}  // namespace detail

// Throws kvq::Error unless `s` can quantize rows of length d.
inline void check_spec(const QuantSpec& s, int d) {
  if (!(s.bits == 1 || s.bits == 2 || s.bits == 4 || s.bits == 8))
    throw Error(StatusCode::unsupported, "calib: bits must be 1, 2, 4 or 8 (got " +
                                             std::to_string(s.bits) + ")");
  if (s.group <= 0 || d <= 0 || d % s.group != 0)
    throw Error(StatusCode::invalid_argument, "calib: group " + std::to_string(s.group) +
                                                  " does not divide head_dim " + std::to_string(d));
  if (s.clip_permille < 1 || s.clip_permille > 1000)
    throw Error(StatusCode::invalid_argument, "calib: clip_permille must be in [1, 1000]");
}

// The clip threshold t of one finite group (the ⌊cG⌋-th smallest |x|, DESIGN §2), or +∞
// when the spec does not clip this group. Elements with x > t or x < −t are clipped.
// The value kth_smallest_abs returns, bit for bit, selected in O(G) on the keys
// |bits(x)| (the IEEE pattern with the sign cleared orders |x|; ±0 share the key 0):
// the m + 1 largest keys by insertion when m = G − 1 − rank is small (OptR's clips: 2 of
// 32 keys, 6 of 64 values), nth_element otherwise. A key 0 means the rank-k element is a
// zero, and kth_smallest_abs's index tie-break picks the rank-th zero in index order,
// whose sign it keeps.
//   x : [s.group] fp32, s.group in [1, 256]
inline float clip_threshold(const QuantSpec& s, const float* x) {
  const int G = s.group;
  const int rank = clip_rank(G, s.clip_permille);
  if (!s.clips() || rank >= G - 1) return std::numeric_limits<float>::infinity();
  const int m = G - 1 - rank;  // elements strictly above the threshold's rank
  std::uint32_t key;
  if (m < 16) {
    // top[0..m] descending: the m + 1 largest keys seen, zeros standing in for the unseen
    // (every key is ≥ 0, and G ≥ m + 1 keys are inserted).
    std::uint32_t top[16] = {};
    for (int i = 0; i < G; ++i) {
      const std::uint32_t k = float_bits(x[i]) & 0x7fffffffu;
      if (k <= top[m]) continue;
      int j = m;
      for (; j > 0 && top[j - 1] < k; --j) top[j] = top[j - 1];
      top[j] = k;
    }
    key = top[m];
  } else {
    std::uint32_t keys[256];
    for (int i = 0; i < G; ++i) keys[i] = float_bits(x[i]) & 0x7fffffffu;
    std::nth_element(keys, keys + rank, keys + G);
    key = keys[rank];
  }
  if (key != 0) return bits_float(key);
  for (int i = 0, zeros = 0; i < G; ++i)
    if (x[i] == 0.f && zeros++ == rank) return x[i];
  return 0.f;  // unreachable: key 0 means more than `rank` zeros
}

// Quantizes then dequantizes one group: out[i] = x̂_i. `threshold`, if given, receives the
// clip threshold used (+∞ when nothing is clipped or the group is non-finite).
//   x, out : [s.group] fp32 (may alias)
inline void fake_quant_group(const QuantSpec& s, const float* x, float* out, float* threshold = nullptr) {
  const int G = s.group;
  if (G <= 0 || G > 256) throw Error(StatusCode::invalid_argument, "calib: group must be in [1, 256]");
  const int levels = (1 << s.bits) - 1;
  bool finite = true;
  for (int i = 0; i < G; ++i) finite = finite && is_finite_f(x[i]);
  if (threshold) *threshold = std::numeric_limits<float>::infinity();
  if (!finite) {
    const float nan = detail::meta_roundtrip(s.meta, bits_float(0x7fc00000u));
    for (int i = 0; i < G; ++i) out[i] = dequantize_value(0u, nan, nan);  // DESIGN §2: non-finite groups dequantize to NaN
    return;
  }
  const float t = clip_threshold(s, x);
  if (threshold) *threshold = t;
  auto clipped = [&](int i) { return x[i] > t ? t : (x[i] < -t ? -t : x[i]); };
  float lo = clipped(0), hi = lo;
  for (int i = 1; i < G; ++i) {
    const float v = clipped(i);
    lo = fmin_f(lo, v);
    hi = fmax_f(hi, v);
  }
  const float scale = div_rn(fmax_f(sub_rn(hi, lo), 1e-8f), static_cast<float>(levels));
  const float s_st = detail::meta_roundtrip(s.meta, scale);
  const float lo_st = detail::meta_roundtrip(s.meta, lo);
  if (s_st == 0.f) {
    for (int i = 0; i < G; ++i) out[i] = dequantize_value(0u, s_st, lo_st);
    return;
  }
  const float inv = div_rn(1.f, s_st);
  // Codes first (clipped() reads x, which may alias out).
  unsigned codes[256];
  for (int i = 0; i < G; ++i) codes[i] = quantize_value(clipped(i), lo_st, inv, levels);
  for (int i = 0; i < G; ++i) out[i] = dequantize_value(codes[i], s_st, lo_st);
}

// Fake-quantizes one row of length d (d/group groups).
//   x, out : [d] fp32 (may alias)
inline void fake_quant_row(const QuantSpec& s, const float* x, float* out, int d) {
  if (s.group > 256 || s.group <= 0 || d % s.group != 0)
    throw Error(StatusCode::invalid_argument, "calib: group must divide d and be <= 256");
  for (int g = 0; g < d / s.group; ++g) fake_quant_group(s, x + g * s.group, out + g * s.group);
}

}  // namespace kvq::calib
