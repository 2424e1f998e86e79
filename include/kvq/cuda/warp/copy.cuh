// kvq/cuda/warp/copy.cuh — asynchronous global→shared copies (cp.async, sm_80+), with a
// synchronous fallback for older architectures so the headers compile everywhere.
#pragma once

#include <cstdint>

#include "kvq/cuda/config.cuh"

namespace kvq::cuda::warp {

// Copies Bytes (4, 8 or 16) from global `src` to shared `dst`; both aligned to Bytes.
template <int Bytes>
__device__ __forceinline__ void copy_async(void* dst, const void* src) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "kvq: cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (Bytes == 16) {
    // .cg: bypass L1, the codes are read once.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(src), "n"(Bytes));
  }
#else
  if constexpr (Bytes == 16) {
    *static_cast<uint4*>(dst) = *static_cast<const uint4*>(src);
  } else if constexpr (Bytes == 8) {
    *static_cast<uint2*>(dst) = *static_cast<const uint2*>(src);
  } else {
    *static_cast<unsigned*>(dst) = *static_cast<const unsigned*>(src);
  }
#endif
}

__device__ __forceinline__ void copy_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

// Waits until at most N committed groups of this thread are still in flight.
template <int N>
__device__ __forceinline__ void copy_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

}  // namespace kvq::cuda::warp
