// kvq/cuda/warp/mma.cuh — one warp-wide tensor-core product, mma.sync m16n8k16 with fp16
// or bf16 operands and fp32 accumulation (sm_80+), and the fragment movers around it:
// operand packing, movmatrix (accumulator → operand) and ldmatrix (shared → operand).
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), g = lane / 4,
// t = lane % 4; each 32-bit register holds two 16-bit elements, the lower column/row first:
//   A [16 × 16] row-major: a[0] = A(g, 2t..2t+1)    a[1] = A(g+8, 2t..2t+1)
//                          a[2] = A(g, 2t+8..2t+9)  a[3] = A(g+8, 2t+8..2t+9)
//   B [16 × 8]  (k × n):   b[0] = B(2t..2t+1, g)    b[1] = B(2t+8..2t+9, g)
//   C [16 × 8]  fp32:      c[0..1] = C(g, 2t..2t+1) c[2..3] = C(g+8, 2t..2t+1)
// An 8 × 8 16-bit matrix (movmatrix, ldmatrix): lane holds M(g, 2t..2t+1).
// The host SIMT emulator (tests/cuda/emulator) supplies kvq_emu_mma_16816 with the same
// semantics; movmatrix and ldmatrix have portable shuffle versions, so the kernels that
// use this run on machines without a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kvq/core/numeric.hpp"
#include "kvq/cuda/config.cuh"

namespace kvq::cuda::warp {

// c += A·B for one m16n8k16 tile; Op = half_t or bfloat16_t (the operands' type).
template <class Op = half_t>
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  static_assert(std::is_same_v<Op, half_t> || std::is_same_v<Op, bfloat16_t>, "kvq: mma operands are fp16 or bf16");
#if defined(KVQ_CUDA_HOST_EMULATION)
  kvq_emu_mma_16816(c, a, b, std::is_same_v<Op, bfloat16_t>);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::is_same_v<Op, half_t>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // below sm_80: never launched there (launch.cuh's plan_for_device)
#else
  (void)c, (void)a, (void)b;
#endif
}

// x → the 16-bit pattern of Op, round to nearest even.
template <class Op>
__device__ __forceinline__ unsigned op_bits(float x) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<Op, half_t>) return __half_as_ushort(__float2half_rn(x));
  else return __bfloat16_as_ushort(__float2bfloat16_rn(x));
#else
  if constexpr (std::is_same_v<Op, half_t>) return float_to_half_bits(x);
  else return float_to_bf16_bits(x);
#endif
}
template <class Op>
__device__ __forceinline__ float op_value(unsigned bits) {
  if constexpr (std::is_same_v<Op, half_t>) return half_bits_to_float(static_cast<std::uint16_t>(bits));
  else return __uint_as_float(bits << 16);
}

__device__ __forceinline__ unsigned half_bits(float x) { return op_bits<half_t>(x); }

// (x0, x1) as an Op pair, x0 in the low half.
template <class Op>
__device__ __forceinline__ unsigned pack2(float x0, float x1) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<Op, half_t>) {
    const __half2 h = __floats2half2_rn(x0, x1);
    return *reinterpret_cast<const unsigned*>(&h);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
    return *reinterpret_cast<const unsigned*>(&h);
  }
#else
  return op_bits<Op>(x0) | (op_bits<Op>(x1) << 16);
#endif
}

// (x0, x1) as Splits Op pairs whose sum carries x: Splits = 1 rounds once (unit
// roundoff 2⁻¹¹ for fp16, 2⁻⁸ for bf16); each further part adds the rounding error of
// the parts before it (fp16 hi + lo ≈ 2⁻²² relative, bf16 hi + mid + lo ≈ 2⁻²⁴).
template <class Op, int Splits>
__device__ __forceinline__ void split_pack2(float x0, float x1, unsigned (&out)[Splits]) {
#pragma unroll
  for (int s = 0; s < Splits; ++s) {
    out[s] = pack2<Op>(x0, x1);
    if (s + 1 < Splits) {
      x0 -= op_value<Op>(out[s] & 0xffffu);
      x1 -= op_value<Op>(out[s] >> 16);
    }
  }
}

// __byte_perm (PRMT): byte k of the result is byte s[4k+3 : 4k] of the 8 bytes {y, x}.
__device__ __forceinline__ unsigned byte_perm(unsigned x, unsigned y, unsigned s) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, y, s);
#else
  const unsigned long long v = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  for (int k = 0; k < 4; ++k) r |= static_cast<unsigned>((v >> (8 * ((s >> (4 * k)) & 7))) & 0xffu) << (8 * k);
  return r;
#endif
}

// The transpose of an 8 × 8 16-bit matrix held in fragment layout (movmatrix.trans,
// sm_75+): returns Mᵀ(g, 2t..2t+1) = (M(2t, g), M(2t+1, g)).
__device__ __forceinline__ unsigned transpose_8x8(unsigned m) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750 && !defined(KVQ_CUDA_HOST_EMULATION)
  unsigned r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(m));
  return r;
#else
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const unsigned r0 = __shfl_sync(KVQ_FULL_MASK, m, 8 * t + g / 2);      // row 2t
  const unsigned r1 = __shfl_sync(KVQ_FULL_MASK, m, 8 * t + 4 + g / 2);  // row 2t + 1
  return byte_perm(r0, r1, (g & 1) ? 0x7632u : 0x5410u);
#endif
}

// Four 8 × 8 16-bit matrices from shared memory (ldmatrix.x4, sm_75+): lane l gives the
// address of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned); r[i] is matrix i in
// fragment layout, or its transpose with Trans.
template <bool Trans>
__device__ __forceinline__ void load_matrix_x4(const void* row, unsigned (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750 && !defined(KVQ_CUDA_HOST_EMULATION)
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(row));
  if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
  }
#else
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const unsigned long long p = reinterpret_cast<unsigned long long>(row);
  auto at = [&](int src) { return reinterpret_cast<const unsigned char*>(__shfl_sync(KVQ_FULL_MASK, p, src)); };
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (Trans) {  // (M(2t, g), M(2t + 1, g))
      const unsigned char* r0 = at(8 * i + 2 * t);
      const unsigned char* r1 = at(8 * i + 2 * t + 1);
      r[i] = *reinterpret_cast<const unsigned short*>(r0 + 2 * g) |
             (static_cast<unsigned>(*reinterpret_cast<const unsigned short*>(r1 + 2 * g)) << 16);
    } else {
      r[i] = *reinterpret_cast<const unsigned*>(at(8 * i + g) + 4 * t);
    }
  }
#endif
}

}  // namespace kvq::cuda::warp
