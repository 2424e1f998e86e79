// kvq/attention/softmax.hpp — the LSE merge of attention parts (merge_weights,
// merge_states) and its float helpers (DESIGN §4).
//
// Every attention part returns (o, lse) with lse = ln Σ_t exp(τ·q·k_t) in the ORIGINAL
// (un-centered) logit domain. Two parts over disjoint key sets merge exactly:
//   lse = ln(e^lse₁ + e^lse₂),  o = (e^lse₁·o₁ + e^lse₂·o₂) / e^lse
// A part with no visible key has lse = −∞ and o = 0 and is the identity of the merge.
#pragma once

#include <limits>

#include "kvq/core/config.hpp"

#if !KVQ_DEVICE_CODE
#include <cmath>
#endif

namespace kvq {

// __builtin_huge_valf: usable in device code without nvcc's --expt-relaxed-constexpr
// (std::numeric_limits<float>::infinity() is a constexpr __host__ function).
KVQ_HOST_DEVICE float neg_inf_f() { return -__builtin_huge_valf(); }

KVQ_HOST_DEVICE float exp_f(float x) {
#if KVQ_DEVICE_CODE
  return expf(x);
#else
  return std::exp(x);
#endif
}
KVQ_HOST_DEVICE float log_f(float x) {
#if KVQ_DEVICE_CODE
  return logf(x);
#else
  return std::log(x);
#endif
}

// Merge weights of two parts: w₁ = e^(lse₁−lse), w₂ = e^(lse₂−lse). Returns lse.
KVQ_HOST_DEVICE float merge_weights(float lse1, float lse2, float& w1, float& w2) {
  const float m = lse1 > lse2 ? lse1 : lse2;
  if (m == neg_inf_f()) {
    w1 = w2 = 0.f;
    return neg_inf_f();
  }
  const float e1 = exp_f(lse1 - m), e2 = exp_f(lse2 - m);
  const float sum = e1 + e2;
  w1 = e1 / sum;
  w2 = e2 / sum;
  return m + log_f(sum);
}

// Batched merge. o1, o2, out: [rows, n]; lse1, lse2, lse_out: [rows]. out may alias o1.
inline void merge_states(const float* o1, const float* lse1, const float* o2, const float* lse2,
                         int rows, int n, float* out, float* lse_out) {
  for (int r = 0; r < rows; ++r) {
    float w1, w2;
    const float lse = merge_weights(lse1[r], lse2[r], w1, w2);
    for (int i = 0; i < n; ++i) out[std::size_t(r) * n + i] = w1 * o1[std::size_t(r) * n + i] + w2 * o2[std::size_t(r) * n + i];
    lse_out[r] = lse;
  }
}

}  // namespace kvq
