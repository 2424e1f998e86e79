// kvq/cuda/warp/rotate.cuh — centering and rotation of one row by one warp, bit-identical
// to the host functions of kvq/rotation/{hadamard,dense,transform}.hpp.
//
// Register layout ("row fragment"): lane l holds x[l·E .. l·E + E) with E = D/32.
// The FWHT runs the same butterfly stages in the same order as fwht_butterflies<D>
// (stride 1, 2, 4, …; strides < E inside a lane, the rest across lanes by shuffle), each
// output being add_rn(x_j, x_{j+h}) or sub_rn(x_j, x_{j+h}) exactly as on the host; the
// 1/√D factor and the seeded signs are applied with mul_rn in the host's order. Dense
// rotations compute each output by the host's ascending, unfused sum. No result bit
// depends on the lane count or on contraction.
#pragma once

#include "kvq/core/numeric.hpp"
#include "kvq/core/policy.hpp"
#include "kvq/cuda/config.cuh"
#include "kvq/rotation/dense.hpp"
#include "kvq/rotation/hadamard.hpp"
#include "kvq/rotation/transform.hpp"

namespace kvq::cuda::warp {

template <int D>
inline constexpr int kRowFrag = D / 32;  // elements per lane

__device__ __forceinline__ int lane_id() { return static_cast<int>(threadIdx.x & 31u); }

// x ← row (D elements of T), converted to fp32 exactly as kvq::to_float does.
template <int D, ActivationType T>
__device__ __forceinline__ void load_row(const T* row, float (&x)[kRowFrag<D>]) {
  constexpr int E = kRowFrag<D>;
  const int base = lane_id() * E;
#pragma unroll
  for (int k = 0; k < E; ++k) x[k] = to_float(row[base + k]);
}

template <int D, ActivationType T>
__device__ __forceinline__ void store_row(T* row, const float (&x)[kRowFrag<D>]) {
  constexpr int E = kRowFrag<D>;
  const int base = lane_id() * E;
#pragma unroll
  for (int k = 0; k < E; ++k) row[base + k] = from_float<T>(x[k]);
}

// Writes the fragment to a [D] fp32 shared row (followed by __syncwarp).
template <int D>
__device__ __forceinline__ void to_shared(float* s, const float (&x)[kRowFrag<D>]) {
  constexpr int E = kRowFrag<D>;
#pragma unroll
  for (int k = 0; k < E; ++k) s[lane_id() * E + k] = x[k];
  __syncwarp();
}

// Unnormalized FWHT butterflies, same stage order and operands as kvq::fwht_butterflies.
template <int D>
__device__ __forceinline__ void fwht_butterflies(float (&x)[kRowFrag<D>]) {
  constexpr int E = kRowFrag<D>;
  static_assert(D >= 64 && (D & (D - 1)) == 0, "kvq: warp FWHT needs D = 64, 128 or 256");
#pragma unroll
  for (int h = 1; h < E; h <<= 1) {
#pragma unroll
    for (int i = 0; i < E; i += 2 * h) {
#pragma unroll
      for (int j = i; j < i + h; ++j) {
        const float a = x[j], b = x[j + h];
        x[j] = add_rn(a, b);
        x[j + h] = sub_rn(a, b);
      }
    }
  }
  const int lane = lane_id();
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {  // stride h = m·E: partner lane l ^ m, same slot
    const bool upper = (lane & m) != 0;
#pragma unroll
    for (int k = 0; k < E; ++k) {
      const float other = __shfl_xor_sync(KVQ_FULL_MASK, x[k], m);
      x[k] = upper ? sub_rn(other, x[k]) : add_rn(x[k], other);
    }
  }
}

template <int D>
__device__ __forceinline__ void hadamard_forward(float (&x)[kRowFrag<D>], std::uint32_t seed) {
  constexpr int E = kRowFrag<D>;
  if (seed != 0) {
#pragma unroll
    for (int k = 0; k < E; ++k) x[k] = mul_rn(x[k], hadamard_sign(seed, lane_id() * E + k));
  }
  fwht_butterflies<D>(x);
  constexpr float kNorm = inv_sqrt_pow2(D);
#pragma unroll
  for (int k = 0; k < E; ++k) x[k] = mul_rn(x[k], kNorm);
}

template <int D>
__device__ __forceinline__ void hadamard_inverse(float (&x)[kRowFrag<D>], std::uint32_t seed) {
  constexpr int E = kRowFrag<D>;
  fwht_butterflies<D>(x);
  constexpr float kNorm = inv_sqrt_pow2(D);
#pragma unroll
  for (int k = 0; k < E; ++k) x[k] = mul_rn(x[k], kNorm);
  if (seed != 0) {
#pragma unroll
    for (int k = 0; k < E; ++k) x[k] = mul_rn(x[k], hadamard_sign(seed, lane_id() * E + k));
  }
}

// x ← x·R (R row-major [D, D]); `scratch` is a [D] fp32 shared row owned by this warp.
template <int D>
__device__ __forceinline__ void dense_forward(float (&x)[kRowFrag<D>], const float* __restrict__ r, float* scratch) {
  constexpr int E = kRowFrag<D>;
  to_shared<D>(scratch, x);
  const int j0 = lane_id() * E;
  float acc[E];
#pragma unroll
  for (int k = 0; k < E; ++k) acc[k] = 0.f;
  for (int i = 0; i < D; ++i) {
    const float xi = scratch[i];
#pragma unroll
    for (int k = 0; k < E; ++k) acc[k] = add_rn(acc[k], mul_rn(xi, __ldg(r + i * D + j0 + k)));
  }
  __syncwarp();
#pragma unroll
  for (int k = 0; k < E; ++k) x[k] = acc[k];
}

// x ← x·Rᵀ: out_i = Σ_j x_j·R[i][j] in ascending j.
template <int D>
__device__ __forceinline__ void dense_transposed(float (&x)[kRowFrag<D>], const float* __restrict__ r, float* scratch) {
  constexpr int E = kRowFrag<D>;
  to_shared<D>(scratch, x);
  const int i0 = lane_id() * E;
  float acc[E];
#pragma unroll
  for (int k = 0; k < E; ++k) acc[k] = 0.f;
  for (int j = 0; j < D; ++j) {
    const float yj = scratch[j];
#pragma unroll
    for (int k = 0; k < E; ++k) acc[k] = add_rn(acc[k], mul_rn(yj, __ldg(r + (i0 + k) * D + j)));
  }
  __syncwarp();
#pragma unroll
  for (int k = 0; k < E; ++k) x[k] = acc[k];
}

template <QuantSpec S, int D>
__device__ __forceinline__ void rotate_forward(float (&x)[kRowFrag<D>], const float* dense_r, float* scratch) {
  if constexpr (S.rotation == Rotation::hadamard) {
    hadamard_forward<D>(x, S.sign_seed);
  } else if constexpr (S.rotation == Rotation::dense) {
    dense_forward<D>(x, dense_r, scratch);
  }
}

template <QuantSpec S, int D>
__device__ __forceinline__ void rotate_inverse(float (&x)[kRowFrag<D>], const float* dense_r, float* scratch) {
  if constexpr (S.rotation == Rotation::hadamard) {
    hadamard_inverse<D>(x, S.sign_seed);
  } else if constexpr (S.rotation == Rotation::dense) {
    dense_transposed<D>(x, dense_r, scratch);
  }
}

template <QuantSpec S, int D>
__device__ __forceinline__ const float* head_rotation(const float* r, int h) {
  return S.rotation == Rotation::dense ? r + std::size_t(h) * D * D : r;
}

template <int D>
__device__ __forceinline__ void add_mean(float (&x)[kRowFrag<D>], const float* mean) {
#pragma unroll
  for (int k = 0; k < kRowFrag<D>; ++k) x[k] = add_rn(x[k], mean[lane_id() * kRowFrag<D> + k]);
}
template <int D>
__device__ __forceinline__ void sub_mean(float (&x)[kRowFrag<D>], const float* mean) {
#pragma unroll
  for (int k = 0; k < kRowFrag<D>; ++k) x[k] = sub_rn(x[k], mean[lane_id() * kRowFrag<D> + k]);
}

// kvq::transform_key: u = (k − μ_K)·R_K.
template <Policy P>
__device__ __forceinline__ void transform_key(float (&x)[kRowFrag<P.head_dim>], int h, const RotationParams& r,
                                              float* scratch) {
  constexpr int D = P.head_dim;
  if constexpr (P.key.centered) sub_mean<D>(x, r.key_mean + std::size_t(h) * D);
  rotate_forward<P.key, D>(x, head_rotation<P.key, D>(r.key_rotation, h), scratch);
}

// kvq::transform_value: w = (v − ν_V)·R_V.
template <Policy P>
__device__ __forceinline__ void transform_value(float (&x)[kRowFrag<P.head_dim>], int h, const RotationParams& r,
                                                float* scratch) {
  constexpr int D = P.head_dim;
  if constexpr (P.value.centered) sub_mean<D>(x, r.value_mean + std::size_t(h) * D);
  rotate_forward<P.value, D>(x, head_rotation<P.value, D>(r.value_rotation, h), scratch);
}

// q' = q·R_K (no centering).
template <Policy P>
__device__ __forceinline__ void rotate_query(float (&x)[kRowFrag<P.head_dim>], int h, const RotationParams& r,
                                             float* scratch) {
  rotate_forward<P.key, P.head_dim>(x, head_rotation<P.key, P.head_dim>(r.key_rotation, h), scratch);
}

// kvq::untransform_output: o = ô·R_Vᵀ + ν_V.
template <Policy P>
__device__ __forceinline__ void untransform_output(float (&x)[kRowFrag<P.head_dim>], int h, const RotationParams& r,
                                                   float* scratch) {
  constexpr int D = P.head_dim;
  rotate_inverse<P.value, D>(x, head_rotation<P.value, D>(r.value_rotation, h), scratch);
  if constexpr (P.value.centered) add_mean<D>(x, r.value_mean + std::size_t(h) * D);
}

// Dequantized key back to the original basis: k̂ = u·R_Kᵀ + μ_K (kvq::dequantize_sequence).
template <Policy P>
__device__ __forceinline__ void untransform_key(float (&x)[kRowFrag<P.head_dim>], int h, const RotationParams& r,
                                                float* scratch) {
  constexpr int D = P.head_dim;
  rotate_inverse<P.key, D>(x, head_rotation<P.key, D>(r.key_rotation, h), scratch);
  if constexpr (P.key.centered) add_mean<D>(x, r.key_mean + std::size_t(h) * D);
}

}  // namespace kvq::cuda::warp
