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

// A warp's NS-stage ring of cp.async tiles, the pipeline of both decode kernels. The warp
// walks its tiles t, t + step, …; `issue(stage, t_begin)` starts one tile's copies into
// stage buffer `stage` and returns the tile's mask of loaded tokens (0 past the end).
//   StageRing<NS> ring;
//   ring.start(issue, t_first, step);                    // NS − 1 tiles in flight
//   for (t0 = t_first; t0 < end; t0 += step) {
//     unsigned valid;
//     const int st = ring.next(issue, t0 + (NS - 1) * step, valid);  // tile t0 has landed
//     … read stage st …
//     __syncwarp();                                      // before its buffer is refilled
//   }
//   copy_wait<0>();
// The masks live in registers: stages are picked by comparison, never by a dynamic index.
template <int NS>
struct StageRing {
  static_assert(NS >= 2, "kvq: a stage ring needs at least two stages");
  unsigned valid[NS] = {};
  int cur = 0;

  template <class Issue>
  __device__ __forceinline__ void start(Issue&& issue, int t_first, int step) {
#pragma unroll
    for (int i = 0; i < NS - 1; ++i) {
      valid[i] = issue(i, t_first + i * step);
      copy_commit();
    }
  }

  // Refills the stage consumed last time with the tile at t_ahead, waits for the current
  // tile and returns its stage; `loaded` is its mask.
  template <class Issue>
  __device__ __forceinline__ int next(Issue&& issue, int t_ahead, unsigned& loaded) {
    const int fill = cur == 0 ? NS - 1 : cur - 1;
    const unsigned vfill = issue(fill, t_ahead);
    copy_commit();
    copy_wait<NS - 1>();
    __syncwarp();
#pragma unroll
    for (int i = 0; i < NS; ++i) {
      if (i == cur) loaded = valid[i];
      if (i == fill) valid[i] = vfill;
    }
    const int stage = cur;
    cur = cur + 1 == NS ? 0 : cur + 1;
    return stage;
  }
};

}  // namespace kvq::cuda::warp
