// kvq/core/config.hpp — the one place that decides host/device qualifiers.
//
// Scalar routines shared by host and device (packing, metadata encode/decode,
// quantize_value, clip_rank, merge_weights) are written once and marked KVQ_HOST_DEVICE.
// The CUDA FWHT and group quantizer are warp versions of the scalar ones that give the
// same bits; the CPU and CUDA decodes have their own softmax code.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVQ_HOST_DEVICE __host__ __device__ inline
#else
#define KVQ_HOST_DEVICE inline
#endif

// True while compiling device code (the device pass of nvcc).
#if defined(__CUDA_ARCH__)
#define KVQ_DEVICE_CODE 1
#else
#define KVQ_DEVICE_CODE 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define KVQ_FORCE_INLINE __attribute__((always_inline)) inline
#define KVQ_RESTRICT __restrict__
#else
#define KVQ_FORCE_INLINE inline
#define KVQ_RESTRICT
#endif

// Host code compiled by GCC or Clang (not nvcc's passes): the CPU paths may use vector
// extensions and unroll pragmas there, and plain loops elsewhere.
#if (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__)
#define KVQ_GNU_HOST 1
#if defined(__OPTIMIZE__)
#define KVQ_UNROLL _Pragma("GCC unroll 16")
#else  // unoptimized (the -O0 sanitizer build): GCC would warn that it ignores the pragma
#define KVQ_UNROLL
#endif
#else
#define KVQ_GNU_HOST 0
#define KVQ_UNROLL
#endif

#if !KVQ_DEVICE_CODE
#include <cmath>
#endif

namespace kvq {

// Floating-point helpers whose rounding never depends on the compiler's contraction
// setting. The quantizer's codes must be bit-identical on host and device, and an
// engine may compile kvq with -ffp-contract=fast (GCC's default) or nvcc --fmad=true,
// which would silently fuse a*b+c. Each product here is rounded to fp32 on its own.
#if !KVQ_DEVICE_CODE
namespace detail {
// Host: makes the compiler materialize v as computed (a rounded float or double), so no
// later add can be fused with the operation that produced it.
template <class T>
inline void materialize(T& v) {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(v));
#elif (defined(__GNUC__) || defined(__clang__)) && defined(__aarch64__)
  __asm__("" : "+w"(v));
#else
  volatile T vv = v;
  v = vv;
#endif
}
}  // namespace detail
#endif

KVQ_HOST_DEVICE float mul_rn(float a, float b) {
#if KVQ_DEVICE_CODE
  return __fmul_rn(a, b);
#else
  float p = a * b;
  detail::materialize(p);  // the rounded product: no fusion past here
  return p;
#endif
}

KVQ_HOST_DEVICE float add_rn(float a, float b) {
#if KVQ_DEVICE_CODE
  return __fadd_rn(a, b);
#else
  return a + b;  // an add alone cannot be contracted
#endif
}

KVQ_HOST_DEVICE float sub_rn(float a, float b) {
#if KVQ_DEVICE_CODE
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

KVQ_HOST_DEVICE float div_rn(float a, float b) {
#if KVQ_DEVICE_CODE
  return __fdiv_rn(a, b);  // IEEE division even under -use_fast_math
#else
  return a / b;
#endif
}

KVQ_HOST_DEVICE float floor_f(float x) {
#if KVQ_DEVICE_CODE
  return floorf(x);
#else
  return std::floor(x);
#endif
}

KVQ_HOST_DEVICE bool is_finite_f(float x) {
#if KVQ_DEVICE_CODE
  return isfinite(x);
#else
  return std::isfinite(x);
#endif
}

KVQ_HOST_DEVICE float fmax_f(float a, float b) { return a > b ? a : b; }
KVQ_HOST_DEVICE float fmin_f(float a, float b) { return a < b ? a : b; }

}  // namespace kvq
