// kvq/attention/reference.hpp — exact attention in fp64, the reference semantics of
// DESIGN §4 used by the tests: softmax(τ·q·Kᵀ)·V with its LSE, causal by offset.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace kvq {

// One query row against L keys of one head.
//   q [D], k [L, stride], v [L, stride] (row t of head h at k + t·stride + h·D, so
//   [L, Hkv, D] tensors are passed with stride = Hkv·D and the head offset applied)
//   visible: keys 0 .. limit (inclusive). out [D] fp64. Returns lse (−∞ if none).
template <class KT, class QT>
double exact_attention_row(const QT* q, const KT* k, const KT* v, std::size_t stride, int length, int limit,
                           int D, double tau, double* out) {
  const int n = std::min(length, limit + 1);
  for (int d = 0; d < D; ++d) out[d] = 0.0;
  if (n <= 0) return -std::numeric_limits<double>::infinity();
  std::vector<double> logit(n);
  double m = -std::numeric_limits<double>::infinity();
  for (int t = 0; t < n; ++t) {
    double s = 0;
    for (int d = 0; d < D; ++d) s += double(q[d]) * double(k[t * stride + d]);
    logit[t] = tau * s;
    m = std::max(m, logit[t]);
  }
  double l = 0;
  for (int t = 0; t < n; ++t) {
    const double w = std::exp(logit[t] - m);
    l += w;
    for (int d = 0; d < D; ++d) out[d] += w * double(v[t * stride + d]);
  }
  for (int d = 0; d < D; ++d) out[d] /= l;
  return m + std::log(l);
}

}  // namespace kvq
