#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "common/orthogonal.hpp"
#include "common/test_utils.hpp"
#include "kvq/rotation/transform.hpp"

namespace {

// Transformed keys u = (k − μ)·R and query q' = q·R give logits q'·u = q·k − q·μ:
// the softmax is unchanged and lse(q'·u) + q·μ = lse(q·k). Checked in fp64 on the
// fp32-transformed rows, for Hadamard and dense rotations.
template <kvq::Policy P>
void check_centering_invariance(const kvq::RotationParams& r, int heads) {
  constexpr int D = P.head_dim;
  const int L = 50;
  const auto k = kvq::test::random_normal(std::size_t(L) * heads * D, 21, 1.f, 3.f);  // keys share a large offset
  const auto q = kvq::test::random_normal(std::size_t(heads) * D, 22);
  for (int h = 0; h < heads; ++h) {
    float qt[D], scratch[D];
    for (int i = 0; i < D; ++i) qt[i] = q[h * D + i];
    const float shift = kvq::transform_query<P>(qt, h, r, scratch);
    std::vector<double> a(L), b(L);
    double ma = -1e300, mb = -1e300;
    for (int t = 0; t < L; ++t) {
      float u[D];
      for (int i = 0; i < D; ++i) u[i] = k[(t * heads + h) * D + i];
      double dot = 0;
      for (int i = 0; i < D; ++i) dot += double(q[h * D + i]) * u[i];
      kvq::transform_key<P>(u, h, r, scratch);
      double dotc = 0;
      for (int i = 0; i < D; ++i) dotc += double(qt[i]) * u[i];
      a[t] = dot;
      b[t] = dotc;
      ma = std::max(ma, a[t]);
      mb = std::max(mb, b[t]);
    }
    double la = 0, lb = 0;
    for (int t = 0; t < L; ++t) la += std::exp(a[t] - ma), lb += std::exp(b[t] - mb);
    for (int t = 0; t < L; ++t)
      EXPECT_NEAR(std::exp(a[t] - ma) / la, std::exp(b[t] - mb) / lb, 2e-6) << "softmax changed, token " << t;
    EXPECT_NEAR(ma + std::log(la), mb + std::log(lb) + shift, 1e-4 * (1 + std::abs(ma)));
  }
}

TEST(Centering, LeavesSoftmaxUnchangedAndShiftRestoresLse) {
  constexpr int heads = 3;
  const auto mean = kvq::test::random_normal(std::size_t(heads) * 128, 23, 1.f, 3.f);
  const auto rot = kvq::test::random_orthogonal(heads, 128, 24);
  kvq::RotationParams hp{mean.data(), nullptr, nullptr, nullptr};
  check_centering_invariance<kvq::presets::K4V2_HC>(hp, heads);
  kvq::RotationParams dp{mean.data(), rot.data(), nullptr, rot.data()};
  check_centering_invariance<kvq::presets::K2V2_R>(dp, heads);
}

TEST(Centering, ValueCenteringRoundTrips) {
  constexpr kvq::Policy P = [] {
    kvq::Policy p = kvq::presets::K4V4_H;
    p.value.centered = true;
    p.value.sign_seed = 99;
    return p;
  }();
  const auto nu = kvq::test::random_normal(2 * 128, 30);
  kvq::RotationParams r{nullptr, nullptr, nu.data(), nullptr};
  auto v = kvq::test::random_normal(128, 31);
  auto w = v;
  float scratch[128];
  kvq::transform_value<P>(w.data() + 0, 1, r, scratch);
  kvq::untransform_output<P>(w.data(), 1, r, scratch);
  EXPECT_LT(kvq::test::rel_l2(w, v), 1e-6);
}

TEST(RotationParams, MissingParametersAreReported) {
  EXPECT_EQ(kvq::validate_rotation_params<kvq::presets::K4V2_HC>({}).code(), kvq::StatusCode::invalid_argument);
  EXPECT_TRUE(kvq::validate_rotation_params<kvq::presets::K4V2_H>({}).ok());
  const float m[1] = {0};
  const auto s = kvq::validate_rotation_params<kvq::presets::K2V2_R>({m, nullptr, nullptr, nullptr});
  EXPECT_NE(s.message().find("key_rotation"), std::string::npos);
}

}  // namespace
