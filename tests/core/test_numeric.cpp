#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>

#include "kvq/core/numeric.hpp"

namespace {

// g++'s _Float16 (soft-float RNE conversion) is an independent reference.
std::uint16_t ref_half_bits(float f) { return std::bit_cast<std::uint16_t>(static_cast<_Float16>(f)); }

TEST(Numeric, HalfRoundTripsEveryBitPattern) {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const float f = kvq::half_bits_to_float(h);
    const float ref = static_cast<float>(std::bit_cast<_Float16>(h));
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(f)) << "bits " << b;
      EXPECT_TRUE(std::isnan(kvq::half_bits_to_float(kvq::float_to_half_bits(f))));
      continue;
    }
    ASSERT_EQ(f, ref) << "bits " << b;
    ASSERT_EQ(kvq::float_to_half_bits(f), h) << "bits " << b;
  }
}

TEST(Numeric, FloatToHalfMatchesReferenceRNE) {
  std::mt19937 gen(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 2'000'000; ++i) {
    // Bias towards the half range (exponents 100..150) plus uniform bit patterns.
    std::uint32_t u = bits(gen);
    if (i % 2) u = (u & 0x807fffffu) | ((100u + u % 51u) << 23);
    const float f = std::bit_cast<float>(u);
    if (std::isnan(f)) continue;
    ASSERT_EQ(kvq::float_to_half_bits(f), ref_half_bits(f)) << std::hexfloat << f;
  }
  // Ties: exactly halfway between two halves rounds to even.
  EXPECT_EQ(kvq::float_to_half_bits(1.f + 0x1p-11f), 0x3c00u);
  EXPECT_EQ(kvq::float_to_half_bits(1.f + 3 * 0x1p-11f), 0x3c02u);
  EXPECT_EQ(kvq::float_to_half_bits(0x1p-25f), 0x0000u);
  EXPECT_EQ(kvq::float_to_half_bits(0x1.8p-25f), 0x0001u);
}

TEST(Numeric, HalfSaturationIsOptIn) {
  EXPECT_EQ(kvq::float_to_half_bits(1e6f), 0x7c00u);
  EXPECT_EQ(kvq::float_to_half_bits(1e6f, true), 0x7bffu);
  EXPECT_EQ(kvq::float_to_half_bits(-1e6f, true), 0xfbffu);
  EXPECT_EQ(kvq::float_to_half_bits(65519.f, true), 0x7bffu);
  EXPECT_EQ(kvq::float_to_half_bits(65520.f), 0x7c00u);  // rounds up to Inf without saturation
  EXPECT_EQ(kvq::float_to_half_bits(std::numeric_limits<float>::infinity(), true), 0x7c00u);  // Inf stays Inf
  EXPECT_TRUE(std::isnan(kvq::half_bits_to_float(kvq::float_to_half_bits(NAN, true))));
}

TEST(Numeric, Bfloat16RoundsToNearestEven) {
  std::mt19937 gen(11);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 1'000'000; ++i) {
    const float f = std::bit_cast<float>(bits(gen));
    if (std::isnan(f)) continue;
    // Reference: pick the nearer of the two bf16 neighbours in double, ties to even.
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) == 0x7f800000u) continue;
    const std::uint32_t down = u & 0xffff0000u, up = down + 0x10000u;
    // The neighbour past FLT_MAX is Inf; for rounding it sits at 2^128.
    const double upv = (up & 0x7fffffffu) == 0x7f800000u ? std::copysign(0x1p128, double(f))
                                                          : double(std::bit_cast<float>(up));
    const double dd = std::abs(double(f) - double(std::bit_cast<float>(down)));
    const double du = std::abs(upv - double(f));
    const std::uint16_t want =
        static_cast<std::uint16_t>((dd < du || (dd == du && ((down >> 16) & 1) == 0)) ? down >> 16 : up >> 16);
    ASSERT_EQ(kvq::float_to_bf16_bits(f), want) << std::hexfloat << f;
  }
  EXPECT_EQ(kvq::float_to_bf16_bits(3.4e38f, true), 0x7f7fu);
  EXPECT_EQ(kvq::float_to_bf16_bits(-3.4e38f, true), 0xff7fu);
  EXPECT_TRUE(std::isnan(kvq::bf16_bits_to_float(kvq::float_to_bf16_bits(NAN))));
}

TEST(Numeric, ActivationConversions) {
  EXPECT_EQ(kvq::to_float(kvq::half_t(1.5f)), 1.5f);
  EXPECT_EQ(kvq::to_float(kvq::bfloat16_t(-2.f)), -2.f);
  EXPECT_EQ(kvq::from_float<kvq::half_t>(0.1f).bits, 0x2e66u);
  EXPECT_EQ(kvq::saturate_f32(std::numeric_limits<float>::infinity()), std::numeric_limits<float>::max());
}

}  // namespace
