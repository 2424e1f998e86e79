// Rows for the group quantizer's bit-exactness tests (tests/cpu/test_quantize.cpp
// against the SIMD append path, tests/cuda/test_emulated.cpp against the warp
// quantizer): random normals at several scales and adversarial patterns — NaN/Inf,
// constant groups, signed zeros, fp16 saturation, ranges below the metadata's
// resolution, ties at the clip rank, values on the code formula's rounding boundary.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kvq/core/quantizer.hpp"

namespace kvq::test {

// A group quantizer spec without rotation or centering, for the quantizer tests.
constexpr QuantSpec spec(int bits, int group, MetaType meta = MetaType::fp16, int clip = 1000) {
  return QuantSpec{bits, group, Rotation::none, false, clip, meta, 0};
}

// Rows of D floats: random normals at several scales, then adversarial patterns.
template <int D>
std::vector<std::vector<float>> test_rows(std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<float>> rows;
  for (float scale : {1.f, 1e-3f, 300.f, 1e6f}) {
    std::normal_distribution<float> n(0.f, scale);
    for (int k = 0; k < 8; ++k) {
      std::vector<float> r(D);
      for (auto& x : r) x = n(rng);
      rows.push_back(r);
    }
  }
  std::vector<float> r(D, 0.f);
  rows.push_back(r);                                        // all +0
  for (int i = 0; i < D; i += 3) r[i] = -0.f;
  rows.push_back(r);                                        // ±0 mixed: the zero extremum's sign
  for (int i = 0; i < D; ++i) r[i] = i % 5 == 0 ? -0.f : float(i % 7) * 0.25f;
  rows.push_back(r);                                        // min is a signed zero
  for (int i = 0; i < D; ++i) r[i] = -float(i % 7) * 0.25f;
  for (int i = 0; i < D; i += 6) r[i] = (i % 12 == 0) ? 0.f : -0.f;
  rows.push_back(r);                                        // max is a signed zero
  std::fill(r.begin(), r.end(), 3.25f);
  rows.push_back(r);                                        // constant
  for (int i = 0; i < D; ++i) r[i] = 1.f + float(i % 3) * 1e-9f;
  rows.push_back(r);                                        // range below fp16's resolution
  for (int i = 0; i < D; ++i) r[i] = (i % 2 ? 1.f : -1.f) * 7e4f * float(1 + i % 3);
  rows.push_back(r);                                        // beyond fp16: saturating metadata
  for (int i = 0; i < D; ++i) r[i] = 3e38f * (1.f - float(i % 3) * 0.01f);
  rows.push_back(r);                                        // finite, but sums overflow
  for (float sign : {1.f, -1.f}) {
    for (int i = 0; i < D; ++i) r[i] = sign * (1e6f + float(i % 3) * 0.0625f);
    rows.push_back(r);                                      // lo beyond fp16, small range
  }
  for (int i = 0; i < D; ++i) r[i] = i % 2 ? 3e38f : 1e30f;
  rows.push_back(r);                                        // codes far beyond 2^31 before the clamp
  std::fill(r.begin(), r.end(), 1e30f + 1e24f);
  rows.push_back(r);                                        // constant, lo rounded by bf16 metadata
  for (int i = 0; i < D; ++i) r[i] = float(i) * 1e-40f;
  rows.push_back(r);                                        // denormals
  for (int special : {0, 1, 2}) {
    std::normal_distribution<float> n;
    for (auto& x : r) x = n(rng);
    const float inf = std::numeric_limits<float>::infinity();
    const float v = special == 0 ? std::nanf("") : (special == 1 ? inf : -inf);
    r[5] = v;
    r[D - 1] = v;
    rows.push_back(r);                                      // non-finite groups next to finite ones
  }
  return rows;
}

// Rows on the rounding boundary of the code formula ⌊(x − lo)·inv + 0.5⌋: every group
// holds 0 (its min, so lo = 0), a random max, and values x just below s/2 for which the
// separately rounded product x·inv, plus 0.5, gives code 1 while a fused multiply-add
// gives 0 (x·inv rounds up to 0.5 − 2⁻²⁵, whose sum with 0.5 ties to even at 1). A SIMD
// path that let the compiler fuse its multiply and add (GCC contracts intrinsics too)
// writes other codes than the scalar reference here. `found` counts such values. Not every
// max has such values near s/2, so a group draws maxima until one does (the draws are
// sequenced: as two arguments of one call, GCC and clang made them in opposite orders,
// and clang's rows for 2-bit groups of 128 had no boundary value at all).
template <kvq::QuantSpec S, int D>
std::vector<std::vector<float>> rounding_boundary_rows(std::uint32_t seed, int& found) {
  using Meta = kvq::MetaTraits<S.meta>;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(1.f, 2.f);
  found = 0;
  std::vector<std::vector<float>> rows(4, std::vector<float>(D));
  for (auto& row : rows)
    for (int g = 0; g < D / S.group; ++g) {
      float* x = row.data() + g * S.group;
      for (int attempt = 0; attempt < 64; ++attempt) {
        const float m = mantissa(rng);
        const float hi = std::ldexp(m, int(rng() % 16) - 8);
        const float s = Meta::decode(Meta::encode(kvq::div_rn(hi, float(S.levels()))));
        const float inv = kvq::div_rn(1.f, s);
        float v = kvq::mul_rn(0.5f, s), boundary = v;
        for (int step = 0; step < 16; ++step) v = std::nextafter(v, 0.f);
        bool hit = false;
        for (int step = 0; step < 32 && !hit; ++step, v = std::nextafter(v, hi))
          hit = std::floor(kvq::add_rn(kvq::mul_rn(v, inv), 0.5f)) == 1.f && std::floor(std::fma(v, inv, 0.5f)) == 0.f;
        if (hit) boundary = std::nextafter(v, 0.f);  // the loop stepped past it
        x[0] = 0.f;
        x[1] = hi;
        for (int i = 2; i < S.group; ++i) x[i] = boundary;
        if (hit) {
          found += S.group - 2;
          break;
        }
      }
    }
  return rows;
}

// Every row above that concerns the spec S: test_rows, subnormal-scale rows (fp16
// metadata), clip-rank ties (clipping specs) and rounding-boundary rows; `boundary_values`
// counts the values on the rounding boundary.
template <kvq::QuantSpec S, int D>
std::vector<std::vector<float>> quantizer_rows(int& boundary_values) {
  auto rows = test_rows<D>(S.bits * 1000 + S.group);
  if constexpr (S.meta == kvq::MetaType::fp16)
    for (float m : {1.3f, 1.45f, 1.49f}) {
      // s = m·2⁻²⁴ is stored as the subnormal 2⁻²⁴, so the group's max gives
      // ⌊m·levels + ½⌋ > levels before the clamp (the byte clamp of the SIMD path).
      std::vector<float> r(D);
      for (int i = 0; i < D; ++i) r[i] = i % 2 ? m * std::ldexp(1.f, -24) * float(S.levels()) : 0.f;
      rows.push_back(r);
    }
  if constexpr (S.clips()) {
    // The clip threshold's rank lands on ties: many equal |x| of both signs, or zeros of
    // both signs (the rank-k zero's sign is the threshold's) beside larger or denormal
    // values.
    std::vector<float> r(D);
    for (int i = 0; i < D; ++i) r[i] = (i % 2 ? 1.f : -1.f) * float(1 + i % 4) * 0.375f;
    rows.push_back(r);
    for (int zeros_per_16 : {15, 14, 12, 8}) {
      for (int i = 0; i < D; ++i) r[i] = i % 16 < zeros_per_16 ? (i % 3 ? 0.f : -0.f) : -2.5f * float(1 + i % 5);
      rows.push_back(r);
      for (int i = 0; i < D; ++i) r[i] = i % 16 < zeros_per_16 ? (i % 3 ? -0.f : 0.f) : 1e-40f * float(1 + i % 5);
      rows.push_back(r);  // the values beyond the zeros are denormals
    }
  }
  for (auto& row : rounding_boundary_rows<S, D>(S.bits * 7 + S.group, boundary_values)) rows.push_back(row);
  return rows;
}

}  // namespace kvq::test
