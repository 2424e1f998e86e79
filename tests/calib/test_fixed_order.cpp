#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvq/calib/fixed_order.hpp"

using kvq::calib::GemmKernel;
using kvq::calib::MatD;
using kvq::calib::Trans;

namespace {

MatD random_matrix(Eigen::Index rows, Eigen::Index cols, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> N(0, 1);
  MatD A(rows, cols);
  for (Eigen::Index i = 0; i < A.size(); ++i) A.data()[i] = N(rng) * std::ldexp(1.0, static_cast<int>(rng() % 9) - 4);
  return A;
}

const char* name(GemmKernel k) {
  switch (k) {
    case GemmKernel::automatic: return "automatic";
    case GemmKernel::scalar: return "scalar";
    case GemmKernel::sse2: return "sse2";
    case GemmKernel::avx2: return "avx2";
    case GemmKernel::avx512: return "avx512";
  }
  return "?";
}

struct Shape {
  int M, N, K;
};
// Tails in every direction: rows not a multiple of 4, columns not a multiple of 2W for
// any W, and the calibration's own shapes (64 queries × 704 quantized keys, d 64).
const Shape kShapes[] = {{1, 1, 1},   {3, 5, 7},    {4, 16, 2},  {5, 17, 33},  {8, 32, 64},
                         {13, 31, 9}, {64, 64, 64}, {64, 704, 64}, {64, 64, 704}, {7, 130, 3}};

// The order the header promises: Σ_k in ascending k from +0, products rounded on their own.
MatD reference_in_order(const MatD& A, const MatD& B) {
  MatD C(A.rows(), B.cols());
  for (Eigen::Index i = 0; i < A.rows(); ++i)
    for (Eigen::Index j = 0; j < B.cols(); ++j) {
      double acc = 0.0;
      for (Eigen::Index k = 0; k < A.cols(); ++k) acc += kvq::calib::dmul(A(i, k), B(k, j));
      C(i, j) = acc;
    }
  return C;
}

bool same_bits(const MatD& a, const MatD& b) {
  return a.rows() == b.rows() && a.cols() == b.cols() &&
         std::memcmp(a.data(), b.data(), sizeof(double) * static_cast<std::size_t>(a.size())) == 0;
}

TEST(FixedOrder, EveryKernelAndTransposeGivesTheInOrderBits) {
  const GemmKernel widest = kvq::calib::detail::widest_gemm_kernel();
  std::printf("widest GEMM kernel on this CPU: %s\n", name(widest));
  unsigned seed = 1;
  for (const Shape& s : kShapes) {
    const MatD A = random_matrix(s.M, s.K, seed++), B = random_matrix(s.K, s.N, seed++);
    const MatD ref = reference_in_order(A, B);
    for (GemmKernel k : {GemmKernel::scalar, GemmKernel::sse2, GemmKernel::avx2, GemmKernel::avx512,
                         GemmKernel::automatic}) {
      const MatD At = A.transpose(), Bt = B.transpose();
      EXPECT_TRUE(same_bits(kvq::calib::gemm(A, Trans::none, B, Trans::none, k), ref)) << name(k) << " nn " << s.M << "x" << s.N << "x" << s.K;
      EXPECT_TRUE(same_bits(kvq::calib::gemm(At, Trans::transpose, B, Trans::none, k), ref)) << name(k) << " tn";
      EXPECT_TRUE(same_bits(kvq::calib::gemm(A, Trans::none, Bt, Trans::transpose, k), ref)) << name(k) << " nt";
      EXPECT_TRUE(same_bits(kvq::calib::gemm(At, Trans::transpose, Bt, Trans::transpose, k), ref)) << name(k) << " tt";
    }
  }
}

// Against a long-double sum: the error of an in-order fp64 dot product is at most
// γ_K·Σ|a||b| with γ_K = K·u/(1 − K·u).
TEST(FixedOrder, AccuracyWithinTheInOrderBound) {
  const MatD A = random_matrix(37, 700, 11), B = random_matrix(700, 45, 12);
  const MatD C = kvq::calib::mm(A, B);
  const double u = std::ldexp(1.0, -53), gamma = 700 * u / (1 - 700 * u);
  for (Eigen::Index i = 0; i < C.rows(); ++i)
    for (Eigen::Index j = 0; j < C.cols(); ++j) {
      long double exact = 0, absum = 0;
      for (Eigen::Index k = 0; k < A.cols(); ++k) {
        exact += static_cast<long double>(A(i, k)) * B(k, j);
        absum += std::abs(static_cast<long double>(A(i, k)) * B(k, j));
      }
      ASSERT_LE(std::abs(static_cast<long double>(C(i, j)) - exact), gamma * absum) << i << "," << j;
    }
}

// Strided sub-blocks (Eigen::Ref views) and a poisoned output stride: every element of C
// is written and nothing past its row.
TEST(FixedOrder, BlocksAndStridesWriteEveryElementAndNothingElse) {
  const MatD big = random_matrix(40, 90, 21), B = random_matrix(70, 33, 22);
  const auto A = big.block(3, 5, 19, 70);  // outer stride 90
  const MatD ref = reference_in_order(A, B);
  for (GemmKernel k : {GemmKernel::scalar, GemmKernel::sse2, GemmKernel::avx2, GemmKernel::avx512}) {
    const std::ptrdiff_t ldc = 33 + 5;
    std::vector<double> C(19 * ldc, std::numeric_limits<double>::quiet_NaN());
    const kvq::calib::detail::DView a{A.data(), A.outerStride(), 1};
    kvq::calib::detail::gemm_dispatch(k, a, B.data(), B.outerStride(), C.data(), ldc, 19, 33, 70);
    for (int i = 0; i < 19; ++i) {
      for (int j = 0; j < 33; ++j) ASSERT_EQ(C[i * ldc + j], ref(i, j)) << name(k) << " " << i << "," << j;
      for (int j = 33; j < ldc; ++j) ASSERT_TRUE(std::isnan(C[i * ldc + j])) << name(k) << " wrote past row " << i;
    }
  }
}

TEST(FixedOrder, MismatchedShapesAndEmptyProducts) {
  EXPECT_THROW(kvq::calib::mm(MatD::Zero(3, 4), MatD::Zero(5, 2)), kvq::Error);
  MatD wrong(3, 3);
  EXPECT_THROW(kvq::calib::gemm_into(MatD::Zero(3, 4), Trans::none, MatD::Zero(4, 2), Trans::none, wrong), kvq::Error);
  EXPECT_EQ(kvq::calib::mm(MatD::Zero(3, 0), MatD::Zero(0, 2)), MatD::Zero(3, 2));
  EXPECT_EQ(kvq::calib::mm(MatD::Zero(0, 4), MatD::Zero(4, 2)).rows(), 0);
}

// The reductions run in index order: a sum whose value depends on the order.
TEST(FixedOrder, ReductionsRunInIndexOrder) {
  MatD X(1, 3), Y(1, 3);
  X << 1e16, 1.0, -1e16;
  Y << 1.0, 1.0, 1.0;
  EXPECT_EQ(kvq::calib::sum_product(X, Y), 0.0);  // (1e16 + 1) − 1e16 = 0 in order
  EXPECT_EQ(kvq::calib::row_dot(X, Y, 0), 0.0);
  MatD Z(3, 1);
  Z << 1e16, 1.0, -1e16;
  EXPECT_EQ(kvq::calib::column_means(Z)[0], 0.0);
  MatD acc = MatD::Constant(1, 3, 1.0);
  kvq::calib::add_scaled(0.5, X, acc);
  EXPECT_EQ(acc(0, 1), 1.5);
}

}  // namespace
