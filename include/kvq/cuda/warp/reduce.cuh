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
__device__ __forceinline__ float fmax_nan(float a, float b) { return a != a || b != b ? a + b : fmaxf(a, b); }

// fmax_nan over groups of `Width` consecutive lanes (Width a power of two ≤ 32).
template <int Width = 32>
__device__ __forceinline__ float max_nan(float x) {
#pragma unroll
  for (int off = Width / 2; off > 0; off >>= 1) x = fmax_nan(x, __shfl_xor_sync(KVQ_FULL_MASK, x, off));
  return x;
}

}  // namespace kvq::cuda::warp
