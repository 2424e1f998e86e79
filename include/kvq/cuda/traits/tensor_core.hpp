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

}  // namespace kvq::cuda
