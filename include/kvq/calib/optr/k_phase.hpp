// kvq/calib/optr/k_phase.hpp — the K-phase loss of one head and its gradient (values exact).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "kvq/calib/activations.hpp"
#include "kvq/calib/fake_quant.hpp"
#include "kvq/calib/fixed_order.hpp"
#include "kvq/calib/optr/config.hpp"
#include "kvq/calib/optr/rotated_quant.hpp"
#include "kvq/calib/optr/windows.hpp"
#include "kvq/calib/skew_exp.hpp"
#include "kvq/core/policy.hpp"
#include "kvq/core/status.hpp"

namespace kvq::calib {

// K phase of one head: mean over query heads j and query positions of
// KL(p ‖ p̃) + λ·mean_D((p̃ − p)·V·W_jᵀ)², values exact;
// plus γ·½τ²·mean_t Δk_t·C_Q·Δk_tᵀ (γ = cfg.k_token, 0 by default = DESIGN §6.3), the mean
// squared logit error of each quantized key over all calibration queries, C_Q = E[q·qᵀ]
// over every position and query head. The KL weighs a key's error by the attention the
// training queries give it; this term weighs every key alike, so that keys those
// queries ignore (and a later query may look up) do not pay for the attended ones.
//
// Only the m quantized key columns change with R, so everything the exact columns
// contribute is precomputed once per (sequence, query head): their log-sum-exp
// reference, Σ exp(z − c)·v, and the p-weighted terms of the KL. A step then costs
// O(nq·m·d) instead of O(nq·len·d), and about half that where the queries are spread
// over the sequence: the products skip the columns a band of queries does not see yet
// (windows.hpp, query_bands), with the full products' bits.
class KPhase {
 public:
  KPhase(const HeadData& hd, const VecD& mu, const QuantSpec& spec, const OptRConfig& cfg)
      : mu_(mu), spec_(spec), cfg_(cfg) {
    d_ = hd.head_dim();
    check_spec(spec, d_);
    if (hd.Q.empty() || hd.W.size() != hd.Q.size())
      throw Error(StatusCode::invalid_argument, "calib: a KV head needs its query heads and W_O slices");
    tau_ = cfg.tau > 0 ? cfg.tau : 1.0 / std::sqrt(static_cast<double>(d_));
    win_ = detail::make_windows(hd, cfg, &nq_total_, &m_);
    if (m_ == 0)
      throw Error(StatusCode::invalid_argument,
                  "calib: no token is quantized; sequences must be longer than prefix + recent (" +
                      std::to_string(cfg.prefix) + " + " + std::to_string(cfg.recent) + ")");
    g_ = static_cast<int>(hd.Q.size());
    D_ = static_cast<double>(hd.W[0].rows());
    Kc_ = detail::gather_quantized(hd.K, win_, m_);
    Kc_.rowwise() -= mu.transpose();
    Vq_ = detail::gather_quantized(hd.V, win_, m_);
    VqT_ = detail::transposed(Vq_);
    M_.resize(g_);
    for (int j = 0; j < g_; ++j) M_[j] = mm_tn(hd.W[j], hd.W[j]);
    if (cfg.k_token > 0) {  // C_Q = mean over query heads and positions of q·qᵀ   [d, d]
      CQ_ = MatD::Zero(d_, d_);
      for (int j = 0; j < g_; ++j) CQ_ += mm_tn(hd.Q[j], hd.Q[j]);
      CQ_ /= static_cast<double>(g_) * static_cast<double>(hd.Q[0].rows());
    }
    for (const detail::SeqWin& s : win_)
      for (int j = 0; j < g_; ++j) exact_.push_back(precompute(hd, s, j));
  }

  int quantized_rows() const { return m_; }
  const MatD& centered_rows() const { return Kc_; }
  // The estimator frozen at R: `loss(·, ·, &frozen)` is then the surrogate of DESIGN §6.3.
  QuantSte freeze(const MatD& R) const { return RotatedQuant::freeze(Kc_, R, spec_); }

  // Loss at R_K; with dLdR the STE gradient ∂L/∂R_K. A frozen estimator replaces the
  // quantizer by its surrogate (whose exact gradient the STE gradient equals).
  double loss(const MatD& R, MatD* dLdR = nullptr, const QuantSte* frozen = nullptr) const {
    const RotatedQuant rq = RotatedQuant::forward(Kc_, R, spec_, frozen);
    const MatD KhatT = dequantized_keys_transposed(rq);
    MatD GK;
    if (dLdR) GK = MatD::Zero(m_, d_);
    const double wq = 1.0 / (g_ * static_cast<double>(nq_total_));
    const double wshift = cfg_.lambda * wq / D_;
    double total = 0;
    std::size_t e_idx = 0;
    for (const detail::SeqWin& s : win_) {
      const int m = s.qe - s.qb;
      for (int j = 0; j < g_; ++j, ++e_idx) {
        const Exact& e = exact_[e_idx];
        const Attn at = attend(e, s, KhatT.middleCols(s.qrow, m));
        const MatD A = at.pV - e.pV;  // (p̃ − p)·V   [nq, d]
        const MatD AM = mm(A, M_[j]);
        double kl = 0;
        for (int i = 0; i < s.nq; ++i) kl += (e.h[i] - row_dot(e.Pq, at.Zq, i)) + at.lse[i];
        total += dmul(wq, kl) + dmul(wshift, sum_product(AM, A));
        if (dLdR && m > 0) {
          // ∂/∂z̃_q: KL gives wq·(p̃ − p); the shift term gives p̃⊙(G·vᵀ − G·(p̃V)) with
          // G = 2·wshift·A·M (softmax backward).
          const MatD G = (2.0 * wshift) * AM;
          const MatD gp = detail::seen_columns(G, VqT_.middleCols(s.qrow, m), s);  // [nq, m]
          MatD dz = MatD::Zero(s.nq, m);  // +0 where the query does not see the column
          for (int i = 0; i < s.nq; ++i) {
            const double dot = row_dot(G, at.pV, i);
            for (int t = 0; t < s.seen(i); ++t)
              dz(i, t) = dmul(wq, at.Pq(i, t) - e.Pq(i, t)) + dmul(at.Pq(i, t), gp(i, t) - dot);
          }
          add_scaled(tau_, detail::seen_product_tn(dz, e.Qw, s), GK.middleRows(s.qrow, m));
        }
      }
    }
    if (cfg_.k_token > 0) {  // γ·½τ²/m·Σ_t Δk_t·C_Q·Δk_tᵀ; gradient γ·τ²/m·Δk_t·C_Q (C_Q symmetric)
      const MatD dK = rq.recon - Kc_;  // [m, d]
      const MatD DC = mm(dK, CQ_);
      const double wk = dmul(cfg_.k_token, dmul(tau_, tau_) / m_);
      total += dmul(0.5 * wk, sum_product(DC, dK));
      if (dLdR) add_scaled(wk, DC, GK);
    }
    if (dLdR) *dLdR = rq.grad_R(Kc_, R, GK);
    return total;
  }

  // p̃ restricted to the quantized columns under R_K, one [nq, m] block per
  // (sequence, query head), sequence-major: what the V phase weighs ΔV by.
  std::vector<MatD> quantized_probs(const MatD& R) const {
    const MatD KhatT = dequantized_keys_transposed(RotatedQuant::forward(Kc_, R, spec_));
    std::vector<MatD> out;
    std::size_t e_idx = 0;
    for (const detail::SeqWin& s : win_)
      for (int j = 0; j < g_; ++j, ++e_idx)
        out.push_back(attend(exact_[e_idx], s, KhatT.middleCols(s.qrow, s.qe - s.qb)).Pq);
    return out;
  }

  const std::vector<detail::SeqWin>& windows() const { return win_; }
  int query_total() const { return nq_total_; }

 private:
  // What the exact columns contribute, per (sequence, query head). Row i is query
  // position s.query_pos(i); it sees tokens [0, s.visible(i)), of them [qb, s.quantized_end(i))
  // quantized: the first s.seen(i) stacked columns. A stacked column past them (in the
  // query's recent window, or not yet appended) is masked: +0 in every [nq, m] block.
  struct Exact {
    MatD Qw;    // [nq, d] queries
    VecD c;     // [nq] max exact visible logit (0 when none is visible)
    VecD sx;    // [nq] Σ_exact exp(z − c)
    MatD Ex;    // [nq, d] Σ_exact exp(z − c)·v
    VecD h;     // [nq] Σ p·log p − Σ_exact p·z
    MatD Pq;    // [nq, m] exact p on the quantized columns (+0 where masked)
    MatD pV;    // [nq, d] exact p·V
  };
  struct Attn {
    MatD Zq;   // [nq, m] quantized-key logits (+0 where masked)
    MatD Pq;   // [nq, m] p̃ on quantized columns (+0 where masked)
    VecD lse;  // [nq] log-normalizer of p̃
    MatD pV;   // [nq, d] p̃·V
  };

  Exact precompute(const HeadData& hd, const detail::SeqWin& s, int j) const {
    Exact e;
    const int m = s.qe - s.qb;
    e.Qw = detail::gather_queries(hd.Q[j], s);
    const MatD Ks = hd.K.middleRows(s.begin, s.len), Vs = hd.V.middleRows(s.begin, s.len);
    const MatD Z = tau_ * mm_nt(e.Qw, Ks);  // [nq, len]
    e.c = VecD::Zero(s.nq);
    e.sx = VecD::Zero(s.nq);
    e.h = VecD::Zero(s.nq);
    e.Ex = MatD::Zero(s.nq, d_);
    e.Pq = MatD::Zero(s.nq, m);
    const MatD P = [&] {
      MatD p = MatD::Zero(s.nq, s.len);
      for (int i = 0; i < s.nq; ++i) {
        const int n = s.visible(i);
        const double mx = Z.row(i).head(n).maxCoeff();
        double sum = 0;
        for (int t = 0; t < n; ++t) sum += p(i, t) = std::exp(Z(i, t) - mx);
        p.row(i) /= sum;
      }
      return p;
    }();
    e.pV = mm(P, Vs);
    for (int i = 0; i < s.nq; ++i) {
      const int n = s.visible(i), qend = s.quantized_end(i);
      double c = -std::numeric_limits<double>::infinity();
      for (int t = 0; t < n; ++t)
        if (t < s.qb || t >= qend) c = std::max(c, Z(i, t));
      if (!std::isfinite(c)) c = 0;  // no exact column visible: sx stays 0
      e.c[i] = c;
      for (int t = 0; t < n; ++t) {
        const double pl = P(i, t) > 0 ? dmul(P(i, t), std::log(P(i, t))) : 0.0;
        e.h[i] += pl;
        if (t >= s.qb && t < qend) {
          e.Pq(i, t - s.qb) = P(i, t);
        } else {
          const double w = std::exp(Z(i, t) - c);
          e.sx[i] += w;
          for (int c = 0; c < d_; ++c) e.Ex(i, c) += dmul(w, Vs(t, c));
          e.h[i] -= dmul(P(i, t), Z(i, t));
        }
      }
    }
    return e;
  }

  // k̂ = x̂·Rᵀ + μ of every quantized row, transposed   [d, m_total]
  MatD dequantized_keys_transposed(const RotatedQuant& rq) const {
    MatD Khat = rq.recon;
    Khat.rowwise() += mu_.transpose();
    return detail::transposed(Khat);
  }

  // Attention with the quantized keys, KhatT_q [d, m] transposed, in the quantized columns.
  Attn attend(const Exact& e, const detail::SeqWin& s, const Eigen::Ref<const MatD>& KhatT_q) const {
    const int m = s.qe - s.qb;
    Attn a;
    a.Zq = detail::seen_columns(e.Qw, KhatT_q, s);
    a.Zq *= tau_;
    a.Pq = MatD::Zero(s.nq, m);
    a.lse = VecD::Zero(s.nq);
    a.pV = MatD::Zero(s.nq, d_);
    for (int i = 0; i < s.nq; ++i) {
      const int seen = s.seen(i);  // quantized columns this query sees
      const bool has_exact = e.sx[i] > 0;
      double mx = has_exact ? e.c[i] : -std::numeric_limits<double>::infinity();
      for (int t = 0; t < seen; ++t) mx = std::max(mx, a.Zq(i, t));
      double total = has_exact ? dmul(e.sx[i], std::exp(e.c[i] - mx)) : 0.0;
      for (int t = 0; t < seen; ++t) {
        a.Pq(i, t) = std::exp(a.Zq(i, t) - mx);
        total += a.Pq(i, t);
      }
      a.Zq.row(i).tail(m - seen).setZero();  // its band's product may have filled them
      a.lse[i] = mx + std::log(total);
      a.Pq.row(i).head(seen) /= total;
      if (has_exact) a.pV.row(i) = std::exp(e.c[i] - a.lse[i]) * e.Ex.row(i);
    }
    a.pV += detail::seen_product(a.Pq, Vq_.middleRows(s.qrow, m), s);
    return a;
  }

  VecD mu_;
  QuantSpec spec_;
  OptRConfig cfg_;
  int d_ = 0, g_ = 0, m_ = 0, nq_total_ = 0;
  double tau_ = 0, D_ = 1;
  std::vector<detail::SeqWin> win_;
  MatD Kc_, Vq_;  // [m, d] centered quantized keys, their values
  MatD VqT_;      // [d, m] Vq_ transposed, for G·Vqᵀ
  std::vector<MatD> M_;
  MatD CQ_;  // [d, d] E[q·qᵀ], only with cfg.k_token > 0
  std::vector<Exact> exact_;
};

}  // namespace kvq::calib
