#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <vector>

#include "common/test_utils.hpp"
#include "kvq/rotation/hadamard.hpp"

namespace {

// x·D·H/√d with the explicit Sylvester matrix H[i][j] = (−1)^popcount(i & j), in fp64.
std::vector<double> explicit_hadamard(const std::vector<float>& x, std::uint32_t seed) {
  const int d = static_cast<int>(x.size());
  std::vector<double> y(d, 0.0);
  for (int j = 0; j < d; ++j)
    for (int i = 0; i < d; ++i)
      y[j] += double(x[i]) * kvq::hadamard_sign(seed, i) * (std::popcount(unsigned(i & j)) % 2 ? -1.0 : 1.0);
  for (auto& v : y) v /= std::sqrt(double(d));
  return y;
}

template <int D>
void check_against_sylvester(std::uint32_t seed) {
  for (int rep = 0; rep < 10; ++rep) {
    auto x = kvq::test::random_normal(D, 31 * rep + D, 1.f + rep);
    const auto want = explicit_hadamard(x, seed);
    auto y = x;
    kvq::hadamard_forward<D>(y.data(), seed);
    EXPECT_LT(kvq::test::rel_l2(y, want), 1e-6) << "D " << D;
    // Orthogonal: the norm is preserved; the inverse restores the input.
    double nx = 0, ny = 0;
    for (int i = 0; i < D; ++i) nx += double(x[i]) * x[i], ny += double(y[i]) * y[i];
    EXPECT_NEAR(ny / nx, 1.0, 1e-6);
    kvq::hadamard_inverse<D>(y.data(), seed);
    EXPECT_LT(kvq::test::rel_l2(y, x), 1e-6);
  }
}

TEST(Hadamard, EqualsExplicitSylvesterMatrix) {
  check_against_sylvester<16>(0);
  check_against_sylvester<64>(0);
  check_against_sylvester<128>(0);
  check_against_sylvester<256>(0);
}

TEST(Hadamard, SeededSignsEqualDiagonalThenSylvester) {
  check_against_sylvester<64>(12345);
  check_against_sylvester<128>(7);
  int negatives = 0;
  for (int i = 0; i < 128; ++i) negatives += kvq::hadamard_sign(7, i) < 0;
  EXPECT_GT(negatives, 40);  // the diagonal is a real mix of signs
  EXPECT_LT(negatives, 88);
}

TEST(Hadamard, NormalizationConstant) {
  EXPECT_EQ(kvq::inv_sqrt_pow2(64), 0.125f);
  EXPECT_EQ(kvq::inv_sqrt_pow2(256), 0.0625f);
  EXPECT_EQ(kvq::inv_sqrt_pow2(128), static_cast<float>(1.0 / std::sqrt(128.0)));
}

TEST(Hadamard, GoldenVectors) {
  for (const auto& v : kvq::test::spec_vectors()["fwht"]) {
    auto x = v["x"].get<std::vector<float>>();
    const auto want = v["fwht"].get<std::vector<double>>();
    switch (x.size()) {
      case 64: kvq::hadamard_forward<64>(x.data()); break;
      case 128: kvq::hadamard_forward<128>(x.data()); break;
      case 256: kvq::hadamard_forward<256>(x.data()); break;
      default: FAIL() << "unexpected size " << x.size();
    }
    EXPECT_LT(kvq::test::rel_l2(x, want), 1e-6);
  }
}

}  // namespace
