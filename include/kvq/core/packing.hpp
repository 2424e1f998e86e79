// kvq/core/packing.hpp — little-endian bit packing of b-bit codes (DESIGN §2).
//
// Element i of a packed row sits at bit (i·b) mod 8 of byte ⌊i·b/8⌋, so a 32-bit
// little-endian word holds 16 consecutive 2-bit codes (element 0 in bits 0–1),
// 8 consecutive 4-bit codes, or 4 bytes. Groups of ≥ 16 elements therefore start
// on a byte boundary and (for b ≥ 2) whole 32-bit words.
#pragma once

#include "kvq/core/config.hpp"

namespace kvq {

template <int Bits>
concept SupportedBits = (Bits == 2 || Bits == 4 || Bits == 8);

// Bytes occupied by n packed codes (n·Bits must be a multiple of 8).
template <int Bits>
  requires SupportedBits<Bits>
KVQ_HOST_DEVICE constexpr int packed_bytes(int n) {
  return n * Bits / 8;
}

// Packs n codes (each < 2^Bits) into n·Bits/8 bytes. Every output byte is written
// whole, so the destination needs no initialization.
template <int Bits>
  requires SupportedBits<Bits>
KVQ_HOST_DEVICE void pack_codes(const std::uint8_t* codes, int n, std::uint8_t* out) {
  constexpr int per_byte = 8 / Bits;
  for (int byte = 0; byte < n / per_byte; ++byte) {
    unsigned v = 0;
    for (int k = 0; k < per_byte; ++k)
      v |= static_cast<unsigned>(codes[byte * per_byte + k] & ((1u << Bits) - 1u)) << (k * Bits);
    out[byte] = static_cast<std::uint8_t>(v);
  }
}

// Code i of a packed row.
template <int Bits>
  requires SupportedBits<Bits>
KVQ_HOST_DEVICE unsigned unpack_code(const std::uint8_t* packed, int i) {
  constexpr int per_byte = 8 / Bits;
  return (static_cast<unsigned>(packed[i / per_byte]) >> ((i % per_byte) * Bits)) &
         ((1u << Bits) - 1u);
}

// Unpacks n codes.
template <int Bits>
  requires SupportedBits<Bits>
KVQ_HOST_DEVICE void unpack_codes(const std::uint8_t* packed, int n, std::uint8_t* codes) {
  for (int i = 0; i < n; ++i) codes[i] = static_cast<std::uint8_t>(unpack_code<Bits>(packed, i));
}

// Code k (0 ≤ k < 32/Bits) of a little-endian 32-bit word loaded from a packed row.
template <int Bits>
  requires SupportedBits<Bits>
KVQ_HOST_DEVICE unsigned word_code(std::uint32_t word, int k) {
  return (word >> (k * Bits)) & ((1u << Bits) - 1u);
}

}  // namespace kvq
