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
// mean((p̃·ΔV)·W_jᵀ)², ΔV = deq(Q((V − ν)·R_V))·R_Vᵀ + ν − V (zero on exact tokens).
class VPhase {
 public:
  VPhase(const HeadData& hd, const VecD& nu, const QuantSpec& spec, const OptRConfig& /*cfg*/,
         const KPhase& kphase, const MatD& RK)
      : spec_(spec), win_(kphase.windows()) {
    d_ = hd.head_dim();
    check_spec(spec, d_);
    m_ = kphase.quantized_rows();
    g_ = static_cast<int>(hd.Q.size());
    Vc_ = detail::gather_quantized(hd.V, win_, m_);
    Vc_.rowwise() -= nu.transpose();
    M_.resize(g_);
    for (int j = 0; j < g_; ++j) M_[j] = mm_tn(hd.W[j], hd.W[j]);
    P_ = kphase.quantized_probs(RK);
    w_ = 1.0 / (g_ * static_cast<double>(kphase.query_total()) * static_cast<double>(hd.W[0].rows()));
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
        const MatD B = mm(P_[idx], dV.middleRows(s.qrow, m));  // p̃·ΔV   [nq, d]
        const MatD BM = mm(B, M_[j]);
        total += dmul(w_, sum_product(BM, B));
        if (dLdR) add_scaled(2.0 * w_, mm_tn(P_[idx], BM), G.middleRows(s.qrow, m));
      }
    }
    if (dLdR) *dLdR = rq.grad_R(Vc_, R, G);
    return total;
  }

 private:
  QuantSpec spec_;
  std::vector<detail::SeqWin> win_;
  int d_ = 0, g_ = 0, m_ = 0;
  double w_ = 0;
  MatD Vc_;
  std::vector<MatD> M_;
  std::vector<MatD> P_;
};

}  // namespace kvq::calib
