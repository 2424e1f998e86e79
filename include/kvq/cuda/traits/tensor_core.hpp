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

// κ of the `fast` bound (kernel/decode_mma.cuh), quantized pages: in `fast` the key codes
// enter the MMA biased, 1024 + c·2^e, and each key group's accumulator starts at
// −1024·Σb. That start and the group's GK/16 MMAs each round at most 2^-23 of a partial
// sum ≤ 3·1024·Σ|b|, so a logit moves by up to κ·u·Σ_i |q'_i·s_{g(i)}| more, u = 2^-11.
template <Policy P>
inline constexpr double kFastKeyBiasKappa = 3.0 * (P.key.group / 16 + 1) * 1024 * 0x1p-23 / 0x1p-11;

}  // namespace kvq::cuda
