// kvq/calib/base_rotation.hpp — base rotations R0 that OptR refines (DESIGN §6.2).
//
// Row-vector convention: a rotation maps x ↦ x·R, R: [d, d], RᵀR = I.
//  - Hadamard: D·H/√d (D = optional ±1 diagonal), the normalized Sylvester matrix.
//  - Covariance (OSCAR-style): eigendecompose a per-head second-moment matrix
//    C = U·diag(λ)·Uᵀ and set R0 = U·(H/√d)·P with P = I[:, perm],
//    perm[bitrev(i)] = argsort_desc(λ)[i]. Keys use the query covariance C_Q (the
//    directions queries actually read); values use the score-weighted value
//    covariance C_V = mean_t w_t·v_t·v_tᵀ with w_t = k_tᵀ·C_Q·k_t normalized to mean 1.
//    The moments are fixed-order sums (fixed_order.hpp), but the eigendecomposition is
//    Eigen's, whose reductions follow the packet width: the covariance base is the one
//    part of OptR whose bits may change with ISA flags (Hadamard and identity do not).
#pragma once

#include <algorithm>
#include <bit>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include <Eigen/Eigenvalues>

#include "kvq/calib/fixed_order.hpp"
#include "kvq/calib/skew_exp.hpp"
#include "kvq/core/status.hpp"
#include "kvq/rotation/hadamard.hpp"

namespace kvq::calib {

inline void require_pow2_dim(int d, const char* what) {
  if (d <= 0 || (d & (d - 1)) != 0)
    throw Error(StatusCode::invalid_argument,
                std::string("calib: ") + what + " needs a power-of-two head_dim, got " + std::to_string(d));
}

// Normalized Sylvester Hadamard, optionally preceded by a ±1 diagonal:
// R = diag(signs)·H/√d, H[i][j] = (−1)^popcount(i & j).   signs: [d] or empty.
inline MatD hadamard_rotation(int d, std::span<const int> signs = {}) {
  require_pow2_dim(d, "Hadamard");
  if (!signs.empty() && static_cast<int>(signs.size()) != d)
    throw Error(StatusCode::invalid_argument, "calib: Hadamard sign vector must have d entries");
  const double s = 1.0 / std::sqrt(static_cast<double>(d));
  MatD H(d, d);
  for (int i = 0; i < d; ++i) {
    const double di = signs.empty() ? 1.0 : (signs[i] < 0 ? -1.0 : 1.0);
    for (int j = 0; j < d; ++j)
      H(i, j) = di * ((std::popcount(static_cast<unsigned>(i & j)) & 1) ? -s : s);
  }
  return H;
}

// The run-time Hadamard of a QuantSpec with sign_seed (kvq/rotation/hadamard.hpp) as a
// dense matrix: diag(hadamard_sign(seed, i))·H/√d; seed 0 = no signs.
inline MatD hadamard_rotation_seeded(int d, std::uint32_t seed) {
  if (seed == 0) return hadamard_rotation(d);
  std::vector<int> s(d);
  for (int i = 0; i < d; ++i) s[i] = hadamard_sign(seed, i) < 0.f ? -1 : 1;
  return hadamard_rotation(d, s);
}

// Reverses the low log2(d) bits of i.
inline int bit_reverse(int i, int d) {
  int r = 0;
  for (int b = 1; b < d; b <<= 1, i >>= 1) r = (r << 1) | (i & 1);
  return r;
}

// perm[bitrev(i)] = argsort_desc(λ)[i]: the i-th largest eigen-direction goes to
// position bitrev(i), so the dominant directions are spread evenly over the
// dimension (and hence over quantization groups). Ties keep the lower index first.
inline std::vector<int> bitrev_permutation(const VecD& lambda) {
  const int d = static_cast<int>(lambda.size());
  require_pow2_dim(d, "the bit-reversed permutation");
  std::vector<int> order(d);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return lambda[a] > lambda[b]; });
  std::vector<int> perm(d);
  for (int i = 0; i < d; ++i) perm[bit_reverse(i, d)] = order[i];
  return perm;
}

// R0 = U·(H/√d)·P for the symmetric matrix C: [d, d]. Returns R0 and optionally
// the permutation used (for tests and reports).
inline MatD covariance_base(const MatD& C, std::vector<int>* perm_out = nullptr) {
  const int d = static_cast<int>(C.rows());
  require_pow2_dim(d, "the covariance base");
  if (C.cols() != d) throw Error(StatusCode::invalid_argument, "calib: covariance must be square");
  if (!C.allFinite()) throw Error(StatusCode::invalid_argument, "calib: covariance has non-finite entries");
  const MatD Cs = 0.5 * (C + C.transpose());
  Eigen::SelfAdjointEigenSolver<MatD> es(Cs);
  if (es.info() != Eigen::Success)
    throw Error(StatusCode::invalid_argument, "calib: eigendecomposition did not converge");
  const MatD UH = mm(es.eigenvectors(), hadamard_rotation(d));
  const std::vector<int> perm = bitrev_permutation(es.eigenvalues());
  MatD R0(d, d);
  for (int c = 0; c < d; ++c) R0.col(c) = UH.col(perm[c]);  // ·P with P = I[:, perm]
  if (perm_out) *perm_out = perm;
  return R0;
}

// C_Q = mean over the tokens of all query heads in the group of q·qᵀ.   Q: g × [L, d]
inline MatD query_covariance(const std::vector<MatD>& Q) {
  if (Q.empty()) throw Error(StatusCode::invalid_argument, "calib: no query heads");
  const Eigen::Index d = Q[0].cols();
  MatD C = MatD::Zero(d, d);
  double n = 0;
  for (const MatD& q : Q) {
    C += mm_tn(q, q);
    n += static_cast<double>(q.rows());
  }
  return C / std::max(n, 1.0);
}

// C_V = mean_t w_t·v_t·v_tᵀ, w_t = k_tᵀ·C_Q·k_t normalized to mean 1.   K, V: [L, d]
inline MatD value_covariance(const MatD& K, const MatD& V, const MatD& CQ) {
  const MatD KC = mm(K, CQ);
  VecD w(K.rows());
  double sum = 0;
  for (Eigen::Index t = 0; t < K.rows(); ++t) sum += w[t] = row_dot(KC, K, t);
  const double mean = K.rows() > 0 ? sum / static_cast<double>(K.rows()) : 0.0;
  MatD Vw(V.rows(), V.cols());  // rows w_t/mean · v_t
  for (Eigen::Index t = 0; t < V.rows(); ++t) Vw.row(t) = (mean > 0 ? w[t] / mean : 1.0) * V.row(t);
  return mm_tn(Vw, V) / std::max<double>(1.0, static_cast<double>(V.rows()));
}

}  // namespace kvq::calib
