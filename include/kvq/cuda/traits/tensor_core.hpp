// kvq/cuda/traits/tensor_core.hpp — which cache types the tensor-core decode kernel
// (kvq/cuda/kernel/decode_mma.cuh) serves. Plain C++: the launchers' argument structs
// expose it as kTensorCoreOk and the kernel asserts it.
#pragma once

#include <type_traits>

#include "kvq/core/numeric.hpp"
#include "kvq/core/policy.hpp"

namespace kvq::cuda {

// Quantized pages with fp16 metadata (p·scale must stay within fp16), head_dim 64 or 128.
template <Policy P>
inline constexpr bool kTensorCoreDecode =
    (P.head_dim == 64 || P.head_dim == 128) && P.key.meta == MetaType::fp16 && P.value.meta == MetaType::fp16;
// Full-precision pages of fp16 rows, head_dim 64 or 128.
template <ActivationType T, int D>
inline constexpr bool kTensorCoreDenseDecode = std::is_same_v<T, half_t> && (D == 64 || D == 128);

// Operand precision of the tensor-core kernel (the CUDA-core kernel is fp32 throughout).
//   fast  : the fp32 operands (the scaled query, p·s_v, p) are rounded to fp16 once: one
//           MMA per product, the error class of fp16 SDPA; bound in kernel/decode_mma.cuh
//   exact : each is split into fp16 hi + lo (two MMAs per product): fp32-like accuracy
// Codes and metadata enter exactly in both, and stay bit-identical to the CPU.
enum class DecodePrecision { fast, exact };

}  // namespace kvq::cuda
