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
#include <unsupported/Eigen/MatrixFunctions>

namespace kvq::calib {

using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using VecD = Eigen::VectorXd;

// S = A − Aᵀ.   A: [d, d]
inline MatD skew(const MatD& A) { return A - A.transpose(); }

// exp(S) by scaling and squaring with Padé approximants (Eigen MatrixFunctions).
// exp(0) is returned as the exact identity so that a zero generator reproduces the
// base rotation bit for bit.
inline MatD expm(const MatD& S) {
  if (S.isZero(0.0)) return MatD::Identity(S.rows(), S.cols());
  return S.exp();
}

// R = R0·exp(A − Aᵀ).   R0, A: [d, d]
inline MatD rotation_from_generator(const MatD& R0, const MatD& A) {
  if (A.isZero(0.0)) return R0;
  return R0 * expm(skew(A));
}

// Adjoint Fréchet derivative of exp at S applied to G: the top-right block of
// exp([[Sᵀ, G], [0, Sᵀ]]).   S, G: [d, d]
inline MatD expm_frechet_adjoint(const MatD& S, const MatD& G) {
  const Eigen::Index d = S.rows();
  MatD B = MatD::Zero(2 * d, 2 * d);
  B.topLeftCorner(d, d) = S.transpose();
  B.bottomRightCorner(d, d) = S.transpose();
  B.topRightCorner(d, d) = G;
  const MatD E = B.exp();
  return E.topRightCorner(d, d);
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
  const MatD G = R0.transpose() * dLdR;
  const MatD S = skew(A);
  // At S = 0 the Fréchet derivative is the identity map (saves a 2d×2d exponential).
  const MatD dS = S.isZero(0.0) ? G : expm_frechet_adjoint(S, G);
  return dS - dS.transpose();
}

// ‖RᵀR − I‖_max: how far R is from orthogonal.
inline double orthogonality_error(const MatD& R) {
  return (R.transpose() * R - MatD::Identity(R.cols(), R.cols())).cwiseAbs().maxCoeff();
}

}  // namespace kvq::calib
