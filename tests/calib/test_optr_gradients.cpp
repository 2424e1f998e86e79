// STE gradients of both OptR phases against central finite differences of the frozen
// surrogate of DESIGN §6.3 (clip mask and threshold, the groups' extreme elements and the
// rounding residuals δ fixed at the base point), for both shipped parameterizations; and
// the estimator itself on single groups with a clipped element, ties at the minimum and
// maximum, and a constant group.
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
  const QuantSte frozen = ph.freeze(Rb);
  MatD dR;
  ph.loss(Rb, &dR);  // STE gradient at the base point
  const MatD gA = generator_gradient(R0, A0, dR);
  auto f = [&](const MatD& A) { return ph.loss(rotation_from_generator(R0, A), nullptr, &frozen); };
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

TEST(OptRGradients, KPhaseExpMapMatchesFrozenSurrogateFD) {
  Fixture F;
  const KPhase kp(F.hd, F.mu, F.kspec, F.cfg);
  const MatD R0 = hadamard_rotation(16);
  const MatD A0 = random_matrix(16, 0.05, 1);  // away from 0: exercises the block exponential
  const auto [dir, coord] = fd_errors(kp, R0, A0);
  std::printf("K phase exp_map: directional rel err %.2e, coordinate rel err %.2e\n", dir, coord);
  EXPECT_LT(dir, 1e-4);
  EXPECT_LT(coord, 1e-4);
}

TEST(OptRGradients, VPhaseExpMapMatchesFrozenSurrogateFD) {
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

// The per-token term (cfg.v_token): its gradient against FD, and Jensen's inequality per
// query, Σ_t p̃_t·‖ΔV_t·Wᵀ‖² ≥ ‖Σ_t p̃_t·ΔV_t·Wᵀ‖², so the term alone is at least the §6.3 loss.
TEST(OptRGradients, VPhasePerTokenTermMatchesFDAndBoundsTheOutputError) {
  Fixture F;
  const KPhase kp(F.hd, F.mu, F.kspec, F.cfg);
  const MatD RK = rotation_from_generator(hadamard_rotation(16), random_matrix(16, 0.05, 2));
  const MatD R0 = hadamard_rotation(16);
  const VPhase v0(F.hd, F.nu, F.vspec, F.cfg, kp, RK);
  F.cfg.v_token = 1.0;
  const VPhase v1(F.hd, F.nu, F.vspec, F.cfg, kp, RK);
  F.cfg.v_token = 3.0;
  const VPhase v3(F.hd, F.nu, F.vspec, F.cfg, kp, RK);
  const double l0 = v0.loss(R0), l1 = v1.loss(R0), l3 = v3.loss(R0);
  std::printf("V phase at R0: output term %.4e, per-token term %.4e\n", l0, l1 - l0);
  EXPECT_GT(l1 - l0, 1.5 * l0);                       // no cancellation across tokens
  EXPECT_NEAR(l3 - l0, 3.0 * (l1 - l0), 1e-9 * l3);  // linear in γ
  const auto [dir, coord] = fd_errors(v1, R0, random_matrix(16, 0.05, 3));
  std::printf("V phase with per-token term: directional rel err %.2e, coordinate rel err %.2e\n", dir, coord);
  EXPECT_LT(dir, 1e-4);
  EXPECT_LT(coord, 1e-4);
}

// The unweighted per-token term (cfg.v_uniform): its gradient against FD, linear in γ_u,
// and independent of the attention (the key rotation does not move it).
TEST(OptRGradients, VPhaseUniformTokenTermMatchesFDAndIgnoresAttention) {
  Fixture F;
  const KPhase kp(F.hd, F.mu, F.kspec, F.cfg);
  const MatD RK = rotation_from_generator(hadamard_rotation(16), random_matrix(16, 0.05, 2));
  const MatD RK2 = rotation_from_generator(hadamard_rotation(16), random_matrix(16, 0.3, 7));
  const MatD R0 = hadamard_rotation(16);
  const VPhase v0(F.hd, F.nu, F.vspec, F.cfg, kp, RK), v0b(F.hd, F.nu, F.vspec, F.cfg, kp, RK2);
  F.cfg.v_uniform = 1.0;
  const VPhase v1(F.hd, F.nu, F.vspec, F.cfg, kp, RK), v1b(F.hd, F.nu, F.vspec, F.cfg, kp, RK2);
  F.cfg.v_uniform = 3.0;
  const VPhase v3(F.hd, F.nu, F.vspec, F.cfg, kp, RK);
  const double l0 = v0.loss(R0), l1 = v1.loss(R0), l3 = v3.loss(R0);
  std::printf("V phase at R0: output term %.4e, uniform per-token term %.4e\n", l0, l1 - l0);
  EXPECT_GT(l1 - l0, 1.5 * l0);                       // a token's error alone is not averaged down
  EXPECT_NEAR(l3 - l0, 3.0 * (l1 - l0), 1e-9 * l3);  // linear in γ_u
  EXPECT_NE(v0.loss(R0), v0b.loss(R0));               // the output term depends on the attention…
  EXPECT_NEAR(v1b.loss(R0) - v0b.loss(R0), l1 - l0, 1e-12 * l1);  // …the uniform term does not
  const auto [dir, coord] = fd_errors(v1, R0, random_matrix(16, 0.05, 3));
  std::printf("V phase with uniform per-token term: directional rel err %.2e, coordinate rel err %.2e\n", dir, coord);
  EXPECT_LT(dir, 1e-4);
  EXPECT_LT(coord, 1e-4);
}

// Riemannian parameterization: the gradient is taken at the current point R (A = 0).
TEST(OptRGradients, RiemannianMatchesFrozenSurrogateFD) {
  Fixture F;
  const KPhase kp(F.hd, F.mu, F.kspec, F.cfg);
  const MatD Rcur = rotation_from_generator(hadamard_rotation(16), random_matrix(16, 0.2, 4));
  const auto [kdir, kcoord] = fd_errors(kp, Rcur, MatD::Zero(16, 16));
  const VPhase vp(F.hd, F.nu, F.vspec, F.cfg, kp, Rcur);
  const auto [vdir, vcoord] = fd_errors(vp, Rcur, MatD::Zero(16, 16));
  std::printf("riemannian: K %.2e / %.2e, V %.2e / %.2e\n", kdir, kcoord, vdir, vcoord);
  EXPECT_LT(std::max({kdir, kcoord, vdir, vcoord}), 1e-4);
}

// The per-key term (cfg.k_token): its gradient against FD, positive and linear in γ.
TEST(OptRGradients, KPhasePerKeyTermMatchesFD) {
  Fixture F;
  const MatD R0 = hadamard_rotation(16);
  const KPhase k0(F.hd, F.mu, F.kspec, F.cfg);
  F.cfg.k_token = 1.0;
  const KPhase k1(F.hd, F.mu, F.kspec, F.cfg);
  F.cfg.k_token = 3.0;
  const KPhase k3(F.hd, F.mu, F.kspec, F.cfg);
  const double l0 = k0.loss(R0), l1 = k1.loss(R0), l3 = k3.loss(R0);
  std::printf("K phase at R0: §6.3 loss %.4e, per-key term %.4e\n", l0, l1 - l0);
  EXPECT_GT(l1 - l0, 1e-3 * l0);
  EXPECT_NEAR(l3 - l0, 3.0 * (l1 - l0), 1e-9 * l3);
  const auto [dir, coord] = fd_errors(k1, R0, random_matrix(16, 0.05, 6));
  std::printf("K phase with per-key term: directional rel err %.2e, coordinate rel err %.2e\n", dir, coord);
  EXPECT_LT(dir, 1e-4);
  EXPECT_LT(coord, 1e-4);
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

namespace {

// One row of 16 elements = one 2-bit group, the identity rotation, and L = Σ C⊙X̂.
struct GroupCase {
  kvq::QuantSpec spec{2, 16, kvq::Rotation::dense, false, 1000, kvq::MetaType::fp16, 0};
  MatD Y = MatD(1, 16);
  MatD C = random_matrix(16, 1.0, 77).topRows(1);
  void fill(unsigned seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<double> U(-1, 1);
    for (int i = 0; i < 16; ++i) Y(0, i) = U(rng);
  }
  // The estimator's ∂L/∂Y; checks on the way that its surrogate reproduces the quantizer
  // at Y and is what backward() differentiates (central FD, coordinate by coordinate).
  MatD grad() const {
    const RotatedQuant rq = RotatedQuant::forward(Y, MatD::Identity(16, 16), spec);
    const MatD at_y = RotatedQuant::surrogate(Y, rq.ste);
    EXPECT_LT((at_y - rq.Xhat).cwiseAbs().maxCoeff(), 1e-12) << "surrogate ≠ quantizer at the base point";
    const MatD g = RotatedQuant::backward(C, rq.ste);
    for (int i = 0; i < 16; ++i) {
      MatD Yp = Y, Ym = Y;
      Yp(0, i) += 1e-6;
      Ym(0, i) -= 1e-6;
      const double fd = ((C.array() * (RotatedQuant::surrogate(Yp, rq.ste) - RotatedQuant::surrogate(Ym, rq.ste)).array())
                             .sum()) / 2e-6;
      EXPECT_NEAR(fd, g(0, i), 1e-6 * (1 + std::abs(fd))) << "element " << i;
    }
    return g;
  }
};

TEST(OptRGradients, EstimatorPassesInteriorElementsAndReachesTheExtremesThroughTheScale) {
  GroupCase c;
  c.fill(1);
  const MatD g = c.grad();
  Eigen::Index imax, imin;
  c.Y.row(0).maxCoeff(&imax);
  c.Y.row(0).minCoeff(&imin);
  for (int i = 0; i < 16; ++i)
    if (i != imax && i != imin) {
      EXPECT_DOUBLE_EQ(g(0, i), c.C(0, i)) << "interior element " << i << " passes straight";
    }
  // Σ over the group of ∂/∂y is C summed: the scale's terms cancel between hi and lo.
  EXPECT_NEAR(g.sum(), c.C.sum(), 1e-12);
  EXPECT_GT(std::abs(g(0, imax) - c.C(0, imax)), 1e-6) << "the maximum gets a gradient through the scale";
}

TEST(OptRGradients, EstimatorGivesAClippedElementNoGradient) {
  GroupCase c;
  c.spec.clip_permille = 920;  // rank 14 of 16: the largest |y| is clipped
  c.fill(2);
  c.Y(0, 5) = 4.0;  // the outlier, clipped to t
  const MatD g = c.grad();
  EXPECT_EQ(g(0, 5), 0.0);
  // The maximum is now the pinned t: it is frozen, so the positive extreme carries no
  // range gradient; the minimum still does.
  Eigen::Index imin;
  c.Y.row(0).minCoeff(&imin);
  EXPECT_GT(std::abs(g(0, imin) - c.C(0, imin)), 1e-6);
}

TEST(OptRGradients, EstimatorSplitsTiesAtTheExtremes) {
  GroupCase c;
  c.fill(3);
  c.Y(0, 2) = c.Y(0, 9) = 1.5;    // tie at the maximum
  c.Y(0, 4) = c.Y(0, 11) = -1.5;  // tie at the minimum
  const MatD g = c.grad();
  const double tie_share = (g(0, 2) - c.C(0, 2)) + (g(0, 9) - c.C(0, 9));
  EXPECT_NEAR(g(0, 2) - c.C(0, 2), g(0, 9) - c.C(0, 9), 1e-12) << "ties share evenly";
  EXPECT_GT(std::abs(tie_share), 1e-6);
  EXPECT_NEAR(g(0, 4) - c.C(0, 4), g(0, 11) - c.C(0, 11), 1e-12);
}

TEST(OptRGradients, EstimatorIsTheIdentityOnAConstantGroup) {
  GroupCase c;
  c.Y.setConstant(0.25);
  const MatD g = c.grad();
  for (int i = 0; i < 16; ++i) EXPECT_DOUBLE_EQ(g(0, i), c.C(0, i));
}

}  // namespace
