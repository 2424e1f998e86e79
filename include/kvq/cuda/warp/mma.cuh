// kvq/cuda/warp/mma.cuh — one warp-wide tensor-core product, mma.sync m16n8k16 with fp16
// operands and fp32 accumulation (sm_80+), and the fp16 packing helpers around it.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), g = lane / 4,
// t = lane % 4; each 32-bit register holds two fp16, the lower column/row first:
//   A [16 × 16] row-major: a[0] = A(g, 2t..2t+1)    a[1] = A(g+8, 2t..2t+1)
//                          a[2] = A(g, 2t+8..2t+9)  a[3] = A(g+8, 2t+8..2t+9)
//   B [16 × 8]  (k × n):   b[0] = B(2t..2t+1, g)    b[1] = B(2t+8..2t+9, g)
//   C [16 × 8]  fp32:      c[0..1] = C(g, 2t..2t+1) c[2..3] = C(g+8, 2t..2t+1)
// The host SIMT emulator (tests/cuda/emulator) supplies kvq_emu_mma_16816 with the same
// semantics, so the kernels that use this run on machines without a GPU.
#pragma once

#include <cuda_fp16.h>

#include "kvq/cuda/config.cuh"

namespace kvq::cuda::warp {

// c += A·B for one m16n8k16 tile.
__device__ __forceinline__ void mma_16816(float (&c)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
#if defined(KVQ_CUDA_HOST_EMULATION)
  kvq_emu_mma_16816(c, a, b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#elif defined(__CUDA_ARCH__)
  __trap();  // the launchers never select the tensor-core kernel below sm_80
#else
  (void)c, (void)a, (void)b;
#endif
}

__device__ __forceinline__ unsigned half_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }

// Two small unsigned integers (codes, < 1024) as an exact fp16 pair: 0x6400 | c is the
// fp16 value 1024 + c, and subtracting 1024 is exact.
__device__ __forceinline__ unsigned codes_to_half2(unsigned c0, unsigned c1) {
#if defined(__CUDA_ARCH__)
  const unsigned biased = 0x64006400u | c0 | (c1 << 16);
  const __half2 r = __hsub2(*reinterpret_cast<const __half2*>(&biased), __halves2half2(__ushort_as_half(0x6400),
                                                                                      __ushort_as_half(0x6400)));
  return *reinterpret_cast<const unsigned*>(&r);
#else
  return half_bits(static_cast<float>(c0)) | (half_bits(static_cast<float>(c1)) << 16);
#endif
}

// x0, x1 → fp16 pairs hi + lo with x ≈ hi + lo to about 2⁻²² relative: a product with
// exact fp16 codes then keeps fp32-like accuracy at twice the tensor-core work.
__device__ __forceinline__ void split_half2(float x0, float x1, unsigned& hi, unsigned& lo) {
  const __half h0 = __float2half_rn(x0), h1 = __float2half_rn(x1);
  hi = __half_as_ushort(h0) | (static_cast<unsigned>(__half_as_ushort(h1)) << 16);
  lo = half_bits(x0 - __half2float(h0)) | (half_bits(x1 - __half2float(h1)) << 16);
}

}  // namespace kvq::cuda::warp
