// kvq/calib/optr/v_phase.hpp — the V-phase loss of one head and its gradient (key rotation
// fixed, keys quantized with it).
#pragma once

#include <vector>

#include "kvq/calib/activations.hpp"
#include "kvq/calib/fake_quant.hpp"
#include "kvq/calib/fixed_order.hpp"
#include "kvq/calib/optr/config.hpp"
#include "kvq/calib/optr/k_phase.hpp"
#include "kvq/calib/optr/rotated_quant.hpp"
#include "kvq/calib/optr/windows.hpp"
#include "kvq/calib/skew_exp.hpp"
#include "kvq/core/policy.hpp"

namespace kvq::calib {

// V phase of one head, with the key rotation fixed: mean over j of
// mean((p̃·ΔV)·W_jᵀ)² + γ·mean_q Σ_t p̃_qt·mean((ΔV_t·W_jᵀ)²) + γ_u·mean_t mean((ΔV_t·W_jᵀ)²),
// ΔV = deq(Q((V − ν)·R_V))·R_Vᵀ + ν − V (zero on exact tokens).
// The first term is the attention output's error; its per-token errors may cancel in the
// weighted sum, which a lookup attending to one token does not average away. The second
// (γ = cfg.v_token, 0 by default = DESIGN §6.3) is its Jensen bound, the attention-weighted
// error of each token on its own, and does not reward cancellation. The third (γ_u =
// cfg.v_uniform, 0 by default) weights every quantized token alike: the error of a query
// that attends to that one token, whether or not the calibration's queries did (a passkey
// lookup attends to tokens that calibration text rarely attends to).
class VPhase {
 public:
  VPhase(const HeadData& hd, const VecD& nu, const QuantSpec& spec, const OptRConfig& cfg,
         const KPhase& kphase, const MatD& RK)
      : spec_(spec), win_(kphase.windows()), gamma_(cfg.v_token) {
    d_ = hd.head_dim();
    check_spec(spec, d_);
    m_ = kphase.quantized_rows();
    g_ = static_cast<int>(hd.Q.size());
    Vc_ = detail::gather_quantized(hd.V, win_, m_);
    Vc_.rowwise() -= nu.transpose();
    M_.resize(g_);
    for (int j = 0; j < g_; ++j) M_[j] = mm_tn(hd.W[j], hd.W[j]);
    P_ = kphase.quantized_probs(RK);
    if (gamma_ > 0) {  // attention mass of each quantized token, summed over queries in order
      mass_.reserve(P_.size());
      for (const MatD& P : P_) {
        VecD c = VecD::Zero(P.cols());
        for (Eigen::Index q = 0; q < P.rows(); ++q)
          for (Eigen::Index t = 0; t < P.cols(); ++t) c[t] += P(q, t);
        mass_.push_back(std::move(c));
      }
    }
    w_ = 1.0 / (g_ * static_cast<double>(kphase.query_total()) * static_cast<double>(hd.W[0].rows()));
    if (cfg.v_uniform > 0 && m_ > 0) {  // Σ_j M_j, summed in j order
      M_sum_ = M_[0];
      for (int j = 1; j < g_; ++j) M_sum_ += M_[j];
      w_uniform_ = cfg.v_uniform / (g_ * static_cast<double>(m_) * static_cast<double>(hd.W[0].rows()));
    }
  }

  // The estimator frozen at R: `loss(·, ·, &frozen)` is then the surrogate of DESIGN §6.3.
  QuantSte freeze(const MatD& R) const { return RotatedQuant::freeze(Vc_, R, spec_); }

  double loss(const MatD& R, MatD* dLdR = nullptr, const QuantSte* frozen = nullptr) const {
    const RotatedQuant rq = RotatedQuant::forward(Vc_, R, spec_, frozen);
    const MatD dV = rq.recon - Vc_;  // ΔV on the quantized rows   [m, d]
    MatD G;
    if (dLdR) G = MatD::Zero(m_, d_);
    double total = 0;
    std::size_t idx = 0;
    for (const detail::SeqWin& s : win_) {
      const int m = s.qe - s.qb;
      for (int j = 0; j < g_; ++j, ++idx) {
        if (m == 0) continue;
        const MatD B = detail::seen_product(P_[idx], dV.middleRows(s.qrow, m), s);  // p̃·ΔV   [nq, d]
        const MatD BM = mm(B, M_[j]);
        total += dmul(w_, sum_product(BM, B));
        if (dLdR) add_scaled(2.0 * w_, detail::seen_product_tn(P_[idx], BM, s), G.middleRows(s.qrow, m));
        if (gamma_ > 0) {  // γ·Σ_t c_t·ΔV_t·M_j·ΔV_tᵀ; its gradient 2γ·c_t·ΔV_t·M_j (M_j symmetric)
          MatD C = dV.middleRows(s.qrow, m);  // rows scaled by their attention mass   [m, d]
          for (int t = 0; t < m; ++t) C.row(t) *= mass_[idx][t];
          const MatD CM = mm(C, M_[j]);
          const double wg = dmul(w_, gamma_);
          total += dmul(wg, sum_product(CM, dV.middleRows(s.qrow, m)));
          if (dLdR) add_scaled(2.0 * wg, CM, G.middleRows(s.qrow, m));
        }
      }
    }
    if (w_uniform_ > 0) {  // γ_u·Σ_t ΔV_t·(Σ_j M_j)·ΔV_tᵀ; its gradient 2γ_u·ΔV·Σ_j M_j
      const MatD DM = mm(dV, M_sum_);
      total += dmul(w_uniform_, sum_product(DM, dV));
      if (dLdR) add_scaled(2.0 * w_uniform_, DM, G);
    }
    if (dLdR) *dLdR = rq.grad_R(Vc_, R, G);
    return total;
  }

 private:
  QuantSpec spec_;
  std::vector<detail::SeqWin> win_;
  int d_ = 0, g_ = 0, m_ = 0;
  double w_ = 0, gamma_ = 0, w_uniform_ = 0;
  MatD Vc_;
  std::vector<MatD> M_;
  MatD M_sum_;  // Σ_j W_jᵀ·W_j, with v_uniform   [d, d]
  std::vector<MatD> P_;
  std::vector<VecD> mass_;  // per (sequence, query head): Σ_q p̃_qt   [m_seq]
};

}  // namespace kvq::calib
