// STE gradients of both OptR phases against central finite differences of the
// frozen-residual surrogate f(A) = g(((X−μ)·R(A) + r)·R(A)ᵀ + μ), r = Q(X₀) − X₀
// fixed at the base point (DESIGN §6.3), for both shipped parameterizations.
#include <gtest/gtest.h>

#include <random>

#include "kvq/calib/optr.hpp"
#include "synthetic.hpp"

using namespace kvq::calib;

namespace {

struct Fixture {
  LayerActivations layer = synth::synthetic_layer(0, 2, 40, 1, 2, 16, 24, 11);
  HeadData hd = extract_head(layer, 0);
  OptRConfig cfg;
  kvq::QuantSpec kspec{2, 16, kvq::Rotation::dense, true, 960, kvq::MetaType::fp16, 0};
  kvq::QuantSpec vspec{2, 16, kvq::Rotation::dense, false, 920, kvq::MetaType::fp16, 0};
  VecD mu, nu;
  Fixture() {
    cfg.prefix = 4;
    cfg.recent = 6;
    cfg.qwin = 12;  // > recent: some queries cannot see some quantized tokens (mask matters)
    cfg.lambda = 1.0;
    mu = hd.K.colwise().mean().transpose();
    nu = hd.V.colwise().mean().transpose();
  }
};

MatD random_matrix(int n, double scale, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> N(0, scale);
  MatD A(n, n);
  for (int i = 0; i < n * n; ++i) A.data()[i] = N(rng);
  return A;
}

// Max over random directions E of |⟨∇, E⟩ − FD| / |⟨∇, E⟩|, and over all coordinates
// of |∇_ij − FD_ij| / max|∇|.
template <class Phase>
std::pair<double, double> fd_errors(const Phase& ph, const MatD& R0, const MatD& A0) {
  const int d = static_cast<int>(R0.rows());
  const MatD Rb = rotation_from_generator(R0, A0);
  const MatD r = ph.residual(Rb);
  MatD dR;
  ph.loss(Rb, &dR);  // STE gradient at the base point
  const MatD gA = generator_gradient(R0, A0, dR);
  auto f = [&](const MatD& A) { return ph.loss(rotation_from_generator(R0, A), nullptr, &r); };
  const double h = 1e-5;
  double dir_err = 0;
  for (unsigned s = 0; s < 3; ++s) {
    const MatD E = random_matrix(d, 1.0, 100 + s);
    const double fd = (f(A0 + h * E) - f(A0 - h * E)) / (2 * h);
    const double an = (gA.array() * E.array()).sum();
    dir_err = std::max(dir_err, std::abs(fd - an) / std::abs(an));
  }
  double coord_err = 0;
  const double gmax = gA.cwiseAbs().maxCoeff();
  for (int i = 0; i < d; i += 3)
    for (int j = 0; j < d; j += 2) {
      MatD Ap = A0, Am = A0;
      Ap(i, j) += h;
      Am(i, j) -= h;
      coord_err = std::max(coord_err, std::abs((f(Ap) - f(Am)) / (2 * h) - gA(i, j)) / gmax);
    }
  return {dir_err, coord_err};
}

TEST(OptRGradients, KPhaseExpMapMatchesFrozenResidualFD) {
  Fixture F;
  const KPhase kp(F.hd, F.mu, F.kspec, F.cfg);
  const MatD R0 = hadamard_rotation(16);
  const MatD A0 = random_matrix(16, 0.05, 1);  // away from 0: exercises the block exponential
  const auto [dir, coord] = fd_errors(kp, R0, A0);
  std::printf("K phase exp_map: directional rel err %.2e, coordinate rel err %.2e\n", dir, coord);
  EXPECT_LT(dir, 1e-4);
  EXPECT_LT(coord, 1e-4);
}

TEST(OptRGradients, VPhaseExpMapMatchesFrozenResidualFD) {
  Fixture F;
  const KPhase kp(F.hd, F.mu, F.kspec, F.cfg);
  const MatD RK = rotation_from_generator(hadamard_rotation(16), random_matrix(16, 0.05, 2));
  const VPhase vp(F.hd, F.nu, F.vspec, F.cfg, kp, RK);
  const MatD R0 = covariance_base(value_covariance(F.hd.K, F.hd.V, query_covariance(F.hd.Q)));
  const auto [dir, coord] = fd_errors(vp, R0, random_matrix(16, 0.05, 3));
  std::printf("V phase exp_map: directional rel err %.2e, coordinate rel err %.2e\n", dir, coord);
  EXPECT_LT(dir, 1e-4);
  EXPECT_LT(coord, 1e-4);
}

// Riemannian parameterization: the gradient is taken at the current point R (A = 0).
TEST(OptRGradients, RiemannianMatchesFrozenResidualFD) {
  Fixture F;
  const KPhase kp(F.hd, F.mu, F.kspec, F.cfg);
  const MatD Rcur = rotation_from_generator(hadamard_rotation(16), random_matrix(16, 0.2, 4));
  const auto [kdir, kcoord] = fd_errors(kp, Rcur, MatD::Zero(16, 16));
  const VPhase vp(F.hd, F.nu, F.vspec, F.cfg, kp, Rcur);
  const auto [vdir, vcoord] = fd_errors(vp, Rcur, MatD::Zero(16, 16));
  std::printf("riemannian: K %.2e / %.2e, V %.2e / %.2e\n", kdir, kcoord, vdir, vcoord);
  EXPECT_LT(std::max({kdir, kcoord, vdir, vcoord}), 1e-4);
}

// λ = 0 isolates the KL term; no centering isolates μ = 0.
TEST(OptRGradients, KPhaseKLOnlyUncentered) {
  Fixture F;
  F.cfg.lambda = 0;
  const KPhase kp(F.hd, VecD::Zero(16), F.kspec, F.cfg);
  const auto [dir, coord] = fd_errors(kp, MatD::Identity(16, 16), random_matrix(16, 0.05, 5));
  EXPECT_LT(std::max(dir, coord), 1e-4);
}

TEST(OptRGradients, ShortSequencesAreRejected) {
  Fixture F;
  F.cfg.prefix = 30;
  F.cfg.recent = 30;
  EXPECT_THROW(KPhase(F.hd, F.mu, F.kspec, F.cfg), kvq::Error);
}

}  // namespace
