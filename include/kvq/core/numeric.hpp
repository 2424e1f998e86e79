// kvq/core/numeric.hpp — portable fp16 / bf16 storage types.
//
// kvq stores metadata and full-precision windows as 16-bit floats. These types are
// plain 16-bit payloads with round-to-nearest-even conversions written in integer
// arithmetic, so host and device produce identical bits without cuda_fp16.h and a
// plain g++ build needs nothing from CUDA. They are layout-compatible with __half and
// __nv_bfloat16 (2 bytes, same bit pattern), so engines can reinterpret their buffers.
#pragma once

#include <cstring>
#include <type_traits>

#include "kvq/core/config.hpp"

#if defined(__F16C__) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

namespace kvq {

KVQ_HOST_DEVICE std::uint32_t float_bits(float f) {
#if KVQ_DEVICE_CODE
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

KVQ_HOST_DEVICE float bits_float(std::uint32_t u) {
#if KVQ_DEVICE_CODE
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// fp32 -> IEEE binary16, round to nearest even. Overflow gives ±Inf unless
// `saturate`, which clamps finite inputs to ±65504 (the metadata rule of DESIGN §2).
// NaN stays a quiet NaN.
KVQ_HOST_DEVICE std::uint16_t float_to_half_bits(float f, bool saturate = false) {
  const std::uint32_t x = float_bits(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);  // NaN
  if (abs == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // Inf
  // Largest float that rounds to 65504 is just below 65520.
  if (abs >= 0x477ff000u)
    return static_cast<std::uint16_t>(sign | (saturate ? 0x7bffu : 0x7c00u));
#if defined(__F16C__) && !defined(__CUDACC__)
  // In range: the same IEEE rounding in one instruction. (Not _cvtss_sh: clang's is a
  // compound literal, which -Wpedantic reports in C++.)
  return static_cast<std::uint16_t>(_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(f), _MM_FROUND_TO_NEAREST_INT), 0));
#endif
  if (abs < 0x38800000u) {  // below 2^-14: subnormal half or zero
    if (abs < 0x33000000u) return static_cast<std::uint16_t>(sign);  // < 2^-25 rounds to 0
    const std::uint32_t exp = abs >> 23;
    const std::uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exp;  // value = mant * 2^(exp-150); half ulp = 2^-24
    std::uint32_t h = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return static_cast<std::uint16_t>(sign | h);
  }
  // Normal: rebias exponent (127 -> 15), round 13 dropped mantissa bits.
  std::uint32_t h = ((abs - 0x38000000u) >> 13);
  const std::uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into exponent: OK
  return static_cast<std::uint16_t>(sign | h);
}

KVQ_HOST_DEVICE float half_bits_to_float(std::uint16_t h) {
#if defined(__F16C__) && !defined(__CUDACC__)
  return _cvtsh_ss(h);  // the same exact widening in one instruction
#endif
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t mant = h & 0x3ffu;
  if (exp == 0x1fu) return bits_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    // Subnormal: normalize.
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400u) == 0);
    return bits_float(sign | ((112u - static_cast<std::uint32_t>(e)) << 23) | ((mant & 0x3ffu) << 13));
  }
  return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

// fp32 -> bfloat16, round to nearest even; `saturate` clamps overflow to ±max finite.
KVQ_HOST_DEVICE std::uint16_t float_to_bf16_bits(float f, bool saturate = false) {
  const std::uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x40u);  // NaN
  if ((x & 0x7fffffffu) == 0x7f800000u) return static_cast<std::uint16_t>(x >> 16);
  const std::uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
  std::uint16_t b = static_cast<std::uint16_t>(rounded >> 16);
  if (saturate && (b & 0x7fffu) == 0x7f80u) b = static_cast<std::uint16_t>((b & 0x8000u) | 0x7f7fu);
  return b;
}

KVQ_HOST_DEVICE float bf16_bits_to_float(std::uint16_t b) {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

// fp32 -> fp32 with the metadata saturation rule (only ±Inf produced by finite
// arithmetic reaches here; it becomes ±FLT_MAX).
KVQ_HOST_DEVICE float saturate_f32(float f) {
  const std::uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) == 0x7f800000u) return bits_float((x & 0x80000000u) | 0x7f7fffffu);
  return f;
}

// 16-bit IEEE half storage. Arithmetic is done in fp32.
struct half_t {
  std::uint16_t bits = 0;
  half_t() = default;
  KVQ_HOST_DEVICE explicit half_t(float f) : bits(float_to_half_bits(f)) {}
  KVQ_HOST_DEVICE static half_t from_bits(std::uint16_t b) {
    half_t h;
    h.bits = b;
    return h;
  }
  KVQ_HOST_DEVICE explicit operator float() const { return half_bits_to_float(bits); }
  KVQ_HOST_DEVICE float to_float() const { return half_bits_to_float(bits); }
};

// bfloat16 storage. Arithmetic is done in fp32.
struct bfloat16_t {
  std::uint16_t bits = 0;
  bfloat16_t() = default;
  KVQ_HOST_DEVICE explicit bfloat16_t(float f) : bits(float_to_bf16_bits(f)) {}
  KVQ_HOST_DEVICE static bfloat16_t from_bits(std::uint16_t b) {
    bfloat16_t h;
    h.bits = b;
    return h;
  }
  KVQ_HOST_DEVICE explicit operator float() const { return bf16_bits_to_float(bits); }
  KVQ_HOST_DEVICE float to_float() const { return bf16_bits_to_float(bits); }
};

static_assert(sizeof(half_t) == 2 && std::is_trivially_copyable_v<half_t>);
static_assert(sizeof(bfloat16_t) == 2 && std::is_trivially_copyable_v<bfloat16_t>);

// Element types accepted for K/V/Q rows and window storage.
template <class T>
concept ActivationType =
    std::is_same_v<T, float> || std::is_same_v<T, half_t> || std::is_same_v<T, bfloat16_t>;

template <ActivationType T>
KVQ_HOST_DEVICE float to_float(T x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return x.to_float();
  }
}

template <ActivationType T>
KVQ_HOST_DEVICE T from_float(float x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return T(x);
  }
}

}  // namespace kvq
