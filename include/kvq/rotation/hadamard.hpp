// kvq/rotation/hadamard.hpp — normalized fast Walsh–Hadamard transform (DESIGN §3).
//
// x ↦ x·D·H/√d with H the Sylvester Hadamard matrix of order d (H[i][j] =
// (−1)^popcount(i & j)) and D an optional seeded ±1 diagonal. H/√d is symmetric and
// orthogonal, so the inverse is x ↦ x·H/√d·D. The butterflies run stage by stage
// (stride 1, 2, 4, …) and the 1/√d factor is applied last; a warp-parallel CUDA
// version that follows the same stage order yields identical bits.
#pragma once

#include "kvq/core/config.hpp"

namespace kvq {

// 1/√d in fp32 for d a power of two: exact power of two times √½ when log2 d is odd.
KVQ_HOST_DEVICE constexpr float inv_sqrt_pow2(int d) {
  int log2d = 0;
  while ((1 << log2d) < d) ++log2d;
  double r = (log2d % 2) ? 0.70710678118654752440 : 1.0;
  for (int i = 0; i < log2d / 2; ++i) r *= 0.5;
  return static_cast<float>(r);
}

// ±1 of the seeded sign diagonal for element i (splitmix64 of seed and index).
KVQ_HOST_DEVICE float hadamard_sign(std::uint32_t seed, int i) {
  if (seed == 0) return 1.f;
  std::uint64_t z = (static_cast<std::uint64_t>(seed) << 32) + static_cast<std::uint64_t>(i) + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (z & 1u) ? -1.f : 1.f;
}

// Unnormalized in-place butterflies over D elements (D a power of two).
template <int D>
KVQ_HOST_DEVICE void fwht_butterflies(float* x) {
  static_assert(D >= 1 && (D & (D - 1)) == 0, "kvq: FWHT needs a power-of-two length");
  for (int h = 1; h < D; h <<= 1)
    for (int i = 0; i < D; i += 2 * h)
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = add_rn(a, b);
        x[j + h] = sub_rn(a, b);
      }
}

// x ← x·D·H/√D.
template <int D>
KVQ_HOST_DEVICE void hadamard_forward(float* x, std::uint32_t sign_seed = 0) {
  if (sign_seed != 0)
    for (int i = 0; i < D; ++i) x[i] = mul_rn(x[i], hadamard_sign(sign_seed, i));
  fwht_butterflies<D>(x);
  constexpr float kNorm = inv_sqrt_pow2(D);
  for (int i = 0; i < D; ++i) x[i] = mul_rn(x[i], kNorm);
}

// x ← x·H/√D·D (the inverse of hadamard_forward).
template <int D>
KVQ_HOST_DEVICE void hadamard_inverse(float* x, std::uint32_t sign_seed = 0) {
  fwht_butterflies<D>(x);
  constexpr float kNorm = inv_sqrt_pow2(D);
  for (int i = 0; i < D; ++i) x[i] = mul_rn(x[i], kNorm);
  if (sign_seed != 0)
    for (int i = 0; i < D; ++i) x[i] = mul_rn(x[i], hadamard_sign(sign_seed, i));
}

}  // namespace kvq
