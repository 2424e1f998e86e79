// kvq/calib/optr/adam.hpp — Adam on the rotation's generator with held-out selection:
// the optimizer of both phases.
#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <numbers>
#include <vector>

#include "kvq/calib/optr/config.hpp"
#include "kvq/calib/skew_exp.hpp"
#include "kvq/core/status.hpp"

namespace kvq::calib {

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
    for (Eigen::Index i = 0; i < d; ++i)
      for (Eigen::Index j = 0; j < d; ++j) {
        m1(i, j) = dmul(cfg.beta1, m1(i, j)) + dmul(1 - cfg.beta1, gA(i, j));
        m2(i, j) = dmul(cfg.beta2, m2(i, j)) + dmul(1 - cfg.beta2, dmul(gA(i, j), gA(i, j)));
      }
    b1t *= cfg.beta1;
    b2t *= cfg.beta2;
    const double lr = cfg.cosine_lr ? 0.5 * cfg.lr * (1 + std::cos(std::numbers::pi * (step - 1) / cfg.steps)) : cfg.lr;
    // Scalar loops, not Eigen array expressions: Eigen's AVX-512 packet sqrt is an
    // approximation under EIGEN_FAST_MATH, std::sqrt is correctly rounded everywhere.
    MatD delta(d, d);
    for (Eigen::Index i = 0; i < d; ++i)
      for (Eigen::Index j = 0; j < d; ++j)
        delta(i, j) = -lr * ((m1(i, j) / (1 - b1t)) / (std::sqrt(m2(i, j) / (1 - b2t)) + cfg.adam_eps));
    if (cfg.param == Parameterization::exp_map) {
      A += delta;
    } else {
      Rcur = mm(Rcur, expm(skew(delta)));
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

}  // namespace kvq::calib
