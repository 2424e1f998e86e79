#include <gtest/gtest.h>

#include <vector>

#include "common/orthogonal.hpp"
#include "common/test_utils.hpp"
#include "kvq/rotation/dense.hpp"
#include "kvq/rotation/folding.hpp"

namespace {

TEST(DenseRotation, MatchesFp64ProductAndInverts) {
  constexpr int D = 64;
  const auto r = kvq::test::random_orthogonal(1, D, 3);
  const auto x = kvq::test::random_normal(D, 4);
  std::vector<float> y(D), back(D);
  kvq::rotate_dense<D>(x.data(), r.data(), y.data());
  std::vector<double> want(D, 0.0);
  for (int j = 0; j < D; ++j)
    for (int i = 0; i < D; ++i) want[j] += double(x[i]) * r[i * D + j];
  EXPECT_LT(kvq::test::rel_l2(y, want), 1e-6);
  kvq::rotate_dense_transposed<D>(y.data(), r.data(), back.data());
  EXPECT_LT(kvq::test::rel_l2(back, x), 1e-5);
}

TEST(Folding, ValueRotationFoldedIntoWeightsLeavesOutputUnchanged) {
  constexpr int D = 64, hkv = 2, hq = 4, dm = 48;
  const auto rv = kvq::test::random_orthogonal(hkv, D, 9);
  auto wv = kvq::test::random_normal(std::size_t(hkv) * D * dm, 10);
  auto wo = kvq::test::random_normal(std::size_t(dm) * hq * D, 11);
  const auto x = kvq::test::random_normal(dm, 12);
  const auto o = kvq::test::random_normal(std::size_t(hq) * D, 13);  // attention outputs per query head
  auto wv_f = wv, wo_f = wo;
  ASSERT_TRUE(kvq::fold_value_rotation_into_wv(wv_f.data(), hkv, D, dm, rv.data()).ok());
  ASSERT_TRUE(kvq::fold_value_rotation_into_wo(wo_f.data(), hq, hkv, D, dm, rv.data()).ok());
  // v_h·R_V == x·W_V'ᵀ for each KV head.
  for (int h = 0; h < hkv; ++h) {
    std::vector<double> v(D, 0), vr(D, 0), folded(D, 0);
    for (int j = 0; j < D; ++j)
      for (int c = 0; c < dm; ++c) {
        v[j] += double(x[c]) * wv[(h * D + j) * dm + c];
        folded[j] += double(x[c]) * wv_f[(h * D + j) * dm + c];
      }
    for (int j = 0; j < D; ++j)
      for (int i = 0; i < D; ++i) vr[j] += v[i] * rv[(h * D + i) * D + j];
    EXPECT_LT(kvq::test::rel_l2(folded, vr), 1e-5);
  }
  // y = concat(o)·W_Oᵀ == concat(o·R_V)·W_O'ᵀ.
  const int g = hq / hkv;
  std::vector<double> orot(std::size_t(hq) * D, 0);
  for (int j = 0; j < hq; ++j)
    for (int c = 0; c < D; ++c)
      for (int i = 0; i < D; ++i) orot[j * D + c] += double(o[j * D + i]) * rv[((j / g) * D + i) * D + c];
  for (int m = 0; m < dm; ++m) {
    double y = 0, yf = 0;
    for (int k = 0; k < hq * D; ++k) {
      y += double(o[k]) * wo[std::size_t(m) * hq * D + k];
      yf += orot[k] * wo_f[std::size_t(m) * hq * D + k];
    }
    EXPECT_NEAR(yf, y, 1e-4 * (1 + std::abs(y)));
  }
  EXPECT_EQ(kvq::fold_value_rotation_into_wo(wo_f.data(), 3, 2, D, dm, rv.data()).code(),
            kvq::StatusCode::invalid_argument);
}

}  // namespace
