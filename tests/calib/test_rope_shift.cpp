#include <gtest/gtest.h>

#include <cmath>
#include <complex>
#include <random>

#include "kvq/calib/rope_shift.hpp"

using namespace kvq::calib;

namespace {

// RoPE at position p of a raw row x, written with complex numbers: pair i, of frequency
// θ^(−2i/d), is multiplied by e^{i·p·ω_i}.
VecD rope_at(const VecD& x, double p, double theta, RopePairs pairs) {
  const int d = static_cast<int>(x.size()), half = d / 2;
  VecD y(d);
  for (int i = 0; i < half; ++i) {
    const int a = pairs == RopePairs::adjacent ? 2 * i : i, b = pairs == RopePairs::adjacent ? 2 * i + 1 : i + half;
    const std::complex<double> z = std::complex<double>(x[a], x[b]) * std::polar(1.0, p * std::pow(theta, -2.0 * i / d));
    y[a] = z.real();
    y[b] = z.imag();
  }
  return y;
}

// Two sequences (lengths 5 and 7) of one KV head with g = 2 query heads, post-RoPE at
// positions 0…len−1; `raw` keeps the pre-RoPE rows [12, d] of K and of each Q.
struct Captured {
  HeadData hd;
  std::vector<MatD> raw;  // K, Q0, Q1
};
Captured capture(int d, double theta, RopePairs pairs) {
  std::mt19937 rng(7);
  std::normal_distribution<double> N;
  Captured c;
  c.hd.seq_offsets = {0, 5, 12};
  c.raw.assign(3, MatD(12, d));
  for (MatD& m : c.raw)
    for (int t = 0; t < 12; ++t)
      for (int i = 0; i < d; ++i) m(t, i) = N(rng);
  c.hd.K = MatD(12, d);
  c.hd.Q.assign(2, MatD(12, d));
  for (int t = 0; t < 12; ++t) {
    const double p = t < 5 ? t : t - 5;
    c.hd.K.row(t) = rope_at(c.raw[0].row(t).transpose(), p, theta, pairs).transpose();
    for (int j = 0; j < 2; ++j) c.hd.Q[j].row(t) = rope_at(c.raw[1 + j].row(t).transpose(), p, theta, pairs).transpose();
  }
  return c;
}

// Shifted rows are the RoPE of the raw rows at positions p + Δ_s, in both pair layouts, and
// every logit within a sequence is unchanged.
TEST(RopeShift, MovesRowsToTheShiftedPositionsAndKeepsLogits) {
  for (const RopePairs pairs : {RopePairs::adjacent, RopePairs::half}) {
    const int d = 16;
    const double theta = 10000.0;
    Captured c = capture(d, theta, pairs);
    const HeadData before = c.hd;
    const std::vector<std::int64_t> delta = {3000, 77};
    apply_rope_shift(c.hd, {theta, pairs}, delta);
    double pos_err = 0, logit_err = 0, moved = 0;
    for (int t = 0; t < 12; ++t) {
      const int s = t < 5 ? 0 : 1;
      const double p = static_cast<double>((t < 5 ? t : t - 5) + delta[s]);
      pos_err = std::max(pos_err, (c.hd.K.row(t).transpose() - rope_at(c.raw[0].row(t).transpose(), p, theta, pairs))
                                      .cwiseAbs().maxCoeff());
      pos_err = std::max(pos_err, (c.hd.Q[1].row(t).transpose() - rope_at(c.raw[2].row(t).transpose(), p, theta, pairs))
                                      .cwiseAbs().maxCoeff());
      moved = std::max(moved, (c.hd.K.row(t) - before.K.row(t)).cwiseAbs().maxCoeff());
      for (int u = c.hd.seq_offsets[s]; u < c.hd.seq_offsets[s + 1]; ++u)
        for (int j = 0; j < 2; ++j)
          logit_err = std::max(logit_err, std::abs(c.hd.Q[j].row(t).dot(c.hd.K.row(u)) -
                                                   before.Q[j].row(t).dot(before.K.row(u))));
    }
    EXPECT_LT(pos_err, 1e-12);
    EXPECT_LT(logit_err, 1e-12);
    EXPECT_GT(moved, 0.1);  // the shift is not the identity
    // Δ = 0 leaves the rows bit-identical.
    Captured z = capture(d, theta, pairs);
    apply_rope_shift(z.hd, {theta, pairs}, std::vector<std::int64_t>{0, 0});
    EXPECT_EQ((z.hd.K - capture(d, theta, pairs).hd.K).cwiseAbs().maxCoeff(), 0.0);
  }
}

TEST(RopeShift, BadInputIsRejected) {
  Captured c = capture(16, 10000.0, RopePairs::adjacent);
  EXPECT_THROW(apply_rope_shift(c.hd, {0.0, RopePairs::adjacent}, std::vector<std::int64_t>{1, 2}), kvq::Error);
  EXPECT_THROW(apply_rope_shift(c.hd, {1e4, RopePairs::adjacent}, std::vector<std::int64_t>{1}), kvq::Error);
  EXPECT_THROW(rope_shift_offsets({0, 5, 12}, 6), kvq::Error);  // the second sequence does not fit
}

// Offsets are a pure function of the sequence index, inside [0, max − len], and spread.
TEST(RopeShift, OffsetsAreDeterministicAndInRange) {
  std::vector<std::int64_t> offs{0};
  for (int s = 0; s < 40; ++s) offs.push_back(offs.back() + 1 + (s * 37) % 1024);
  const auto a = rope_shift_offsets(offs, 8192), b = rope_shift_offsets(offs, 8192);
  ASSERT_EQ(a.size(), 40u);
  EXPECT_EQ(a, b);
  std::int64_t lo = 8192, hi = 0;
  for (std::size_t s = 0; s < a.size(); ++s) {
    EXPECT_GE(a[s], 0);
    EXPECT_LE(a[s] + (offs[s + 1] - offs[s]), 8192);
    lo = std::min(lo, a[s]);
    hi = std::max(hi, a[s]);
  }
  EXPECT_GT(hi - lo, 4096);  // 40 uniform draws span most of the range
  EXPECT_EQ(rope_shift_offsets({0, 512}, 512), std::vector<std::int64_t>{0});
}

}  // namespace
