#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "kvq/core/packing.hpp"

namespace {

template <int Bits>
void exhaustive_pack_unpack() {
  constexpr int n = 64;
  constexpr unsigned levels = 1u << Bits;
  // Every code value at every position, the others set to a pattern.
  for (int pos = 0; pos < n; ++pos)
    for (unsigned value = 0; value < levels; ++value) {
      std::uint8_t codes[n], back[n];
      for (int i = 0; i < n; ++i) codes[i] = static_cast<std::uint8_t>((i * 7 + 3) % levels);
      codes[pos] = static_cast<std::uint8_t>(value);
      std::uint8_t packed[n * Bits / 8];
      std::fill(std::begin(packed), std::end(packed), 0xA5);  // poison: every byte must be overwritten
      kvq::pack_codes<Bits>(codes, n, packed);
      kvq::unpack_codes<Bits>(packed, n, back);
      for (int i = 0; i < n; ++i) ASSERT_EQ(back[i], codes[i]) << "bits " << Bits << " pos " << i;
      // DESIGN §2 bit position: element i at bit (i·b) mod 8 of byte ⌊i·b/8⌋.
      const int bit = pos * Bits;
      EXPECT_EQ((packed[bit / 8] >> (bit % 8)) & (levels - 1), value);
    }
}

TEST(Packing, ExhaustiveTwoBit) { exhaustive_pack_unpack<2>(); }
TEST(Packing, ExhaustiveFourBit) { exhaustive_pack_unpack<4>(); }
TEST(Packing, ExhaustiveEightBit) { exhaustive_pack_unpack<8>(); }

TEST(Packing, WordHoldsSixteenTwoBitCodesLittleEndian) {
  std::uint8_t codes[16];
  for (int i = 0; i < 16; ++i) codes[i] = static_cast<std::uint8_t>(i % 4);
  std::uint8_t packed[4];
  kvq::pack_codes<2>(codes, 16, packed);
  const std::uint32_t word = packed[0] | (packed[1] << 8) | (packed[2] << 16) | (std::uint32_t(packed[3]) << 24);
  for (int k = 0; k < 16; ++k) EXPECT_EQ(kvq::word_code<2>(word, k), unsigned(k % 4));
  EXPECT_EQ(packed[0], 0b11100100);
}

TEST(Packing, HighBitsOfInputCodesAreMasked) {
  std::uint8_t codes[4] = {0xFF, 0x00, 0xFE, 0x01};
  std::uint8_t packed[1];
  kvq::pack_codes<2>(codes, 4, packed);
  EXPECT_EQ(packed[0], 0b01100011);
}

}  // namespace
