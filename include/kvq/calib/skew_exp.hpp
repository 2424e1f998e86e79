// kvq/calib/skew_exp.hpp — R = R0·exp(A − Aᵀ) and its gradient (DESIGN §6.3).
//
// OptR parameterizes each per-head rotation by an unconstrained A ∈ ℝ^{d×d}; the
// skew generator S = A − Aᵀ keeps exp(S) exactly orthogonal whatever the optimizer
// does. The gradient of a loss through exp is the adjoint Fréchet derivative:
// for G = R0ᵀ·∂L/∂R, ∂L/∂S = L_exp(Sᵀ, G), the top-right d×d block of
// exp([[Sᵀ, G], [0, Sᵀ]]) (Higham, Functions of Matrices, §10.6), and
// ∂L/∂A = ∂L/∂S − (∂L/∂S)ᵀ.
#pragma once

#include <cmath>
#include <complex>

#include <Eigen/Core>
#include <Eigen/Eigenvalues>

#include "kvq/calib/fixed_order.hpp"

namespace kvq::calib {

// S = A − Aᵀ.   A: [d, d]
inline MatD skew(const MatD& A) { return A - A.transpose(); }

namespace detail {

// ‖X‖₁, the largest column sum of |x|, summed in row order.
inline double norm1(const MatD& X) {
  VecD c = VecD::Zero(X.cols());
  for (Eigen::Index i = 0; i < X.rows(); ++i)
    for (Eigen::Index j = 0; j < X.cols(); ++j) c[j] += std::abs(X(i, j));
  return X.cols() > 0 ? c.maxCoeff() : 0.0;
}

// Taylor degree and scaling: with ‖X/2^s‖₁ ≤ 1/4 the degree-12 remainder is at most
// (1/4)^13/13!·e^(1/4) < 4e-18 relative, below fp64's rounding.
inline constexpr int kExpTaylorDegree = 12;
inline int exp_squarings(double norm) {
  if (!std::isfinite(norm)) return 0;  // NaN/Inf propagate through the polynomial
  int s = 0;
  while (norm > 0.25) {
    norm *= 0.5;
    ++s;
  }
  return s;
}

// exp(X) and, when E is given, its Fréchet derivative L(X, E) = d/dt exp(X + tE) at 0,
// by scaling and squaring the degree-12 Taylor polynomial in Horner form:
//   T ← I + X·T/k,  D ← (E·T + X·D)/k   (k = 12 … 1, from T = I, D = 0),
// then s squarings  D ← T·D + D·T,  T ← T·T. Every product is a fixed-order gemm, so
// the result does not depend on the ISA.   X, E: [d, d]
inline MatD expm_pair(const MatD& X_in, const MatD* E_in, MatD* L) {
  const Eigen::Index d = X_in.rows();
  const int s = exp_squarings(norm1(X_in));
  const double scale = std::ldexp(1.0, -s);  // a power of two: exact
  const MatD X = X_in * scale;
  MatD E;
  if (E_in) E = *E_in * scale;
  MatD T = MatD::Identity(d, d), D = MatD::Zero(d, d);
  for (int k = kExpTaylorDegree; k >= 1; --k) {
    if (E_in) {
      MatD dk = mm(E, T) + mm(X, D);
      D = dk / static_cast<double>(k);
    }
    T = mm(X, T) / static_cast<double>(k);
    T.diagonal().array() += 1.0;
  }
  for (int i = 0; i < s; ++i) {
    if (E_in) D = mm(T, D) + mm(D, T);
    T = mm(T, T);
  }
  if (L) *L = D;
  return T;
}

}  // namespace detail

// exp(S) (see detail::expm_pair). exp(0) is the exact identity, so that a zero generator
// reproduces the base rotation bit for bit.
inline MatD expm(const MatD& S) {
  if (S.isZero(0.0)) return MatD::Identity(S.rows(), S.cols());
  return detail::expm_pair(S, nullptr, nullptr);
}

// R = R0·exp(A − Aᵀ).   R0, A: [d, d]
inline MatD rotation_from_generator(const MatD& R0, const MatD& A) {
  if (A.isZero(0.0)) return R0;
  return mm(R0, expm(skew(A)));
}

// Adjoint Fréchet derivative of exp at S applied to G: L_exp(Sᵀ, G), which is the
// top-right block of exp([[Sᵀ, G], [0, Sᵀ]]); computed without the 2d × 2d matrix by
// the paired recurrence of detail::expm_pair.   S, G: [d, d]
inline MatD expm_frechet_adjoint(const MatD& S, const MatD& G) {
  const MatD St = S.transpose();
  MatD L;
  detail::expm_pair(St, &G, &L);
  return L;
}

// The same adjoint for skew S, by diagonalization: iS is Hermitian, iS = U·diag(ν)·U*,
// so Sᵀ = −S = U·diag(iν)·U* and L_exp(Sᵀ, G) = U·(Φ ∘ (U*·G·U))·U* with the divided
// differences Φ_jk = (e^{iν_j} − e^{iν_k})/(iν_j − iν_k) = e^{i(ν_j+ν_k)/2}·sinc((ν_j−ν_k)/2),
// which is stable for close eigenvalues. An independent check of the block exponential
// (tests/calib); not faster with Eigen's complex Hermitian eigensolver at d = 64.
inline MatD expm_frechet_adjoint_skew(const MatD& S, const MatD& G) {
  using C = std::complex<double>;
  using MatC = Eigen::Matrix<C, Eigen::Dynamic, Eigen::Dynamic>;
  const Eigen::Index d = S.rows();
  const MatC H = C(0, 1) * S.cast<C>();
  Eigen::SelfAdjointEigenSolver<MatC> es(H);
  const MatC& U = es.eigenvectors();
  const Eigen::VectorXd& nu = es.eigenvalues();
  MatC X = U.adjoint() * G.cast<C>() * U;
  for (Eigen::Index j = 0; j < d; ++j)
    for (Eigen::Index k = 0; k < d; ++k) {
      const double h = 0.5 * (nu[j] - nu[k]);
      const double sinc = std::abs(h) < 1e-8 ? 1.0 - h * h / 6.0 : std::sin(h) / h;
      X(j, k) *= std::polar(sinc, 0.5 * (nu[j] + nu[k]));
    }
  return (U * X * U.adjoint()).real();
}

// ∂L/∂A for R = R0·exp(A − Aᵀ), given dLdR = ∂L/∂R.   all [d, d]
inline MatD generator_gradient(const MatD& R0, const MatD& A, const MatD& dLdR) {
  const MatD G = mm_tn(R0, dLdR);
  const MatD S = skew(A);
  // At S = 0 the Fréchet derivative is the identity map (saves a 2d×2d exponential).
  const MatD dS = S.isZero(0.0) ? G : expm_frechet_adjoint(S, G);
  return dS - dS.transpose();
}

// ‖RᵀR − I‖_max: how far R is from orthogonal.
inline double orthogonality_error(const MatD& R) {
  return (mm_tn(R, R) - MatD::Identity(R.cols(), R.cols())).cwiseAbs().maxCoeff();
}

}  // namespace kvq::calib
