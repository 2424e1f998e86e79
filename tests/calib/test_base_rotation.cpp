#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "kvq/calib/base_rotation.hpp"

using kvq::calib::MatD;
using kvq::calib::VecD;

namespace {

TEST(BaseRotation, HadamardIsOrthogonalAndSylvester) {
  for (int d : {1, 2, 16, 64, 128}) {
    const MatD H = kvq::calib::hadamard_rotation(d);
    EXPECT_LT(kvq::calib::orthogonality_error(H), 1e-14);
  }
  const MatD H4 = kvq::calib::hadamard_rotation(4) * 2.0;
  const double ref[4][4] = {{1, 1, 1, 1}, {1, -1, 1, -1}, {1, 1, -1, -1}, {1, -1, -1, 1}};
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) EXPECT_EQ(H4(i, j), ref[i][j]);
  const int signs[4] = {1, -1, 1, 1};
  const MatD HS = kvq::calib::hadamard_rotation(4, signs) * 2.0;
  EXPECT_EQ(HS(1, 0), -1.0);
  EXPECT_THROW(kvq::calib::hadamard_rotation(12), kvq::Error);
}

TEST(BaseRotation, BitReversalPermutation) {
  EXPECT_EQ(kvq::calib::bit_reverse(1, 8), 4);
  EXPECT_EQ(kvq::calib::bit_reverse(3, 8), 6);
  EXPECT_EQ(kvq::calib::bit_reverse(6, 16), 6);
  // λ descending order: index 2 (7), 0 (5), 3 (3), 1 (1), 7, 6, 5, 4 for the rest.
  VecD lam(8);
  lam << 5, 1, 7, 3, 0.1, 0.2, 0.3, 0.4;
  const std::vector<int> perm = kvq::calib::bitrev_permutation(lam);
  // order = [2,0,3,1,7,6,5,4]; bitrev(i) for i=0..7 = [0,4,2,6,1,5,3,7]
  const std::vector<int> expect = {2, 7, 3, 5, 0, 6, 1, 4};
  EXPECT_EQ(perm, expect);
  std::mt19937 rng(1);
  std::normal_distribution<double> N;
  VecD big(64);
  for (auto& x : big) x = N(rng);
  std::vector<int> p = kvq::calib::bitrev_permutation(big);
  std::sort(p.begin(), p.end());
  for (int i = 0; i < 64; ++i) EXPECT_EQ(p[i], i);  // a bijection
}

TEST(BaseRotation, CovarianceBaseMatchesDirectConstruction) {
  const int d = 8;
  std::mt19937 rng(2);
  std::normal_distribution<double> N;
  MatD X(50, d);
  for (int i = 0; i < X.size(); ++i) X.data()[i] = N(rng) * (1 + (i % d));
  const MatD C = X.transpose() * X / 50.0;
  std::vector<int> perm;
  const MatD R0 = kvq::calib::covariance_base(C, &perm);
  EXPECT_LT(kvq::calib::orthogonality_error(R0), 1e-12);
  // Direct: U·(H/√d)·P with P = I[:, perm] as an explicit matrix.
  Eigen::SelfAdjointEigenSolver<MatD> es(C);
  MatD P = MatD::Zero(d, d);
  for (int c = 0; c < d; ++c) P(perm[c], c) = 1.0;
  const MatD direct = es.eigenvectors() * kvq::calib::hadamard_rotation(d) * P;
  EXPECT_LT((R0 - direct).cwiseAbs().maxCoeff(), 1e-12);
  EXPECT_EQ(perm, kvq::calib::bitrev_permutation(es.eigenvalues()));
  // The largest eigen-direction (index d−1 of Eigen's ascending order) lands at column 0.
  EXPECT_EQ(perm[0], d - 1);
  MatD bad = C;
  bad(0, 0) = std::numeric_limits<double>::quiet_NaN();
  EXPECT_THROW(kvq::calib::covariance_base(bad), kvq::Error);
}

TEST(BaseRotation, ValueCovarianceWeightsAreMeanOne) {
  const int d = 4, L = 6;
  MatD K = MatD::Ones(L, d), V = MatD::Identity(L, d);
  const MatD CQ = MatD::Identity(d, d);
  // Equal key norms: weights are all 1, so C_V = VᵀV / L.
  const MatD CV = kvq::calib::value_covariance(K, V, CQ);
  EXPECT_LT((CV - V.transpose() * V / L).cwiseAbs().maxCoeff(), 1e-15);
}

// Random keys of unequal norms, a random SPD C_Q from query heads of several lengths:
// both covariances against plain loops in fp64 (C_Q = Σ_heads Σ_t q_t·q_tᵀ / rows;
// w_t = k_tᵀ·C_Q·k_t / mean(w), C_V = Σ_t w_t·v_t·v_tᵀ / L).
TEST(BaseRotation, CovariancesMatchPlainLoops) {
  const int d = 8, L = 23;
  std::mt19937 rng(11);
  std::normal_distribution<double> nd;
  auto random = [&](int rows, int cols, double row_scale) {
    MatD m(rows, cols);
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < cols; ++j) m(i, j) = nd(rng) * (1.0 + row_scale * i);
    return m;
  };
  const std::vector<MatD> Q = {random(5, d, 0.0), random(9, d, 0.3), random(3, d, 0.0)};
  const MatD K = random(L, d, 0.2), V = random(L, d, 0.0);
  MatD CQ = MatD::Zero(d, d);
  for (const MatD& q : Q)
    for (int t = 0; t < q.rows(); ++t)
      for (int i = 0; i < d; ++i)
        for (int j = 0; j < d; ++j) CQ(i, j) += q(t, i) * q(t, j);
  CQ /= 17.0;
  EXPECT_LT((kvq::calib::query_covariance(Q) - CQ).cwiseAbs().maxCoeff(), 1e-12);
  std::vector<double> w(L);
  double mean = 0;
  for (int t = 0; t < L; ++t) {
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) w[t] += K(t, i) * CQ(i, j) * K(t, j);
    mean += w[t] / L;
  }
  MatD CV = MatD::Zero(d, d);
  for (int t = 0; t < L; ++t)
    for (int i = 0; i < d; ++i)
      for (int j = 0; j < d; ++j) CV(i, j) += w[t] / mean * V(t, i) * V(t, j) / L;
  const MatD got = kvq::calib::value_covariance(K, V, CQ);
  EXPECT_LT((got - CV).cwiseAbs().maxCoeff(), 1e-12 * CV.cwiseAbs().maxCoeff());
  // The weights matter here: the unweighted covariance is far from it.
  EXPECT_GT((V.transpose() * V / L - CV).cwiseAbs().maxCoeff(), 0.1 * CV.cwiseAbs().maxCoeff());
}

}  // namespace
