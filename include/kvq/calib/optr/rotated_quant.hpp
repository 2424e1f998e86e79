// kvq/calib/optr/rotated_quant.hpp — the rotated, fake-quantized rows of one head and their
// straight-through gradient with respect to the rotation, shared by the K and V phases.
#pragma once

#include <vector>

#include "kvq/calib/fake_quant.hpp"
#include "kvq/calib/skew_exp.hpp"
#include "kvq/core/policy.hpp"

namespace kvq::calib {

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

}  // namespace kvq::calib
