// kvq/rotation/transform.hpp — centering + rotation of key, value and query rows as the
// policy prescribes (DESIGN §3): the reference that the CPU SIMD append and the CUDA warp
// functions reproduce bit for bit.
//
//   stored key   u = (k − μ_K)·R_K        query   q' = q·R_K,  logit shift τ·(q·μ_K)
//   stored value w = (v − ν_V)·R_V        output  o  = ô·R_Vᵀ + ν_V
#pragma once

#include "kvq/core/config.hpp"
#include "kvq/core/policy.hpp"
#include "kvq/rotation/dense.hpp"
#include "kvq/rotation/hadamard.hpp"
#include "kvq/rotation/params.hpp"

namespace kvq {

namespace detail {
// x ← x·R for the spec's rotation; `scratch` is [D] (dense only).
template <QuantSpec S, int D>
KVQ_HOST_DEVICE void rotate_forward(float* x, const float* dense_r, float* scratch) {
  if constexpr (S.rotation == Rotation::hadamard) {
    hadamard_forward<D>(x, S.sign_seed);
  } else if constexpr (S.rotation == Rotation::dense) {
    rotate_dense<D>(x, dense_r, scratch);
    for (int i = 0; i < D; ++i) x[i] = scratch[i];
  }
}
template <QuantSpec S, int D>
KVQ_HOST_DEVICE void rotate_inverse(float* x, const float* dense_r, float* scratch) {
  if constexpr (S.rotation == Rotation::hadamard) {
    hadamard_inverse<D>(x, S.sign_seed);
  } else if constexpr (S.rotation == Rotation::dense) {
    rotate_dense_transposed<D>(x, dense_r, scratch);
    for (int i = 0; i < D; ++i) x[i] = scratch[i];
  }
}

// Per-head slice of a [Hkv, D, D] rotation (nullptr-safe when the spec is not dense).
template <QuantSpec S, int D>
KVQ_HOST_DEVICE const float* head_rotation(const float* r, int h) {
  return r + (S.rotation == Rotation::dense ? h * D * D : 0);
}

// x ← (x − mean_h)·R_h as the spec prescribes (centering and rotation both optional).
template <QuantSpec S, int D>
KVQ_HOST_DEVICE void center_rotate(float* x, int h, const float* mean, const float* rotation, float* scratch) {
  if constexpr (S.centered)
    for (int i = 0; i < D; ++i) x[i] = sub_rn(x[i], mean[h * D + i]);
  rotate_forward<S, D>(x, head_rotation<S, D>(rotation, h), scratch);
}

// x ← x·R_hᵀ + mean_h (the inverse of center_rotate).
template <QuantSpec S, int D>
KVQ_HOST_DEVICE void unrotate_uncenter(float* x, int h, const float* mean, const float* rotation, float* scratch) {
  rotate_inverse<S, D>(x, head_rotation<S, D>(rotation, h), scratch);
  if constexpr (S.centered)
    for (int i = 0; i < D; ++i) x[i] = add_rn(x[i], mean[h * D + i]);
}
}  // namespace detail

// x [D] (raw key of KV head h) → stored-basis key u, in place. scratch: [D].
template <Policy P>
KVQ_HOST_DEVICE void transform_key(float* x, int h, const RotationParams& r, float* scratch) {
  detail::center_rotate<P.key, P.head_dim>(x, h, r.key_mean, r.key_rotation, scratch);
}

// x [D] (raw value of KV head h) → stored-basis value w, in place.
template <Policy P>
KVQ_HOST_DEVICE void transform_value(float* x, int h, const RotationParams& r, float* scratch) {
  detail::center_rotate<P.value, P.head_dim>(x, h, r.value_mean, r.value_rotation, scratch);
}

// Query row for KV head h: q ← q·R_K in place; returns q·μ_K (0 when keys are not
// centered), computed on the unrotated q in fp32 with every product rounded on its own
// (mul_rn, DESIGN §2: no contraction-dependent expression).
template <Policy P>
KVQ_HOST_DEVICE float transform_query(float* q, int h, const RotationParams& r, float* scratch) {
  constexpr int D = P.head_dim;
  float shift = 0.f;
  if constexpr (P.key.centered)
    for (int i = 0; i < D; ++i) shift = add_rn(shift, mul_rn(q[i], r.key_mean[h * D + i]));
  detail::rotate_forward<P.key, D>(q, detail::head_rotation<P.key, D>(r.key_rotation, h), scratch);
  return shift;
}

// Rotated-basis attention output ô [D] of KV head h → o = ô·R_Vᵀ + ν_V, in place.
template <Policy P>
KVQ_HOST_DEVICE void untransform_output(float* o, int h, const RotationParams& r, float* scratch) {
  detail::unrotate_uncenter<P.value, P.head_dim>(o, h, r.value_mean, r.value_rotation, scratch);
}

}  // namespace kvq
