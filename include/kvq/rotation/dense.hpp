// kvq/rotation/dense.hpp — dense per-head orthogonal rotations (DESIGN §3).
//
// R is a row-major [D, D] fp32 matrix acting on row vectors: y = x·R, y_j = Σ_i x_i R[i][j].
// The sum runs over i in ascending order with separately rounded products, so a CUDA
// thread that computes one y_j the same way produces identical bits.
#pragma once

#include "kvq/core/config.hpp"

namespace kvq {

// out[j] = Σ_i x[i]·R[i][j]  (x ↦ x·R). `out` must not alias `x`.
template <int D>
KVQ_HOST_DEVICE void rotate_dense(const float* KVQ_RESTRICT x, const float* KVQ_RESTRICT r,
                                  float* KVQ_RESTRICT out) {
  for (int j = 0; j < D; ++j) out[j] = 0.f;
  for (int i = 0; i < D; ++i) {
    const float xi = x[i];
    const float* row = r + i * D;
    for (int j = 0; j < D; ++j) out[j] = add_rn(out[j], mul_rn(xi, row[j]));
  }
}

// out[i] = Σ_j y[j]·R[i][j]  (y ↦ y·Rᵀ, the inverse for orthogonal R).
template <int D>
KVQ_HOST_DEVICE void rotate_dense_transposed(const float* KVQ_RESTRICT y, const float* KVQ_RESTRICT r,
                                             float* KVQ_RESTRICT out) {
  for (int i = 0; i < D; ++i) {
    const float* row = r + i * D;
    float acc = 0.f;
    for (int j = 0; j < D; ++j) acc = add_rn(acc, mul_rn(y[j], row[j]));
    out[i] = acc;
  }
}

}  // namespace kvq
