// kvq/calib/optr.hpp — OptR: output-aware per-head rotations (DESIGN §6.3).
//
// For each (layer, KV head) the rotation R = R0·exp(A − Aᵀ) is learned through the
// whole quantize → attention → W_O path, first for keys (values exact), then for
// values (keys quantized with the chosen R_K). Only the tokens that deployment
// quantizes are quantized here: per sequence, the first `prefix` and last `recent`
// tokens stay exact, and the loss is measured on the last `qwin` query positions
// under a causal mask. Rounding uses the straight-through estimator; gradients are
// hand-written and equal the exact gradient of the frozen-residual surrogate
// f(R) = g(((X−μ)·R + r)·Rᵀ + μ) with r = Q(X₀) − X₀ fixed (tests/calib checks that
// against finite differences).
//
// Shapes: keys/values of one head [L, d]; W_O slice of query head j [D, d];
// M_j = W_jᵀ·W_j [d, d] turns squared post-W_O norms into d×d quadratic forms,
// ‖a·W_jᵀ‖² = a·M_j·aᵀ, so the D dimension never enters the inner loops.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numbers>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kvq/calib/activations.hpp"
#include "kvq/calib/base_rotation.hpp"
#include "kvq/calib/fake_quant.hpp"
#include "kvq/calib/skew_exp.hpp"
#include "kvq/core/policy.hpp"
#include "kvq/core/status.hpp"

// OpenMP pragmas only when the consumer compiles with -fopenmp (no unknown-pragma noise).
#if defined(_OPENMP)
#define KVQ_CALIB_STR_(...) #__VA_ARGS__
#define KVQ_CALIB_OMP(...) _Pragma(KVQ_CALIB_STR_(omp __VA_ARGS__))
#else
#define KVQ_CALIB_OMP(...)
#endif

namespace kvq::calib {

enum class BaseKind { identity, hadamard, covariance };
enum class Parameterization {
  exp_map,     // R = R0·exp(A − Aᵀ), gradient by the block-exponential Fréchet adjoint
  riemannian,  // R ← R·exp(step) with the gradient taken at the current point (A = 0)
};

inline const char* to_string(BaseKind b) {
  switch (b) {
    case BaseKind::identity: return "identity";
    case BaseKind::hadamard: return "hadamard";
    case BaseKind::covariance: return "covariance";
  }
  return "?";
}
inline const char* to_string(Parameterization p) {
  return p == Parameterization::exp_map ? "exp_map" : "riemannian";
}

struct OptRConfig {
  int prefix = 64;       // exact attention-sink tokens at the start of each sequence
  int recent = 256;      // exact recent tokens at the end of each sequence
  int qwin = 64;         // query positions used (the last qwin of each sequence)
  int steps = 80;        // Adam steps per phase; 0 = base rotations only
  int eval_every = 20;   // held-out evaluation period (and at the end)
  double lr = 0.02, beta1 = 0.9, beta2 = 0.999, adam_eps = 1e-8;
  double lambda = 1.0;   // weight of the post-W_O shift term in the K phase
  double margin = 0.01;  // keep learned R only if best < base·(1 − margin)
  bool cosine_lr = false;  // lr·½(1 + cos(π·(step−1)/steps)) instead of DESIGN §6.3's constant lr
  double tau = 0.0;      // softmax scale; 0 = 1/√d
  double heldout_fraction = 0.25;  // share of sequences held out (at least one)
  BaseKind base = BaseKind::hadamard;
  Parameterization param = Parameterization::exp_map;

  void validate() const {
    auto bad = [](const std::string& m) { throw Error(StatusCode::invalid_argument, "calib: " + m); };
    if (prefix < 0 || recent < 0) bad("prefix and recent must be >= 0");
    if (qwin <= 0) bad("qwin must be > 0");
    if (steps < 0) bad("steps must be >= 0");
    if (eval_every <= 0) bad("eval_every must be > 0");
    if (!(lr > 0) || !(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1) || !(adam_eps > 0))
      bad("Adam hyper-parameters out of range");
    if (!(lambda >= 0)) bad("lambda must be >= 0");
    if (!(margin >= 0 && margin < 1)) bad("margin must be in [0, 1)");
    if (!(tau >= 0)) bad("tau must be >= 0");
    if (!(heldout_fraction > 0 && heldout_fraction < 1)) bad("heldout_fraction must be in (0, 1)");
  }
};

namespace detail {

// Row layout of one sequence inside a head's [L, d] matrices.
struct SeqWin {
  int begin = 0, len = 0;  // token range of the sequence
  int qb = 0, qe = 0;      // quantized tokens [qb, qe), relative to begin
  int nq = 0;              // query positions: the last nq tokens
  int qrow = 0;            // first row of this sequence's quantized block in the stacked matrices
};

inline std::vector<SeqWin> make_windows(const HeadData& hd, const OptRConfig& c, int* total_q, int* total_m) {
  std::vector<SeqWin> w;
  *total_q = 0;
  *total_m = 0;
  for (std::size_t s = 0; s + 1 < hd.seq_offsets.size(); ++s) {
    SeqWin x;
    x.begin = static_cast<int>(hd.seq_offsets[s]);
    x.len = static_cast<int>(hd.seq_offsets[s + 1] - hd.seq_offsets[s]);
    x.qb = std::min(c.prefix, x.len);
    x.qe = std::max(x.qb, x.len - c.recent);
    x.nq = std::min(c.qwin, x.len);
    x.qrow = *total_m;
    *total_q += x.nq;
    *total_m += x.qe - x.qb;
    w.push_back(x);
  }
  return w;
}

// Rows [row(r)] of a stacked matrix gathered from the quantized ranges.
inline MatD gather_quantized(const MatD& X, const std::vector<SeqWin>& w, int m) {
  MatD out(m, X.cols());
  for (const SeqWin& s : w)
    if (s.qe > s.qb) out.middleRows(s.qrow, s.qe - s.qb) = X.middleRows(s.begin + s.qb, s.qe - s.qb);
  return out;
}

// Log-softmax of the first n entries of a row, in place; the rest is untouched.
inline void log_softmax_head(Eigen::Ref<Eigen::RowVectorXd> z, int n) {
  auto h = z.head(n);
  const double mx = h.maxCoeff();
  const double lse = mx + std::log((h.array() - mx).exp().sum());
  h.array() -= lse;
}

}  // namespace detail

// Rows of one head that deployment quantizes, rotated and fake-quantized.
//   Xc: [m, d] centered rows (x − μ);   R: [d, d]
// X̂ = Q(Xc·R) (or Xc·R + r for the frozen-residual surrogate); recon = X̂·Rᵀ.
// ∂L/∂R given G = ∂L/∂recon: Xcᵀ·G·R + Gᵀ·X̂ (the STE gradient: ∂X̂/∂(Xc·R) = I).
struct RotatedQuant {
  MatD Xhat, recon;

  static RotatedQuant forward(const MatD& Xc, const MatD& R, const QuantSpec& spec,
                              const MatD* frozen_residual = nullptr) {
    RotatedQuant o;
    o.Xhat = Xc * R;
    if (frozen_residual) {
      o.Xhat += *frozen_residual;
    } else {
      const int d = static_cast<int>(R.cols());
      std::vector<float> row(d);
      for (Eigen::Index i = 0; i < o.Xhat.rows(); ++i) {
        for (int c = 0; c < d; ++c) row[c] = static_cast<float>(o.Xhat(i, c));
        fake_quant_row(spec, row.data(), row.data(), d);
        for (int c = 0; c < d; ++c) o.Xhat(i, c) = row[c];
      }
    }
    o.recon = o.Xhat * R.transpose();
    return o;
  }
  static MatD residual(const MatD& Xc, const MatD& R, const QuantSpec& spec) {
    return forward(Xc, R, spec).Xhat - Xc * R;
  }
  MatD grad_R(const MatD& Xc, const MatD& R, const MatD& G) const {
    return Xc.transpose() * G * R + G.transpose() * Xhat;
  }
};

// K phase of one head: mean over query heads j and query positions of
// KL(p ‖ p̃) + λ·mean_D((p̃ − p)·V·W_jᵀ)², values exact.
//
// Only the m quantized key columns change with R, so everything the exact columns
// contribute is precomputed once per (sequence, query head): their log-sum-exp
// reference, Σ exp(z − c)·v, and the p-weighted terms of the KL. A step then costs
// O(nq·m·d) instead of O(nq·len·d).
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
    M_.resize(g_);
    for (int j = 0; j < g_; ++j) M_[j] = hd.W[j].transpose() * hd.W[j];
    for (const detail::SeqWin& s : win_)
      for (int j = 0; j < g_; ++j) exact_.push_back(precompute(hd, s, j));
  }

  int quantized_rows() const { return m_; }
  const MatD& centered_rows() const { return Kc_; }
  MatD residual(const MatD& R) const { return RotatedQuant::residual(Kc_, R, spec_); }

  // Loss at R_K; with dLdR the STE gradient ∂L/∂R_K. A frozen residual [m, d] replaces
  // the quantizer (the surrogate whose exact gradient the STE gradient equals).
  double loss(const MatD& R, MatD* dLdR = nullptr, const MatD* frozen = nullptr) const {
    const RotatedQuant rq = RotatedQuant::forward(Kc_, R, spec_, frozen);
    MatD Khat = rq.recon;
    Khat.rowwise() += mu_.transpose();  // k̂ = x̂·Rᵀ + μ
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
        const Attn at = attend(e, s, Khat.middleRows(s.qrow, m));
        const MatD A = at.pV - e.pV;  // (p̃ − p)·V   [nq, d]
        const MatD AM = A * M_[j];
        const double kl = (e.h - (e.Pq.array() * at.Zq.array()).rowwise().sum().matrix() + at.lse).sum();
        total += wq * kl + wshift * (AM.array() * A.array()).sum();
        if (dLdR && m > 0) {
          // ∂/∂z̃_q: KL gives wq·(p̃ − p); the shift term gives p̃⊙(G·vᵀ − G·(p̃V)) with
          // G = 2·wshift·A·M (softmax backward).
          const MatD G = (2.0 * wshift) * AM;
          const VecD dot = (G.array() * at.pV.array()).rowwise().sum();
          const MatD gp = G * Vq_.middleRows(s.qrow, m).transpose();  // [nq, m]
          const MatD dz = wq * (at.Pq - e.Pq) + (at.Pq.array() * (gp.colwise() - dot).array()).matrix();
          GK.middleRows(s.qrow, m).noalias() += tau_ * dz.transpose() * e.Qw;
        }
      }
    }
    if (dLdR) *dLdR = rq.grad_R(Kc_, R, GK);
    return total;
  }

  // p̃ restricted to the quantized columns under R_K, one [nq, m] block per
  // (sequence, query head), sequence-major: what the V phase weighs ΔV by.
  std::vector<MatD> quantized_probs(const MatD& R) const {
    const RotatedQuant rq = RotatedQuant::forward(Kc_, R, spec_);
    MatD Khat = rq.recon;
    Khat.rowwise() += mu_.transpose();
    std::vector<MatD> out;
    std::size_t e_idx = 0;
    for (const detail::SeqWin& s : win_)
      for (int j = 0; j < g_; ++j, ++e_idx)
        out.push_back(attend(exact_[e_idx], s, Khat.middleRows(s.qrow, s.qe - s.qb)).Pq);
    return out;
  }

  const std::vector<detail::SeqWin>& windows() const { return win_; }
  int query_total() const { return nq_total_; }

 private:
  // What the exact columns contribute, per (sequence, query head). Row i is query
  // position len − nq + i; it sees tokens [0, len − nq + i].
  struct Exact {
    MatD Qw;    // [nq, d] queries
    VecD c;     // [nq] max exact visible logit (0 when none is visible)
    VecD sx;    // [nq] Σ_exact exp(z − c)
    MatD Ex;    // [nq, d] Σ_exact exp(z − c)·v
    VecD h;     // [nq] Σ p·log p − Σ_exact p·z
    MatD Pq;    // [nq, m] exact p on the quantized columns (0 where masked)
    MatD pV;    // [nq, d] exact p·V
    MatD mask;  // [nq, m] 1 where the quantized column is visible
  };
  struct Attn {
    MatD Zq;   // [nq, m] quantized-key logits (0 where masked)
    MatD Pq;   // [nq, m] p̃ on quantized columns (0 where masked)
    VecD lse;  // [nq] log-normalizer of p̃
    MatD pV;   // [nq, d] p̃·V
  };

  static int visible(const detail::SeqWin& s, int i) { return s.len - s.nq + i + 1; }

  Exact precompute(const HeadData& hd, const detail::SeqWin& s, int j) const {
    Exact e;
    const int m = s.qe - s.qb;
    e.Qw = hd.Q[j].middleRows(s.begin + s.len - s.nq, s.nq);
    const MatD Ks = hd.K.middleRows(s.begin, s.len), Vs = hd.V.middleRows(s.begin, s.len);
    const MatD Z = tau_ * e.Qw * Ks.transpose();  // [nq, len]
    e.c = VecD::Zero(s.nq);
    e.sx = VecD::Zero(s.nq);
    e.h = VecD::Zero(s.nq);
    e.Ex = MatD::Zero(s.nq, d_);
    e.Pq = MatD::Zero(s.nq, m);
    e.mask = MatD::Zero(s.nq, m);
    const MatD P = [&] {
      MatD p = MatD::Zero(s.nq, s.len);
      for (int i = 0; i < s.nq; ++i) {
        const int n = visible(s, i);
        const double mx = Z.row(i).head(n).maxCoeff();
        p.row(i).head(n) = (Z.row(i).head(n).array() - mx).exp();
        p.row(i) /= p.row(i).sum();
      }
      return p;
    }();
    e.pV = P * Vs;
    for (int i = 0; i < s.nq; ++i) {
      const int n = visible(s, i);
      double c = -std::numeric_limits<double>::infinity();
      for (int t = 0; t < n; ++t)
        if (t < s.qb || t >= s.qe) c = std::max(c, Z(i, t));
      if (!std::isfinite(c)) c = 0;  // no exact column visible: sx stays 0
      e.c[i] = c;
      for (int t = 0; t < n; ++t) {
        const double pl = P(i, t) > 0 ? P(i, t) * std::log(P(i, t)) : 0.0;
        e.h[i] += pl;
        if (t >= s.qb && t < s.qe) {
          e.Pq(i, t - s.qb) = P(i, t);
          e.mask(i, t - s.qb) = 1;
        } else {
          const double w = std::exp(Z(i, t) - c);
          e.sx[i] += w;
          e.Ex.row(i) += w * Vs.row(t);
          e.h[i] -= P(i, t) * Z(i, t);
        }
      }
    }
    return e;
  }

  // Attention with the quantized keys Khat_q [m, d] in the quantized columns.
  Attn attend(const Exact& e, const detail::SeqWin& s, const Eigen::Ref<const MatD>& Khat_q) const {
    const int m = s.qe - s.qb;
    Attn a;
    a.Zq = m > 0 ? MatD(tau_ * e.Qw * Khat_q.transpose()) : MatD::Zero(s.nq, 0);
    a.Pq = MatD::Zero(s.nq, m);
    a.lse = VecD::Zero(s.nq);
    a.pV = MatD::Zero(s.nq, d_);
    for (int i = 0; i < s.nq; ++i) {
      const bool has_exact = e.sx[i] > 0;
      double mx = has_exact ? e.c[i] : -std::numeric_limits<double>::infinity();
      for (int t = 0; t < m; ++t)
        if (e.mask(i, t) > 0) mx = std::max(mx, a.Zq(i, t));
      double total = has_exact ? e.sx[i] * std::exp(e.c[i] - mx) : 0.0;
      for (int t = 0; t < m; ++t)
        if (e.mask(i, t) > 0) {
          a.Pq(i, t) = std::exp(a.Zq(i, t) - mx);
          total += a.Pq(i, t);
        } else {
          a.Zq(i, t) = 0;
        }
      a.lse[i] = mx + std::log(total);
      a.Pq.row(i) /= total;
      if (has_exact) a.pV.row(i) = std::exp(e.c[i] - a.lse[i]) * e.Ex.row(i);
    }
    if (m > 0) a.pV.noalias() += a.Pq * Vq_.middleRows(s.qrow, m);
    return a;
  }

  VecD mu_;
  QuantSpec spec_;
  OptRConfig cfg_;
  int d_ = 0, g_ = 0, m_ = 0, nq_total_ = 0;
  double tau_ = 0, D_ = 1;
  std::vector<detail::SeqWin> win_;
  MatD Kc_, Vq_;  // [m, d] centered quantized keys, their values
  std::vector<MatD> M_;
  std::vector<Exact> exact_;
};

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
    for (int j = 0; j < g_; ++j) M_[j] = hd.W[j].transpose() * hd.W[j];
    P_ = kphase.quantized_probs(RK);
    w_ = 1.0 / (g_ * static_cast<double>(kphase.query_total()) * static_cast<double>(hd.W[0].rows()));
  }

  MatD residual(const MatD& R) const { return RotatedQuant::residual(Vc_, R, spec_); }

  double loss(const MatD& R, MatD* dLdR = nullptr, const MatD* frozen = nullptr) const {
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
        const MatD B = P_[idx] * dV.middleRows(s.qrow, m);  // p̃·ΔV   [nq, d]
        const MatD BM = B * M_[j];
        total += w_ * (BM.array() * B.array()).sum();
        if (dLdR) G.middleRows(s.qrow, m).noalias() += (2.0 * w_) * P_[idx].transpose() * BM;
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

// Outcome of optimizing one rotation.
struct RotationFit {
  MatD R;                  // the rotation to deploy (learned if kept, else R0)
  bool kept = false;       // learned R beat the base by the margin on held-out data
  double base_loss = 0;    // held-out loss at R0
  double best_loss = 0;    // best held-out loss seen (at R0 if nothing beat it)
  int best_step = 0;       // step of best_loss (0 = base)
  std::vector<double> train_trace;  // training loss per step
};

// Adam over the generator, held-out selection every eval_every steps and at the end.
//   train(R, &dLdR) → loss;   heldout(R) → loss
inline RotationFit optimize_rotation(const MatD& R0,
                                     const std::function<double(const MatD&, MatD*)>& train,
                                     const std::function<double(const MatD&)>& heldout,
                                     const OptRConfig& cfg) {
  const Eigen::Index d = R0.rows();
  RotationFit fit;
  fit.base_loss = heldout(R0);
  fit.best_loss = fit.base_loss;
  MatD bestR = R0;
  MatD A = MatD::Zero(d, d), m1 = MatD::Zero(d, d), m2 = MatD::Zero(d, d);
  MatD Rcur = R0;  // riemannian: the current point
  double b1t = 1, b2t = 1;
  for (int step = 1; step <= cfg.steps; ++step) {
    const MatD R = cfg.param == Parameterization::exp_map ? rotation_from_generator(R0, A) : Rcur;
    MatD dR;
    const double l = train(R, &dR);
    fit.train_trace.push_back(l);
    if (!std::isfinite(l) || !dR.allFinite())
      throw Error(StatusCode::invalid_argument, "calib: non-finite loss or gradient (check the inputs)");
    const MatD gA = cfg.param == Parameterization::exp_map ? generator_gradient(R0, A, dR)
                                                          : generator_gradient(Rcur, MatD::Zero(d, d), dR);
    m1 = cfg.beta1 * m1 + (1 - cfg.beta1) * gA;
    m2 = cfg.beta2 * m2 + (1 - cfg.beta2) * gA.cwiseAbs2();
    b1t *= cfg.beta1;
    b2t *= cfg.beta2;
    const double lr = cfg.cosine_lr ? 0.5 * cfg.lr * (1 + std::cos(std::numbers::pi * (step - 1) / cfg.steps)) : cfg.lr;
    const MatD delta = -lr * ((m1 / (1 - b1t)).array() /
                                  ((m2 / (1 - b2t)).array().sqrt() + cfg.adam_eps)).matrix();
    if (cfg.param == Parameterization::exp_map) {
      A += delta;
    } else {
      Rcur = Rcur * expm(skew(delta));
    }
    if (step % cfg.eval_every == 0 || step == cfg.steps) {
      const MatD Rn = cfg.param == Parameterization::exp_map ? rotation_from_generator(R0, A) : Rcur;
      const double h = heldout(Rn);
      if (h < fit.best_loss) {
        fit.best_loss = h;
        fit.best_step = step;
        bestR = Rn;
      }
    }
  }
  fit.kept = fit.best_step > 0 && fit.best_loss < fit.base_loss * (1.0 - cfg.margin);
  fit.R = fit.kept ? bestR : R0;
  if (!fit.kept) fit.best_loss = std::min(fit.best_loss, fit.base_loss);
  return fit;
}

// Calibration result of one KV head.
struct HeadResult {
  MatD RK, RV;          // [d, d] deployed rotations (x ↦ x·R)
  MatD RK0, RV0;        // [d, d] base rotations
  VecD mu_k, nu_v;      // [d] key mean (zeros unless centered), value mean (zeros unless centered)
  RotationFit k, v;     // losses, kept flags, traces (R fields duplicate RK/RV)
};

// Base rotation of one head for keys or values.
inline MatD base_rotation(BaseKind kind, int d, const MatD& C) {
  switch (kind) {
    case BaseKind::identity: return MatD::Identity(d, d);
    case BaseKind::hadamard: return hadamard_rotation(d);
    case BaseKind::covariance: return covariance_base(C);
  }
  return MatD::Identity(d, d);
}

// Calibrates one KV head: train on `train`, select on `held`.
inline HeadResult calibrate_head(const HeadData& train, const HeadData& held, const Policy& policy,
                                 const OptRConfig& cfg) {
  const int d = train.head_dim();
  if (d != policy.head_dim)
    throw Error(StatusCode::invalid_argument, "calib: activations have head_dim " + std::to_string(d) +
                                                  " but the policy has " + std::to_string(policy.head_dim));
  HeadResult r;
  r.mu_k = policy.key.centered ? VecD(train.K.colwise().mean().transpose()) : VecD(VecD::Zero(d));
  r.nu_v = policy.value.centered ? VecD(train.V.colwise().mean().transpose()) : VecD(VecD::Zero(d));
  MatD CQ, CV;
  if (cfg.base == BaseKind::covariance) {
    CQ = query_covariance(train.Q);
    CV = value_covariance(train.K, train.V, CQ);
  }
  r.RK0 = base_rotation(cfg.base, d, CQ);
  r.RV0 = base_rotation(cfg.base, d, CV);

  const KPhase ktrain(train, r.mu_k, policy.key, cfg), kheld(held, r.mu_k, policy.key, cfg);
  r.k = optimize_rotation(
      r.RK0, [&](const MatD& R, MatD* g) { return ktrain.loss(R, g); },
      [&](const MatD& R) { return kheld.loss(R); }, cfg);
  r.RK = r.k.R;

  const VPhase vtrain(train, r.nu_v, policy.value, cfg, ktrain, r.RK);
  const VPhase vheld(held, r.nu_v, policy.value, cfg, kheld, r.RK);
  r.v = optimize_rotation(
      r.RV0, [&](const MatD& R, MatD* g) { return vtrain.loss(R, g); },
      [&](const MatD& R) { return vheld.loss(R); }, cfg);
  r.RV = r.v.R;
  return r;
}

struct LayerResult {
  int layer = 0;
  std::vector<HeadResult> heads;  // [Hkv]
  double seconds = 0;             // wall time of this layer's heads
};

// Number of held-out sequences for n_seq sequences.
inline int heldout_count(int n_seq, const OptRConfig& cfg) {
  if (n_seq < 2)
    throw Error(StatusCode::invalid_argument,
                "calib: at least two sequences are needed (one is held out); split long sequences "
                "with split_sequences()");
  const int h = static_cast<int>(std::lround(n_seq * cfg.heldout_fraction));
  return std::clamp(h, 1, n_seq - 1);
}

// Cuts every sequence into chunks of at most max_len tokens (the last chunk of a
// sequence may be shorter). Keys stay post-RoPE, so a chunk is a valid attention
// problem with relative positions preserved.
inline void split_sequences(LayerActivations& a, int max_len) {
  if (max_len <= 0) throw Error(StatusCode::invalid_argument, "calib: chunk length must be > 0");
  std::vector<std::int64_t> out{0};
  for (int s = 0; s < a.n_seq(); ++s)
    for (std::int64_t t = a.seq_offsets[s]; t < a.seq_offsets[s + 1]; t += max_len)
      out.push_back(std::min<std::int64_t>(t + max_len, a.seq_offsets[s + 1]));
  a.seq_offsets = std::move(out);
}

// Calibrates all layers; OpenMP over every (layer, head) pair. `progress` (may be
// empty) is called once per finished layer, serialized.
inline std::vector<LayerResult> calibrate(const std::vector<LayerActivations>& layers, const Policy& policy,
                                          const OptRConfig& cfg,
                                          const std::function<void(const LayerResult&)>& progress = {}) {
  cfg.validate();
  if (!is_valid_policy(policy)) throw Error(StatusCode::invalid_argument, "calib: invalid policy");
  std::vector<LayerResult> out(layers.size());
  std::vector<std::pair<int, int>> jobs;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    layers[l].validate();
    if (layers[l].head_dim != policy.head_dim)
      throw Error(StatusCode::invalid_argument,
                  "calib: layer " + std::to_string(layers[l].layer) + " has head_dim " +
                      std::to_string(layers[l].head_dim) + " but the policy has " +
                      std::to_string(policy.head_dim));
    (void)heldout_count(layers[l].n_seq(), cfg);  // fail before any work starts
    out[l].layer = layers[l].layer;
    out[l].heads.resize(layers[l].hkv);
    for (int h = 0; h < layers[l].hkv; ++h) jobs.emplace_back(static_cast<int>(l), h);
  }
  std::vector<int> remaining(layers.size());
  std::vector<std::chrono::steady_clock::time_point> started(layers.size(), std::chrono::steady_clock::now());
  for (std::size_t l = 0; l < layers.size(); ++l) remaining[l] = layers[l].hkv;
  std::string first_error;
  bool failed = false;
KVQ_CALIB_OMP(parallel for schedule(dynamic, 1))
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    const auto [l, h] = jobs[i];
    try {
      const LayerActivations& a = layers[l];
      const int nh = heldout_count(a.n_seq(), cfg);
      const HeadData train = extract_head(a, h, 0, a.n_seq() - nh);
      const HeadData held = extract_head(a, h, a.n_seq() - nh, a.n_seq());
      HeadResult r = calibrate_head(train, held, policy, cfg);
KVQ_CALIB_OMP(critical(kvq_calib_progress))
      {
        out[l].heads[h] = std::move(r);
        if (--remaining[l] == 0) {
          out[l].seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started[l]).count();
          if (progress) progress(out[l]);
        }
      }
    } catch (const std::exception& e) {
KVQ_CALIB_OMP(critical(kvq_calib_progress))
      {
        if (!failed) first_error = e.what();
        failed = true;
      }
    }
  }
  if (failed) throw Error(StatusCode::invalid_argument, first_error);
  return out;
}

}  // namespace kvq::calib
