// kvq/calib/optr/rotated_quant.hpp — the rotated, fake-quantized rows of one head and the
// straight-through estimator of DESIGN §6.3, shared by the K and V phases.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvq/calib/fake_quant.hpp"
#include "kvq/calib/fixed_order.hpp"
#include "kvq/core/policy.hpp"

namespace kvq::calib {

// What the estimator holds fixed at a forward point Y₀ = Xc·R₀ [m, d] (DESIGN §6.3): per
// element, whether it passes the clip (|y| ≤ t, t frozen) or is pinned to ±t, its rounding
// residual δ, and its weight in the group's range hi − lo: +1/|T| on the tie set T of the
// maximum, −1/|T| on that of the minimum, 0 elsewhere, and 0 for an extreme that a
// clipped element shares (it is the frozen ±t) or in a group whose range is below the
// quantizer's 1e-8 floor. The frozen surrogate is then
//   y_c = pass ? y : pinned,   s_g(y) = (range_offset_g + Σ_{i∈g} range_weight_i·y_c,i) / (2^b − 1),
//   x̂ = y_c + δ·s_g
// with range_offset_g making s_g(Y₀) the quantizer's own max(hi − lo, 1e-8)/(2^b − 1). It
// equals the quantizer's output at Y₀ and is linear in Y, so its exact gradient is the
// estimator's gradient: clipped elements get none through their own value, the extremes
// get one through the scale, everything else passes straight through.
struct QuantSte {
  MatD pass, pinned, delta, range_weight;  // [m, d]
  MatD range_offset;                       // [m, d / group]
  int levels = 1;
  int group = 1;
};

// Rows of one head that deployment quantizes, rotated and fake-quantized.
//   Xc: [m, d] centered rows (x − μ);   R: [d, d]
// X̂ = Q(Xc·R), or the frozen surrogate of `ste`; recon = X̂·Rᵀ.
struct RotatedQuant {
  MatD Xhat, recon;
  QuantSte ste;  // the estimator at this point (what freeze() hands to later calls)

  static RotatedQuant forward(const MatD& Xc, const MatD& R, const QuantSpec& spec, const QuantSte* frozen = nullptr) {
    RotatedQuant o;
    const MatD Y = mm(Xc, R);
    if (frozen) {
      o.ste = *frozen;
      o.Xhat = surrogate(Y, o.ste);
    } else {
      o.ste = estimator(Y, spec, &o.Xhat);
    }
    o.recon = mm_nt(o.Xhat, R);
    return o;
  }

  // The estimator frozen at R (the point of the surrogate a finite-difference test takes).
  static QuantSte freeze(const MatD& Xc, const MatD& R, const QuantSpec& spec) { return forward(Xc, R, spec).ste; }

  // ∂L/∂R given G = ∂L/∂recon [m, d]: through Y = Xc·R with the estimator's Jacobian
  // ∂X̂/∂Y, plus the explicit Rᵀ of recon.
  MatD grad_R(const MatD& Xc, const MatD& R, const MatD& G) const {
    return mm_tn(Xc, backward(mm(G, R), ste)) + mm_tn(G, Xhat);
  }

  // ∂L/∂Y from ∂L/∂X̂ (both [m, d]) under the estimator:
  //   ∂L/∂y_i = pass_i·(g_i + range_weight_i/(2^b − 1) · Σ_{j∈group(i)} g_j·δ_j).
  static MatD backward(const MatD& dXhat, const QuantSte& ste) {
    MatD dY(dXhat.rows(), dXhat.cols());
    const int G = ste.group;
    for (Eigen::Index i = 0; i < dXhat.rows(); ++i)
      for (Eigen::Index g0 = 0; g0 < dXhat.cols(); g0 += G) {
        double through_range = 0;
        for (int k = 0; k < G; ++k) through_range += dmul(dXhat(i, g0 + k), ste.delta(i, g0 + k));
        through_range /= ste.levels;
        for (int k = 0; k < G; ++k)
          dY(i, g0 + k) = ste.pass(i, g0 + k) * (dXhat(i, g0 + k) + dmul(ste.range_weight(i, g0 + k), through_range));
      }
    return dY;
  }

  static MatD surrogate(const MatD& Y, const QuantSte& ste) {
    const int G = ste.group;
    MatD out(Y.rows(), Y.cols());
    for (Eigen::Index i = 0; i < Y.rows(); ++i)
      for (Eigen::Index g0 = 0; g0 < Y.cols(); g0 += G) {
        double range = ste.range_offset(i, g0 / G);
        for (int k = 0; k < G; ++k) {
          const double yc = ste.pass(i, g0 + k) != 0 ? Y(i, g0 + k) : ste.pinned(i, g0 + k);
          out(i, g0 + k) = yc;
          range += dmul(ste.range_weight(i, g0 + k), yc);
        }
        const double s = range / ste.levels;
        for (int k = 0; k < G; ++k) out(i, g0 + k) += dmul(ste.delta(i, g0 + k), s);
      }
    return out;
  }

  // The estimator's frozen quantities at Y (see QuantSte), from the same fp32 values,
  // clip threshold and range the quantizer uses; xhat gets the quantizer's output
  // (fake_quant_row, bit-identical to the cache's dequantized values).
  static QuantSte estimator(const MatD& Y, const QuantSpec& spec, MatD* xhat) {
    const int d = static_cast<int>(Y.cols()), G = spec.group;
    if (G <= 0 || d % G != 0) throw Error(StatusCode::invalid_argument, "calib: group must divide d");
    QuantSte e;
    e.levels = (1 << spec.bits) - 1;
    e.group = G;
    e.pass.resize(Y.rows(), d);
    e.pinned.resize(Y.rows(), d);
    e.delta.resize(Y.rows(), d);
    e.range_weight.resize(Y.rows(), d);
    e.range_offset.resize(Y.rows(), d / G);
    xhat->resize(Y.rows(), d);
    std::vector<float> yf(d), xq(d);
    for (Eigen::Index i = 0; i < Y.rows(); ++i) {
      for (int c = 0; c < d; ++c) yf[c] = static_cast<float>(Y(i, c));
      for (int g0 = 0; g0 < d; g0 += G) {
        float t;  // the quantizer's own clip threshold for this group
        fake_quant_group(spec, yf.data() + g0, xq.data() + g0, &t);
        for (int k = 0; k < G; ++k) (*xhat)(i, g0 + k) = xq[g0 + k];
        float hi = -std::numeric_limits<float>::infinity(), lo = std::numeric_limits<float>::infinity();
        for (int k = 0; k < G; ++k) {
          const float v = yf[g0 + k];
          const float vc = v > t ? t : (v < -t ? -t : v);
          e.pass(i, g0 + k) = v > t || v < -t ? 0.0 : 1.0;
          e.pinned(i, g0 + k) = vc;
          hi = std::max(hi, vc);
          lo = std::min(lo, vc);
        }
        // An extreme shared with a clipped element is the frozen ±t itself: no gradient.
        int n_hi = 0, n_lo = 0;
        bool hi_pinned = false, lo_pinned = false;
        for (int k = 0; k < G; ++k) {
          const bool pass = e.pass(i, g0 + k) != 0;
          const float vc = static_cast<float>(e.pinned(i, g0 + k));
          if (vc == hi) {
            n_hi += pass;
            hi_pinned = hi_pinned || !pass;
          }
          if (vc == lo) {
            n_lo += pass;
            lo_pinned = lo_pinned || !pass;
          }
        }
        // The quantizer's max(hi − lo, 1e-8), in fp64.
        const double floor = 1e-8, range0 = std::max(static_cast<double>(hi) - lo, floor);
        const bool floored = !(static_cast<double>(hi) - lo > floor);
        double weighted = 0;
        for (int k = 0; k < G; ++k) {
          const bool pass = e.pass(i, g0 + k) != 0;
          const float vc = static_cast<float>(e.pinned(i, g0 + k));
          double w = 0;
          if (!floored && pass) {
            if (vc == hi && !hi_pinned) w += 1.0 / n_hi;
            if (vc == lo && !lo_pinned) w -= 1.0 / n_lo;
          }
          e.range_weight(i, g0 + k) = w;
          weighted += dmul(w, Y(i, g0 + k));  // w ≠ 0 only where the element passes
        }
        e.range_offset(i, g0 / G) = range0 - weighted;
        const double s = range0 / e.levels;
        for (int k = 0; k < G; ++k) {
          const double yc = e.pass(i, g0 + k) != 0 ? Y(i, g0 + k) : e.pinned(i, g0 + k);
          e.delta(i, g0 + k) = (static_cast<double>(xq[g0 + k]) - yc) / s;
        }
      }
    }
    return e;
  }
};

}  // namespace kvq::calib
