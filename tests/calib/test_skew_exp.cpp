#include <gtest/gtest.h>

#include <random>

#include <unsupported/Eigen/MatrixFunctions>

#include "kvq/calib/skew_exp.hpp"

using kvq::calib::MatD;

namespace {

MatD random_matrix(int n, double scale, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> N(0, scale);
  MatD A(n, n);
  for (int i = 0; i < n * n; ++i) A.data()[i] = N(rng);
  return A;
}

TEST(SkewExp, ZeroGeneratorReproducesBaseExactly) {
  const MatD R0 = kvq::calib::expm(kvq::calib::skew(random_matrix(16, 0.5, 1)));
  const MatD R = kvq::calib::rotation_from_generator(R0, MatD::Zero(16, 16));
  EXPECT_EQ((R - R0).cwiseAbs().maxCoeff(), 0.0);
  EXPECT_EQ((kvq::calib::expm(MatD::Zero(8, 8)) - MatD::Identity(8, 8)).cwiseAbs().maxCoeff(), 0.0);
}

TEST(SkewExp, ExpOfSkewIsOrthogonal) {
  for (int n : {8, 64, 128}) {
    const MatD R = kvq::calib::expm(kvq::calib::skew(random_matrix(n, 1.0, n)));
    EXPECT_LT(kvq::calib::orthogonality_error(R), 1e-12) << n;
    EXPECT_NEAR(R.determinant(), 1.0, 1e-9);
  }
}

// The fixed-order Taylor exponential against Eigen's Padé approximant (an independent
// algorithm), on skew and on general matrices, small to large norms (0 to 8 squarings).
TEST(SkewExp, MatchesEigensPadeExponential) {
  for (int n : {8, 64, 128})
    for (double scale : {1e-3, 0.05, 0.3, 3.0}) {
      const MatD A = random_matrix(n, scale, 100 + n);
      for (const MatD& X : {kvq::calib::skew(A), MatD(A)}) {
        const MatD ref = X.exp();
        const double err = (kvq::calib::expm(X) - ref).cwiseAbs().maxCoeff() / ref.cwiseAbs().maxCoeff();
        EXPECT_LT(err, 1e-13) << n << " " << scale;
      }
    }
}

// The paired recurrence against the top-right block of Eigen's exponential of
// [[Sᵀ, G], [0, Sᵀ]] (the definition in DESIGN §6.3).
TEST(SkewExp, FrechetAdjointMatchesEigensBlockExponential) {
  for (int n : {8, 64})
    for (double scale : {1e-6, 0.1, 1.0}) {
      const MatD S = kvq::calib::skew(random_matrix(n, scale, 200 + n));
      const MatD G = random_matrix(n, 1.0, 201);
      MatD B = MatD::Zero(2 * n, 2 * n);
      B.topLeftCorner(n, n) = S.transpose();
      B.bottomRightCorner(n, n) = S.transpose();
      B.topRightCorner(n, n) = G;
      const MatD ref = MatD(B.exp()).topRightCorner(n, n);
      const MatD got = kvq::calib::expm_frechet_adjoint(S, G);
      EXPECT_LT((got - ref).cwiseAbs().maxCoeff() / ref.cwiseAbs().maxCoeff(), 1e-12) << n << " " << scale;
    }
}

// ⟨G, d/dt exp(S + tE)⟩ = ⟨L_exp(Sᵀ, G), E⟩, checked by central differences.
TEST(SkewExp, FrechetAdjointMatchesFiniteDifferences) {
  const int n = 12;
  const MatD S = kvq::calib::skew(random_matrix(n, 0.7, 3));
  const MatD G = random_matrix(n, 1.0, 4);
  const MatD E = random_matrix(n, 1.0, 5);
  const double h = 1e-5;
  const double fd = ((G.array() * kvq::calib::expm(S + h * E).array()).sum() -
                     (G.array() * kvq::calib::expm(S - h * E).array()).sum()) / (2 * h);
  const double an = (kvq::calib::expm_frechet_adjoint(S, G).array() * E.array()).sum();
  EXPECT_LT(std::abs(fd - an) / std::abs(an), 1e-8) << fd << " vs " << an;
}

// The diagonalization shortcut equals the block exponential of DESIGN §6.3.
TEST(SkewExp, SkewAdjointMatchesBlockExponential) {
  for (int n : {8, 64}) {
    for (double scale : {1e-9, 0.05, 1.0}) {
      const MatD S = kvq::calib::skew(random_matrix(n, scale, 10 + n));
      const MatD G = random_matrix(n, 1.0, 11);
      const MatD ref = kvq::calib::expm_frechet_adjoint(S, G);
      const MatD got = kvq::calib::expm_frechet_adjoint_skew(S, G);
      EXPECT_LT((ref - got).cwiseAbs().maxCoeff() / ref.cwiseAbs().maxCoeff(), 1e-11) << n << " " << scale;
    }
  }
  // Repeated eigenvalues (S = 0 blocks): divided differences degenerate to e^λ.
  MatD S = MatD::Zero(6, 6);
  S(0, 1) = 0.7;
  S(1, 0) = -0.7;
  const MatD G = random_matrix(6, 1.0, 12);
  EXPECT_LT((kvq::calib::expm_frechet_adjoint(S, G) - kvq::calib::expm_frechet_adjoint_skew(S, G)).cwiseAbs().maxCoeff(),
            1e-12);
}

TEST(SkewExp, GeneratorGradientMatchesFiniteDifferences) {
  const int n = 8;
  const MatD R0 = kvq::calib::expm(kvq::calib::skew(random_matrix(n, 1.0, 6)));
  const MatD A = random_matrix(n, 0.3, 7);
  const MatD T = random_matrix(n, 1.0, 8);  // L(R) = ⟨T, R⟩ + ½‖R‖²_F·0 (linear)
  auto L = [&](const MatD& a) { return (T.array() * kvq::calib::rotation_from_generator(R0, a).array()).sum(); };
  const MatD gA = kvq::calib::generator_gradient(R0, A, T);
  const double h = 1e-6;
  double max_rel = 0;
  for (int i = 0; i < n; ++i)
    for (int j = 0; j < n; ++j) {
      MatD Ap = A, Am = A;
      Ap(i, j) += h;
      Am(i, j) -= h;
      const double fd = (L(Ap) - L(Am)) / (2 * h);
      max_rel = std::max(max_rel, std::abs(fd - gA(i, j)) / std::max(1e-3, gA.cwiseAbs().maxCoeff()));
    }
  EXPECT_LT(max_rel, 1e-7);
}

}  // namespace
