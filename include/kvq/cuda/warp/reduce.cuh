// kvq/cuda/warp/reduce.cuh — warp-level butterfly reductions (every lane gets the result).
#pragma once

#include "kvq/cuda/config.cuh"

namespace kvq::cuda::warp {

// Sum over groups of `Width` consecutive lanes (Width a power of two ≤ 32).
template <int Width = 32>
__device__ __forceinline__ float sum(float x) {
#pragma unroll
  for (int off = Width / 2; off > 0; off >>= 1) x += __shfl_xor_sync(KVQ_FULL_MASK, x, off);
  return x;
}

// Max over the warp; NaN inputs are ignored as fmaxf does (scales and magnitudes, not
// logits: see max_nan).
__device__ __forceinline__ float max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(KVQ_FULL_MASK, x, off));
  return x;
}

// max(a, b) that is NaN when either is (fmaxf returns the other operand). The softmax
// maxima use it: a visible NaN logit must poison its row as on the CPU, also when it is
// the only visible logit of its tile, where fmaxf would leave −∞ and the row would read
// as empty.
// One instruction on sm_80+ (max.NaN), three otherwise.
__device__ __forceinline__ float fmax_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(KVQ_CUDA_HOST_EMULATION)
  float r;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a != a || b != b ? a + b : fmaxf(a, b);
#endif
}

// 2^x for softmax weights, x ≤ 0 (or NaN): one MUFU.EX2. Results below 2^-126 flush to
// zero, where exp2f spends three more instructions on the subnormal range; such a weight
// is below fp32's resolution of the row sum, which holds a weight of 1.
__device__ __forceinline__ float exp2_weight(float x) {
#if defined(__CUDA_ARCH__) && !defined(KVQ_CUDA_HOST_EMULATION)
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
#else
  return exp2f(x);
#endif
}

// Max of unsigned values over the warp: one REDUX on sm_80+. Non-negative floats (not
// NaN) order like their bit patterns, so it also takes the max of such floats.
__device__ __forceinline__ unsigned max_u32(unsigned x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !defined(KVQ_CUDA_HOST_EMULATION)
  return __reduce_max_sync(KVQ_FULL_MASK, x);
#else
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const unsigned y = __shfl_xor_sync(KVQ_FULL_MASK, x, off);
    x = y > x ? y : x;
  }
  return x;
#endif
}

// 2^e as a float, for −126 ≤ e ≤ 127 (normal range): built from the exponent bits, where
// ldexpf spends a dozen instructions on the general case.
__device__ __forceinline__ float pow2(int e) { return __int_as_float((e + 127) << 23); }

// fmax_nan over groups of `Width` consecutive lanes (Width a power of two ≤ 32).
template <int Width = 32>
__device__ __forceinline__ float max_nan(float x) {
#pragma unroll
  for (int off = Width / 2; off > 0; off >>= 1) x = fmax_nan(x, __shfl_xor_sync(KVQ_FULL_MASK, x, off));
  return x;
}

}  // namespace kvq::cuda::warp
