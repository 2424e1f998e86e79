// kvq/cuda/kernel/grid_dependency.cuh — programmatic dependent launch (PDL, sm_90+) on
// the device side.
//
// A grid launched with PDL (the launchers' `launch_with_pdl`) may start while the grid
// before it in the stream is still running, so that its launch and block scheduling hide
// behind that grid's tail (an append, a rotation, the engine's own kernel). Every kvq
// kernel therefore calls wait_for_prior_grids() before its first global read: it returns
// once the grids this one depends on have completed and their writes are visible (at
// once when the grid was launched without PDL). allow_dependent_grids() lets the next
// grid start launching; it only moves when that grid is scheduled, never what it may read
// (which its own wait decides), so the decode kernels call it after their token loop, and
// the short row and merge kernels right after their wait.
//
// Below sm_90, and on the host emulator, both are no-ops: the launchers never ask for PDL
// there.
#pragma once

#include "kvq/cuda/config.cuh"

namespace kvq::cuda::kernel {

__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace kvq::cuda::kernel
