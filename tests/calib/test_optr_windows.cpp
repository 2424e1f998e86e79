// OptR's windows (optr/windows.hpp): which keys each query position sees quantized. The K-
// and V-phase losses and the bit allocator's measured error are recomputed here the direct
// way, one query at a time over all of its visible tokens, with the sink exact and the
// cache's `recent` latest tokens exact as the query sees the cache (tokens appended qblock at
// a time), for query positions 1, 2 (spread) and 3 tokens apart and blocks of 1, 8 and the
// whole sequence. The products that skip what a band of queries cannot see are checked
// bit for bit against the full ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "kvq/calib/bit_allocation.hpp"
#include "kvq/calib/optr.hpp"
#include "synthetic.hpp"

using namespace kvq::calib;

namespace {

// Two 48-token sequences of one KV head with two query heads, d = 16; sink 4, recent 6.
const HeadData kHead = extract_head(synth::synthetic_layer(0, 2, 48, 1, 2, 16, 24, 21), 0);

OptRConfig windows_config(int qwin, int qstride, int qblock) {
  OptRConfig cfg;
  cfg.prefix = 4;
  cfg.recent = 6;
  cfg.qwin = qwin;
  cfg.qstride = qstride;
  cfg.qblock = qblock;
  return cfg;
}

struct Direct {
  double k_loss = 0;    // KL(p ‖ p̃) + λ/D·‖(p̃ − p)·V·W_jᵀ‖², keys quantized, values exact
  double v_loss = 0;    // ‖(p̃·(V̂ − V))·W_jᵀ‖² / D, p̃ under the quantized keys
  double out_err = 0;   // ‖(p̃·V̂ − p·V)·W_jᵀ‖² / D, keys and values quantized
  int queries = 0;
};

// Khat, Vhat: every token's quantized reconstruction   [L, d]
Direct direct_losses(const HeadData& hd, const OptRConfig& c, const MatD& Khat, const MatD& Vhat) {
  const int d = hd.head_dim(), g = static_cast<int>(hd.Q.size());
  const double tau = 1.0 / std::sqrt(static_cast<double>(d)), D = static_cast<double>(hd.W[0].rows());
  Direct r;
  for (std::size_t s = 0; s + 1 < hd.seq_offsets.size(); ++s) {
    const int b = static_cast<int>(hd.seq_offsets[s]), len = static_cast<int>(hd.seq_offsets[s + 1]) - b;
    const int stride = c.qstride > 0 ? c.qstride : std::max(1, (len - c.prefix - c.recent) / c.qwin);
    for (int pos = len - 1, n = 0; pos >= 0 && n < c.qwin; pos -= stride, ++n) {
      ++r.queries;
      int appended = 0;  // cache length after the append of pos's block
      while (appended < pos + 1) appended += c.qblock;
      appended = std::min(appended, len);
      const auto quantized = [&](int t) { return t >= c.prefix && t < appended - c.recent; };
      for (int j = 0; j < g; ++j) {
        const Eigen::RowVectorXd q = hd.Q[j].row(b + pos);
        Eigen::RowVectorXd z(pos + 1), zq(pos + 1);
        for (int t = 0; t <= pos; ++t) {
          z[t] = tau * q.dot(hd.K.row(b + t));
          zq[t] = tau * q.dot((quantized(t) ? Khat : hd.K).row(b + t));
        }
        const auto softmax = [](Eigen::RowVectorXd x) {
          x.array() -= x.maxCoeff();
          x = x.array().exp().matrix();
          return Eigen::RowVectorXd(x / x.sum());
        };
        const Eigen::RowVectorXd p = softmax(z), pq = softmax(zq);
        Eigen::RowVectorXd pv = Eigen::RowVectorXd::Zero(d), pqv = pv, pq_dv = pv, pq_vhat = pv;
        double kl = 0;
        for (int t = 0; t <= pos; ++t) {
          pv += p[t] * hd.V.row(b + t);
          pqv += pq[t] * hd.V.row(b + t);
          const Eigen::RowVectorXd vhat = (quantized(t) ? Vhat : hd.V).row(b + t);
          pq_dv += pq[t] * (vhat - hd.V.row(b + t));
          pq_vhat += pq[t] * vhat;
          if (p[t] > 0) kl += p[t] * (std::log(p[t]) - std::log(pq[t]));
        }
        const auto out_norm = [&](const Eigen::RowVectorXd& a) { return (a * hd.W[j].transpose()).squaredNorm() / D; };
        r.k_loss += kl + c.lambda * out_norm(pqv - pv);
        r.v_loss += out_norm(pq_dv);
        r.out_err += out_norm(pq_vhat - pv);
      }
    }
  }
  const double n = static_cast<double>(r.queries) * g;
  r.k_loss /= n;
  r.v_loss /= n;
  r.out_err /= n;
  return r;
}

void expect_phases_match_direct(int qstride, int qblock) {
  const HeadData& hd = kHead;
  // qwin 14: with qstride 3 the first query is position 8, which sees nothing quantized.
  const OptRConfig cfg = windows_config(14, qstride, qblock);
  const kvq::QuantSpec kspec{2, 16, kvq::Rotation::dense, true, 960, kvq::MetaType::fp16, 0};
  const kvq::QuantSpec vspec{2, 16, kvq::Rotation::dense, false, 920, kvq::MetaType::fp16, 0};
  const VecD mu = hd.K.colwise().mean().transpose(), nu = hd.V.colwise().mean().transpose();
  MatD A(16, 16);
  for (int i = 0; i < 16 * 16; ++i) A.data()[i] = 0.05 * std::sin(1.7 * i);
  const MatD RK = rotation_from_generator(hadamard_rotation(16), A), RV = hadamard_rotation(16);
  // Every token quantized the way the phases quantize their stacked rows (per row).
  const MatD Khat = RotatedQuant::forward((hd.K.rowwise() - mu.transpose()).eval(), RK, kspec).recon.rowwise() +
                    mu.transpose();
  const MatD Vhat =
      RotatedQuant::forward((hd.V.rowwise() - nu.transpose()).eval(), RV, vspec).recon.rowwise() + nu.transpose();
  const Direct ref = direct_losses(hd, cfg, Khat, Vhat);
  ASSERT_GT(ref.k_loss, 0.0);
  ASSERT_GT(ref.v_loss, 0.0);

  const KPhase kp(hd, mu, kspec, cfg);
  EXPECT_EQ(kp.query_total(), ref.queries);
  EXPECT_NEAR(kp.loss(RK), ref.k_loss, 1e-10 * ref.k_loss);
  const VPhase vp(hd, nu, vspec, cfg, kp, RK);
  EXPECT_NEAR(vp.loss(RV), ref.v_loss, 1e-10 * ref.v_loss);

  kvq::Policy policy = kvq::presets::K2V2_R.with_head_dim(16);
  policy.key = kspec;
  policy.value = vspec;
  const double err = head_output_error(hd, policy, HeadTransform{RK, RV, mu, nu}, cfg);
  EXPECT_NEAR(err, ref.out_err, 1e-10 * ref.out_err);
}

TEST(OptRWindows, PhasesMatchDirectAttentionTokenByToken) {
  expect_phases_match_direct(1, 1);
  expect_phases_match_direct(3, 1);
  expect_phases_match_direct(0, 1);  // spread: ⌊(48 − 4 − 6) / 14⌋ = 2
}

TEST(OptRWindows, PhasesMatchDirectAttentionInBlocks) {
  expect_phases_match_direct(1, 8);
  expect_phases_match_direct(3, 8);
  expect_phases_match_direct(3, 64);  // one block: every query sees [prefix, len − recent)
}

// The products restricted to what each band of queries sees (windows.hpp) give the full
// products' bits: what they skip are +0 terms, and each band's columns past its rows'
// own views are exactly the masked ones.
TEST(OptRWindows, SeenProductsHaveTheFullProductsBits) {
  int nq = 0, m = 0;
  const auto w = detail::make_windows(kHead, windows_config(20, 2, 1), &nq, &m);
  const detail::SeqWin& s = w[1];
  ASSERT_EQ(s.nq, 20);  // bands of rows [0, 8), [8, 16), [16, 20)
  const int mq = s.qe - s.qb;
  const auto bands = detail::query_bands(s);
  ASSERT_EQ(bands.size(), 3u);
  EXPECT_EQ(bands.back().cols, mq);
  EXPECT_LT(bands.front().cols, bands.back().cols);
  std::mt19937 rng(7);
  std::normal_distribution<double> N(0, 1);
  const auto random = [&](int r, int c) {
    MatD x(r, c);
    for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = N(rng);
    return x;
  };
  MatD P = random(s.nq, mq);  // masked past each query's view, as the phases' blocks are
  for (int i = 0; i < s.nq; ++i) P.row(i).tail(mq - s.seen(i)).setZero();
  const MatD X = random(mq, 16), Y = random(s.nq, 16), A = random(s.nq, 16), B = random(16, mq);
  const auto same_bits = [](const MatD& a, const MatD& b) {
    return a.rows() == b.rows() && a.cols() == b.cols() &&
           std::memcmp(a.data(), b.data(), sizeof(double) * static_cast<std::size_t>(a.size())) == 0;
  };
  EXPECT_TRUE(same_bits(detail::seen_product(P, X, s), mm(P, X)));
  EXPECT_TRUE(same_bits(detail::seen_product_tn(P, Y, s), mm_tn(P, Y)));
  const MatD full = mm(A, B), seen = detail::seen_columns(A, B, s);
  for (const detail::QueryBand& b : bands)
    for (int i = b.r0; i < b.r1; ++i) {
      ASSERT_LE(s.seen(i), b.cols);
      for (int t = 0; t < mq; ++t)
        ASSERT_EQ(seen(i, t), t < b.cols ? full(i, t) : 0.0) << i << "," << t;
    }
}

TEST(OptRWindows, QueryPositionsAndQuantizedRanges) {
  const HeadData& hd = kHead;
  OptRConfig cfg = windows_config(20, 5, 1);
  int nq = 0, m = 0;
  const auto w = detail::make_windows(hd, cfg, &nq, &m);
  ASSERT_EQ(w.size(), 2u);
  EXPECT_EQ(nq, 2 * 10);  // positions 47, 42, …, 2: ten per sequence, fewer than qwin
  EXPECT_EQ(m, 2 * (48 - 6 - 4));
  EXPECT_EQ(w[1].begin, 48);
  EXPECT_EQ(w[0].query_pos(0), 2);
  EXPECT_EQ(w[0].query_pos(9), 47);
  EXPECT_EQ(w[0].quantized_end(9), 42);  // the last query: its own recent window is the sequence's
  EXPECT_EQ(w[0].quantized_end(5), 22);  // position 27 sees [4, 22) quantized
  EXPECT_EQ(w[0].quantized_end(1), 4);   // position 7: nothing quantized yet
  cfg.qblock = 16;
  const auto b = detail::make_windows(hd, cfg, &nq, &m);
  EXPECT_EQ(b[0].quantized_end(5), 26);  // position 27 is in block [16, 32): sees [4, 26)
  EXPECT_EQ(b[0].quantized_end(9), 42);  // the last block ends at the sequence's end
  EXPECT_EQ(b[0].quantized_end(1), 8);   // position 7, block [0, 16): [4, 10) quantized, [4, 8) visible
  cfg.qstride = 0;  // spread: ⌊(48 − 4 − 6) / 20⌋ = 1; with qwin 4, ⌊38 / 4⌋ = 9
  EXPECT_EQ(detail::make_windows(hd, cfg, &nq, &m)[0].qstride, 1);
  cfg.qwin = 4;
  const auto spread = detail::make_windows(hd, cfg, &nq, &m);
  EXPECT_EQ(spread[1].qstride, 9);
  EXPECT_EQ(spread[1].query_pos(0), 47 - 27);
  cfg.qstride = -1;
  EXPECT_THROW(cfg.validate(), kvq::Error);
  cfg.qstride = 1;
  cfg.qblock = 0;
  EXPECT_THROW(cfg.validate(), kvq::Error);
}

}  // namespace
