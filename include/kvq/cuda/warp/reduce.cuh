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

// Max over the warp; NaN inputs are ignored as fmaxf does (a NaN logit still poisons
// its own probability, so it propagates to the output).
__device__ __forceinline__ float max(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(KVQ_FULL_MASK, x, off));
  return x;
}

}  // namespace kvq::cuda::warp
