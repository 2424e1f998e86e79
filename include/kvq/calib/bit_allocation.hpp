// kvq/calib/bit_allocation.hpp — key-prioritized bit allocation (DESIGN §6.4).
//
// 1. Norm-disparity report per layer: ‖W_K‖_F, ‖W_K‖₂, ‖W_V‖_F, ‖W_V‖₂ (when the
//    projection weights are given) and the K- and V-cache norms. "Quantize What
//    Counts" predicts ‖W_K‖ > ‖W_V‖, i.e. key error is amplified more than value error.
// 2. Measured error: for each candidate policy, the per-layer post-W_O attention
//    error with keys and values quantized exactly as deployed (exact prefix/recent
//    windows, OptR's causal query positions; optr/windows.hpp): mean over query heads j, positions t of
//    ‖(p̃_t·V̂ − p_t·V)·W_jᵀ‖² / D.
// 3. Allocation: choose one candidate per layer minimizing Σ_layers error subject to
//    mean bits/element (metadata included) ≤ budget — a multiple-choice knapsack,
//    solved exactly by DP over costs in units of 1/64 bit.
// The result is a per-layer table of policy names that engines dispatch on.
#pragma once

#include <cmath>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include <Eigen/Eigenvalues>

#include "kvq/calib/activations.hpp"
#include "kvq/calib/base_rotation.hpp"
#include "kvq/calib/fake_quant.hpp"
#include "kvq/calib/optr.hpp"
#include "kvq/core/policy.hpp"

namespace kvq::calib {

struct NormReport {
  int layer = 0;
  double wk_fro = NAN, wk_spec = NAN, wv_fro = NAN, wv_spec = NAN;  // NaN when weights are absent
  double k_rms = 0, v_rms = 0;        // RMS of cached entries (all heads, tokens)
  double k_token = 0, v_token = 0;    // mean per-token per-head L2 norm
  double k_absmax = 0, v_absmax = 0;  // largest |entry|: the outliers INT2 suffers from
};

// Largest singular value and Frobenius norm of a row-major [rows, cols] matrix.
// σ_max² is the largest eigenvalue of the smaller Gram matrix (MᵀM or MMᵀ): its absolute
// error is ~ε·σ_max², so σ_max keeps ~full fp64 relative precision. The eigensolver is the
// one base_rotation.hpp already instantiates; an SVD would add ~30 s of g++ time to every
// translation unit that includes this header.
inline std::pair<double, double> spectral_and_frobenius(const float* w, int rows, int cols) {
  const MatD M = Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(w, rows, cols)
                     .cast<double>();
  const MatD gram = rows <= cols ? mm_nt(M, M) : mm_tn(M, M);  // fixed-order products
  Eigen::SelfAdjointEigenSolver<MatD> es(gram, Eigen::EigenvaluesOnly);
  if (es.info() != Eigen::Success)
    throw Error(StatusCode::invalid_argument, "calib: spectral norm did not converge");
  return {std::sqrt(std::max(0.0, es.eigenvalues().maxCoeff())), M.norm()};
}

// w_k, w_v: optional projection weights (any orientation, e.g. [Hkv·d, D]); pass
// nullptr to skip the weight norms.
inline NormReport norm_report(const LayerActivations& a, const float* w_k = nullptr, const float* w_v = nullptr,
                              int w_rows = 0, int w_cols = 0) {
  a.validate();
  NormReport r;
  r.layer = a.layer;
  if (w_k && w_v && w_rows > 0 && w_cols > 0) {
    std::tie(r.wk_spec, r.wk_fro) = spectral_and_frobenius(w_k, w_rows, w_cols);
    std::tie(r.wv_spec, r.wv_fro) = spectral_and_frobenius(w_v, w_rows, w_cols);
  }
  auto stats = [&](const std::vector<float>& x, double& rms, double& tok, double& amax) {
    double ss = 0, tsum = 0;
    amax = 0;
    const std::size_t d = a.head_dim, n = x.size() / d;
    for (std::size_t t = 0; t < n; ++t) {
      double s = 0;
      for (std::size_t i = 0; i < d; ++i) {
        const double v = x[t * d + i];
        s += v * v;
        amax = std::max(amax, std::abs(v));
      }
      ss += s;
      tsum += std::sqrt(s);
    }
    rms = std::sqrt(ss / static_cast<double>(x.size()));
    tok = tsum / static_cast<double>(n);
  };
  stats(a.k, r.k_rms, r.k_token, r.k_absmax);
  stats(a.v, r.v_rms, r.v_token, r.v_absmax);
  return r;
}

// Rotations and means of one head for error measurement (identity / zeros = none).
struct HeadTransform {
  MatD RK, RV;  // [d, d]
  VecD mu_k, nu_v;  // [d]
};

// The transform a policy implies by itself (none or Hadamard, means from the data).
// Dense policies need calibrated rotations: pass them explicitly instead.
inline HeadTransform policy_transform(const Policy& p, const HeadData& hd) {
  const int d = hd.head_dim();
  auto rot = [&](const QuantSpec& s) -> MatD {
    if (s.rotation == Rotation::hadamard) return hadamard_rotation_seeded(d, s.sign_seed);
    if (s.rotation == Rotation::dense)
      throw Error(StatusCode::invalid_argument,
                  "bit allocation: a dense-rotation candidate needs calibrated rotations (pass an artifact)");
    return MatD::Identity(d, d);
  };
  HeadTransform t{rot(p.key), rot(p.value), VecD::Zero(d), VecD::Zero(d)};
  if (p.key.centered) t.mu_k = hd.K.colwise().mean().transpose();
  if (p.value.centered) t.nu_v = hd.V.colwise().mean().transpose();
  return t;
}

// Post-W_O attention error of one head with both K and V quantized (see header).
inline double head_output_error(const HeadData& hd, const Policy& p, const HeadTransform& t,
                                const OptRConfig& cfg) {
  const KPhase kp(hd, t.mu_k, p.key, cfg);
  const int d = hd.head_dim(), g = static_cast<int>(hd.Q.size());
  const double tau = cfg.tau > 0 ? cfg.tau : 1.0 / std::sqrt(static_cast<double>(d));
  // V̂ on the quantized rows.
  MatD Vq = detail::gather_quantized(hd.V, kp.windows(), kp.quantized_rows());
  Vq.rowwise() -= t.nu_v.transpose();
  const MatD Vhat = RotatedQuant::forward(Vq, t.RV, p.value).recon.rowwise() + t.nu_v.transpose();
  double err = 0;
  std::size_t idx = 0;
  for (const detail::SeqWin& s : kp.windows()) {
    const int m = s.qe - s.qb;
    const MatD Vs = hd.V.middleRows(s.begin, s.len);
    for (int j = 0; j < g; ++j, ++idx) {
      // Exact attention, then p̃ on all columns: exact columns need p̃ too. Query i sees
      // columns [qb, quantized_end(i)) quantized and the rest of [0, visible(i)) exact.
      const MatD Qw = detail::gather_queries(hd.Q[j], s);
      const MatD Z = tau * Qw * hd.K.middleRows(s.begin, s.len).transpose();
      MatD Zq = Z;
      if (m > 0) {
        MatD Khat = RotatedQuant::forward(
                        (hd.K.middleRows(s.begin + s.qb, m).rowwise() - t.mu_k.transpose()).eval(), t.RK, p.key)
                        .recon;
        Khat.rowwise() += t.mu_k.transpose();
        Zq.middleCols(s.qb, m) = tau * Qw * Khat.transpose();
      }
      MatD delta(s.nq, d);
      for (int i = 0; i < s.nq; ++i) {
        const int n = s.visible(i), qn = s.quantized_end(i) - s.qb;
        auto softmax = [&](Eigen::RowVectorXd r) {
          r.array() -= r.maxCoeff();
          r = r.array().exp().matrix();
          return Eigen::RowVectorXd(r / r.sum());
        };
        Eigen::RowVectorXd zq = Z.row(i).head(n);
        zq.segment(s.qb, qn) = Zq.row(i).segment(s.qb, qn);
        const Eigen::RowVectorXd pq = softmax(zq);
        Eigen::RowVectorXd out = pq * Vs.topRows(n);
        out += pq.segment(s.qb, qn) * (Vhat.middleRows(s.qrow, qn) - Vs.middleRows(s.qb, qn));
        delta.row(i) = out - softmax(Z.row(i).head(n)) * Vs.topRows(n);
      }
      const MatD Wd = delta * hd.W[j].transpose();  // [nq, D]
      err += Wd.squaredNorm() / static_cast<double>(hd.W[j].rows());
    }
  }
  return err / (static_cast<double>(kp.query_total()) * g);
}

// Mean over KV heads of head_output_error for a layer, on sequences
// [seq_begin, seq_end) (−1 = all; measure on held-out sequences when the rotations
// were calibrated on the others). `transforms` (optional) gives calibrated per-head
// rotations; otherwise policy_transform() is used.
inline double layer_output_error(const LayerActivations& a, const Policy& p, const OptRConfig& cfg,
                                 const std::vector<HeadTransform>* transforms = nullptr, int seq_begin = 0,
                                 int seq_end = -1) {
  double e = 0;
  for (int h = 0; h < a.hkv; ++h) {
    const HeadData hd = extract_head(a, h, seq_begin, seq_end);
    const HeadTransform t = transforms ? transforms->at(h) : policy_transform(p, hd);
    e += head_output_error(hd, p, t, cfg);
  }
  return e / a.hkv;
}

struct Candidate {
  std::string name;
  Policy policy;
};

struct Allocation {
  std::vector<int> layer;          // layer ids
  std::vector<int> choice;         // index into candidates, per layer
  double mean_bits = 0;            // achieved mean bits/element (metadata included)
  double total_error = 0;          // Σ measured error of the choices
};

// Exact multiple-choice knapsack. errors[l][c] = measured error of candidate c on
// layer l; cost of c = candidates[c].policy.bits_per_element(). Throws if even the
// cheapest choice per layer exceeds the budget.
inline Allocation allocate_bits(const std::vector<int>& layer_ids, const std::vector<Candidate>& cands,
                                const std::vector<std::vector<double>>& errors, double budget_bits) {
  const int L = static_cast<int>(layer_ids.size()), C = static_cast<int>(cands.size());
  if (L == 0 || C == 0 || static_cast<int>(errors.size()) != L)
    throw Error(StatusCode::invalid_argument, "bit allocation: need errors for every layer and candidate");
  constexpr double kUnit = 64.0;  // bits/element are multiples of 1/64 for every valid group (≥ 16, fp16/fp32 meta)
  std::vector<int> cost(C);
  for (int c = 0; c < C; ++c) cost[c] = static_cast<int>(std::lround(cands[c].policy.bits_per_element() * kUnit));
  const int cap = static_cast<int>(std::floor(budget_bits * L * kUnit + 1e-9));
  int min_total = 0;
  for (int l = 0; l < L; ++l) {
    if (static_cast<int>(errors[l].size()) != C)
      throw Error(StatusCode::invalid_argument, "bit allocation: error table has the wrong width");
    min_total += *std::min_element(cost.begin(), cost.end());
  }
  if (min_total > cap)
    throw Error(StatusCode::invalid_argument,
                "bit allocation: budget " + std::to_string(budget_bits) +
                    " bits/element is below the cheapest candidate (" + std::to_string(min_total / kUnit / L) + ")");
  const double inf = std::numeric_limits<double>::infinity();
  // best[l+1][b] = least error of layers 0..l using exactly b cost units.
  std::vector<std::vector<double>> best(L + 1, std::vector<double>(cap + 1, inf));
  std::vector<std::vector<int>> pick(L, std::vector<int>(cap + 1, -1));
  best[0][0] = 0;
  for (int l = 0; l < L; ++l)
    for (int b = 0; b <= cap; ++b) {
      if (best[l][b] == inf) continue;
      for (int c = 0; c < C; ++c) {
        const int nb = b + cost[c];
        if (nb > cap || !std::isfinite(errors[l][c])) continue;
        const double v = best[l][b] + errors[l][c];
        if (v < best[l + 1][nb]) {
          best[l + 1][nb] = v;
          pick[l][nb] = c;
        }
      }
    }
  int bend = -1;
  for (int b = 0; b <= cap; ++b)
    if (best[L][b] < inf && (bend < 0 || best[L][b] < best[L][bend])) bend = b;
  if (bend < 0) throw Error(StatusCode::invalid_argument, "bit allocation: no feasible choice (non-finite errors?)");
  Allocation a;
  a.layer = layer_ids;
  a.choice.assign(L, -1);
  a.total_error = best[L][bend];
  for (int l = L - 1, b = bend; l >= 0; --l) {
    const int c = pick[l][b];
    a.choice[l] = c;
    b -= cost[c];
  }
  double bits = 0;
  for (int c : a.choice) bits += cands[c].policy.bits_per_element();
  a.mean_bits = bits / L;
  return a;
}

// Per-layer dispatch table: "layer,policy,key_bits,value_bits,bits_per_element,error".
inline void write_allocation_csv(std::ostream& os, const Allocation& a, const std::vector<Candidate>& cands,
                                 const std::vector<std::vector<double>>& errors) {
  os << "layer,policy,key_bits,value_bits,bits_per_element,error\n";
  for (std::size_t l = 0; l < a.layer.size(); ++l) {
    const Candidate& c = cands[a.choice[l]];
    os << a.layer[l] << ',' << c.name << ',' << c.policy.key.bits << ',' << c.policy.value.bits << ','
       << c.policy.bits_per_element() << ',' << errors[l][a.choice[l]] << '\n';
  }
}

}  // namespace kvq::calib
