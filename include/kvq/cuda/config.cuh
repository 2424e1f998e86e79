// kvq/cuda/config.cuh — CUDA-side configuration: runtime header and the error check
// that turns a cudaError_t into a kvq::Status (launchers never throw or abort).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "kvq/core/config.hpp"
#include "kvq/core/status.hpp"

namespace kvq::cuda {

inline Status cuda_status(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  return {StatusCode::cuda_error, std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")"};
}

// Number of CUDA devices, 0 when there is no driver or no device (never an error).
inline int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the non-sticky error
    return 0;
  }
  return n;
}

}  // namespace kvq::cuda

// Returns a cuda_error Status from the enclosing function when `expr` fails.
#define KVQ_CUDA_CHECK(expr)                                                   \
  do {                                                                         \
    const cudaError_t kvq_cuda_err_ = (expr);                                  \
    if (kvq_cuda_err_ != cudaSuccess) return ::kvq::cuda::cuda_status(kvq_cuda_err_, #expr); \
  } while (0)

#define KVQ_FULL_MASK 0xffffffffu
