// kvq/cuda/traits/tensor_core.hpp — which cache types the tensor-core decode kernel
// (kvq/cuda/kernel/decode_mma.cuh) serves. Plain C++: the launchers' argument structs
// expose it as kTensorCoreOk and the kernel asserts it.
#pragma once

#include <type_traits>

#include "kvq/core/numeric.hpp"
#include "kvq/core/policy.hpp"

namespace kvq::cuda {

// Quantized pages, any metadata type and head_dim, when a lane's share of a group is at
// least 16 bits: a quarter of a key group (group·bits ≥ 64) and an eighth of a value group
// (group·bits ≥ 128). Every preset qualifies; smaller groups take the CUDA-core kernel.
template <Policy P>
inline constexpr bool kTensorCoreDecode = P.key.group * P.key.bits >= 64 && P.value.group * P.value.bits >= 128;
// Full-precision pages of fp16 or bf16 rows (fp32 pages take the CUDA-core kernel).
template <ActivationType T, int D>
inline constexpr bool kTensorCoreDenseDecode =
    (std::is_same_v<T, half_t> || std::is_same_v<T, bfloat16_t>) && (D == 64 || D == 128 || D == 256);

// Operand precision of the tensor-core kernel (the CUDA-core kernel is fp32 throughout).
//   fast  : the fp32 operands (the scaled query, p·s_v, p) are rounded to fp16 (bf16 for
//           bf16 pages) once: one MMA per product, the error class of fp16 (bf16) SDPA;
//           bound in kernel/decode_mma.cuh
//   exact : each is split into fp16 hi + lo (bf16: hi + mid + lo), two (three) MMAs per
//           product: fp32-like accuracy
// Codes and metadata enter exactly in both, and stay bit-identical to the CPU.
enum class DecodePrecision { fast, exact };

}  // namespace kvq::cuda
