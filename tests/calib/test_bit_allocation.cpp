#include <gtest/gtest.h>

#include <random>
#include <sstream>

#include "kvq/calib/bit_allocation.hpp"
#include "kvq/rotation/hadamard.hpp"
#include "synthetic.hpp"

using namespace kvq::calib;

namespace {

std::vector<Candidate> candidates(int d) {
  using namespace kvq::presets;
  return {{"K2V2", K2V2.with_head_dim(d)}, {"K2V4", K2V4.with_head_dim(d)}, {"K4V2", K4V2.with_head_dim(d)},
          {"K4V4", K4V4.with_head_dim(d)}, {"K8V8", K8V8.with_head_dim(d)}};
}

TEST(BitAllocation, KnapsackMatchesBruteForce) {
  const auto cands = candidates(128);
  std::mt19937 rng(3);
  std::uniform_real_distribution<double> U(0, 1);
  for (int trial = 0; trial < 20; ++trial) {
    const int L = 4;
    std::vector<std::vector<double>> err(L, std::vector<double>(cands.size()));
    for (auto& row : err)
      for (std::size_t c = 0; c < cands.size(); ++c) row[c] = U(rng) / (1 + c);  // more bits, less error (mostly)
    const double budget = 2.5 + 3.0 * U(rng);
    const Allocation a = allocate_bits({0, 1, 2, 3}, cands, err, budget);
    double best = 1e300;
    const int C = static_cast<int>(cands.size());
    for (int code = 0; code < C * C * C * C; ++code) {
      double bits = 0, e = 0;
      for (int l = 0, x = code; l < L; ++l, x /= C) {
        bits += cands[x % C].policy.bits_per_element();
        e += err[l][x % C];
      }
      if (bits / L <= budget + 1e-12) best = std::min(best, e);
    }
    EXPECT_NEAR(a.total_error, best, 1e-12) << trial;
    EXPECT_LE(a.mean_bits, budget + 1e-12);
  }
  std::vector<std::vector<double>> err(2, std::vector<double>(cands.size(), 1.0));
  EXPECT_THROW(allocate_bits({0, 1}, cands, err, 2.0), kvq::Error);  // below K2V2's 2.625
  std::ostringstream os;
  write_allocation_csv(os, allocate_bits({0, 1}, cands, err, 3.0), cands, err);
  EXPECT_NE(os.str().find("layer,policy"), std::string::npos);
}

TEST(BitAllocation, NormReport) {
  auto a = synth::synthetic_layer(0, 2, 32, 2, 2, 64, 16, 9);
  std::vector<float> wk(128 * 96, 0.f), wv(128 * 96, 0.f);
  wk[0] = 3.f;
  wk[97] = 4.f;  // singular values 4, 3 → ‖·‖₂ = 4, ‖·‖_F = 5
  wv[5] = 1.f;
  const NormReport r = norm_report(a, wk.data(), wv.data(), 128, 96);
  EXPECT_NEAR(r.wk_spec, 4.0, 1e-9);
  EXPECT_NEAR(r.wk_fro, 5.0, 1e-9);
  EXPECT_NEAR(r.wv_spec, 1.0, 1e-9);
  EXPECT_GT(r.k_absmax, r.k_rms);
  EXPECT_TRUE(std::isnan(norm_report(a).wk_fro));
}

// W = Q1·diag(s)·Q2ᵀ with random orthogonal Q = exp(skew(G)): wide, tall and square shapes and
// clustered top singular values (the Gram route must still resolve σ_max).
TEST(BitAllocation, SpectralNormOfKnownSingularValues) {
  std::mt19937 rng(11);
  std::normal_distribution<double> N(0, 1);
  auto orthogonal = [&](int n) {
    MatD G(n, n);
    for (int i = 0; i < n * n; ++i) G.data()[i] = N(rng);
    return expm(skew(G));
  };
  for (auto [rows, cols] : {std::pair{64, 96}, std::pair{96, 64}, std::pair{48, 48}}) {
    const int k = std::min(rows, cols);
    const MatD Q1 = orthogonal(rows), Q2 = orthogonal(cols);
    VecD s(k);
    for (int i = 0; i < k; ++i) s[i] = 7.25 * (1.0 - 1e-3 * i) / (1 + 0.01 * i * i);
    const MatD W = Q1.leftCols(k) * s.asDiagonal() * Q2.leftCols(k).transpose();
    const std::vector<float> w(W.data(), W.data() + W.size());  // row-major, fp32
    // fp32 rounding moves each singular value by ≤ ‖ΔW‖₂ ≲ 1e-5.
    const auto [spec, fro] = spectral_and_frobenius(w.data(), rows, cols);
    EXPECT_NEAR(spec, 7.25, 1e-5) << rows << "x" << cols;
    EXPECT_NEAR(fro, s.norm(), 1e-5) << rows << "x" << cols;
  }
}

TEST(BitAllocation, MeasuredErrorFallsWithBits) {
  const auto a = synth::synthetic_layer(0, 2, 96, 2, 2, 64, 16, 4);
  OptRConfig cfg;
  cfg.prefix = 8;
  cfg.recent = 16;
  cfg.qwin = 16;
  const auto cands = candidates(64);
  std::vector<double> e;
  for (const auto& c : cands) e.push_back(layer_output_error(a, c.policy, cfg));
  EXPECT_GT(e[0], e[3]);  // K2V2 > K4V4
  EXPECT_GT(e[3], e[4]);  // K4V4 > K8V8
  EXPECT_GT(e[0], 0.0);
  // Hadamard helps 2-bit keys with channel outliers.
  EXPECT_LT(layer_output_error(a, kvq::presets::K2V2_H.with_head_dim(64), cfg), e[0]);
  EXPECT_THROW(layer_output_error(a, kvq::presets::K2V2_R.with_head_dim(64), cfg), kvq::Error);
}

TEST(BitAllocation, SeededHadamardMatchesRunTimeTransform) {
  const MatD H = hadamard_rotation_seeded(64, 1234);
  std::mt19937 rng(1);
  std::normal_distribution<float> N;
  float x[64];
  for (float& v : x) v = N(rng);
  Eigen::RowVectorXd xd(64);
  for (int i = 0; i < 64; ++i) xd[i] = x[i];
  const Eigen::RowVectorXd ref = xd * H;
  kvq::hadamard_forward<64>(x, 1234);
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(x[i], ref[i], 1e-5);
}

}  // namespace
