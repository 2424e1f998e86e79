// kvq/calib/fixed_order.hpp — fp64 products and sums whose bits do not depend on the ISA
// the calibration is compiled for (DESIGN §6.3, determinism).
//
// Eighty Adam steps through a rounding quantizer amplify last-bit differences into other
// trajectories, so OptR's arithmetic must be the same operations in the same order on
// every build. Two things break that in general-purpose fp64 code:
//  - contraction: with FMA in the target (-march=haswell and later) and GCC's default
//    -ffp-contract=fast, a*b + c may be fused into one rounding;
//  - reduction order: vectorized GEMM kernels and sums (Eigen's) split a dot product into
//    as many partial sums as the packet has lanes.
// Here every product is rounded on its own (`dmul`), every sum runs over its index in
// ascending order, and GEMMs vectorize across output columns only, so one output element
// is the same sequence of roundings whatever the vector width. That makes run-time
// dispatch safe: the AVX-512, AVX2 and SSE2 kernels (chosen by the CPU, not the build
// flags) return identical bits, which tests/calib checks against a scalar reference.
//
// Matrices are kvq::calib::MatD (row-major fp64). Calibration is offline, so these
// helpers allocate their results.
#pragma once

#include <cstddef>

#include <Eigen/Core>

#include "kvq/core/config.hpp"
#include "kvq/core/status.hpp"

namespace kvq::calib {

using MatD = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using VecD = Eigen::VectorXd;

// a·b rounded to fp64 before anything else may see it (the fp64 twin of kvq::mul_rn): no
// later add can be fused with it.
inline double dmul(double a, double b) {
  double p = a * b;
  ::kvq::detail::materialize(p);
  return p;
}

// Which GEMM kernel runs. `automatic` takes the widest the CPU supports; the others exist
// so that tests can compare every kernel with the scalar one (an unsupported choice
// falls back to `scalar`). All of them return the same bits.
enum class GemmKernel { automatic, scalar, sse2, avx2, avx512 };

namespace detail {

// Row-major operand view: element (i, k) at data[i·row_stride + k·col_stride].
struct DView {
  const double* data;
  std::ptrdiff_t row_stride, col_stride;
  double operator()(std::ptrdiff_t i, std::ptrdiff_t k) const { return data[i * row_stride + k * col_stride]; }
};

// C[i, j] = Σ_k A(i, k)·B[k, j] for i in [i0, i0 + R), j in [j0, N): k ascending from
// +0, each product rounded (dmul) before its add. B is row-major with unit column stride.
inline void gemm_rows_scalar(const DView& A, const double* B, std::ptrdiff_t ldb, double* C, std::ptrdiff_t ldc,
                             std::ptrdiff_t i0, std::ptrdiff_t rows, std::ptrdiff_t j0, std::ptrdiff_t N,
                             std::ptrdiff_t K) {
  for (std::ptrdiff_t i = i0; i < i0 + rows; ++i)
    for (std::ptrdiff_t j = j0; j < N; ++j) {
      double acc = 0.0;
      for (std::ptrdiff_t k = 0; k < K; ++k) acc += dmul(A(i, k), B[k * ldb + j]);
      C[i * ldc + j] = acc;
    }
}

#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
#define KVQ_CALIB_X86_KERNELS 1

// R rows × NV vectors of W lanes of C, starting at (i, j), over k in [k0, k1): R·NV
// accumulators, per k NV loads of B and R broadcasts of A. The accumulators start from
// +0 when k0 = 0 and from C otherwise (a stored double reloads exactly, so splitting K
// keeps one ascending sum). Each lane performs exactly the scalar kernel's roundings.
// The accumulators live in registers only if the r and v loops are unrolled (KVQ_UNROLL):
// GCC 12 at -O2, the Release flags, keeps them on the stack otherwise (6.6 instead of
// 10 GFLOP/s on Zen 1's AVX2).
template <int W, int R, int NV>
__attribute__((always_inline)) inline void gemm_block(const DView& A, const double* B, std::ptrdiff_t ldb,
                                                      double* C, std::ptrdiff_t ldc, std::ptrdiff_t i,
                                                      std::ptrdiff_t j, std::ptrdiff_t k0, std::ptrdiff_t k1) {
  typedef double V __attribute__((vector_size(W * 8), aligned(8), may_alias));
  V acc[R][NV] = {};
  if (k0 > 0)
    KVQ_UNROLL for (int r = 0; r < R; ++r)
      KVQ_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = *reinterpret_cast<const V*>(C + (i + r) * ldc + j + v * W);
  for (std::ptrdiff_t k = k0; k < k1; ++k) {
    V b[NV];
    KVQ_UNROLL for (int v = 0; v < NV; ++v) b[v] = *reinterpret_cast<const V*>(B + k * ldb + j + v * W);
    KVQ_UNROLL for (int r = 0; r < R; ++r) {
      const double a = A(i + r, k);
      KVQ_UNROLL for (int v = 0; v < NV; ++v) {
        V p = b[v] * a;
        __asm__("" : "+x"(p));  // no fusion with the add
        acc[r][v] += p;
      }
    }
  }
  KVQ_UNROLL for (int r = 0; r < R; ++r)
    KVQ_UNROLL for (int v = 0; v < NV; ++v) *reinterpret_cast<V*>(C + (i + r) * ldc + j + v * W) = acc[r][v];
}

// The vector kernel for W fp64 lanes, blocked as GotoBLAS is (without packing): chunks
// of kMc rows × kKc of K keep A's chunk in L2 and one panel of B (kKc × NV·W) in L1 while
// every block of R rows of the chunk passes over it; columns past the last panel go a
// vector at a time, 4 rows at once. Inlined into the target-specific wrappers below,
// which choose the instructions and the block: 8 rows × 2 vectors with AVX-512's 32
// registers; with AVX2's 16, 2 rows × 4 vectors (one broadcast per 4 products: 13.2
// against 12.1 GFLOP/s for 4 × 2 from L1 on Zen 1).
template <int W, int R, int NV>
__attribute__((always_inline)) inline void gemm_vector(const DView& A, const double* B, std::ptrdiff_t ldb,
                                                       double* C, std::ptrdiff_t ldc, std::ptrdiff_t M,
                                                       std::ptrdiff_t N, std::ptrdiff_t K) {
  constexpr int kCols = NV * W;
  constexpr std::ptrdiff_t kMc = 64, kKc = 256;
  for (std::ptrdiff_t i0 = 0; i0 < M; i0 += kMc) {
    const std::ptrdiff_t i1 = i0 + kMc < M ? i0 + kMc : M;
    for (std::ptrdiff_t k0 = 0; k0 < K; k0 += kKc) {
      const std::ptrdiff_t k1 = k0 + kKc < K ? k0 + kKc : K;
      std::ptrdiff_t j = 0;
      for (; j + kCols <= N; j += kCols) {
        std::ptrdiff_t i = i0;
        for (; i + R <= i1; i += R) gemm_block<W, R, NV>(A, B, ldb, C, ldc, i, j, k0, k1);
        for (; i < i1; ++i) gemm_block<W, 1, NV>(A, B, ldb, C, ldc, i, j, k0, k1);
      }
      for (; j + W <= N; j += W) {
        std::ptrdiff_t i = i0;
        for (; i + 4 <= i1; i += 4) gemm_block<W, 4, 1>(A, B, ldb, C, ldc, i, j, k0, k1);
        for (; i < i1; ++i) gemm_block<W, 1, 1>(A, B, ldb, C, ldc, i, j, k0, k1);
      }
    }
    // Columns left over from the vectors: the scalar kernel, whole K at once.
    const std::ptrdiff_t j_tail = N - N % W;
    if (j_tail < N) gemm_rows_scalar(A, B, ldb, C, ldc, i0, i1 - i0, j_tail, N, K);
  }
}

__attribute__((target("avx512f"))) inline void gemm_avx512(const DView& A, const double* B, std::ptrdiff_t ldb,
                                                           double* C, std::ptrdiff_t ldc, std::ptrdiff_t M,
                                                           std::ptrdiff_t N, std::ptrdiff_t K) {
  gemm_vector<8, 8, 2>(A, B, ldb, C, ldc, M, N, K);
}
__attribute__((target("avx2"))) inline void gemm_avx2(const DView& A, const double* B, std::ptrdiff_t ldb,
                                                      double* C, std::ptrdiff_t ldc, std::ptrdiff_t M,
                                                      std::ptrdiff_t N, std::ptrdiff_t K) {
  gemm_vector<4, 2, 4>(A, B, ldb, C, ldc, M, N, K);
}
inline void gemm_sse2(const DView& A, const double* B, std::ptrdiff_t ldb, double* C, std::ptrdiff_t ldc,
                      std::ptrdiff_t M, std::ptrdiff_t N, std::ptrdiff_t K) {
  gemm_vector<2, 4, 2>(A, B, ldb, C, ldc, M, N, K);
}

inline GemmKernel widest_gemm_kernel() {
  static const GemmKernel k = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return GemmKernel::avx512;
    if (__builtin_cpu_supports("avx2")) return GemmKernel::avx2;
    return GemmKernel::sse2;
  }();
  return k;
}
#else
#define KVQ_CALIB_X86_KERNELS 0
inline GemmKernel widest_gemm_kernel() { return GemmKernel::scalar; }
#endif

// C [M, N] = A·B with B [K, N] row-major, unit column stride.
inline void gemm_dispatch(GemmKernel kernel, const DView& A, const double* B, std::ptrdiff_t ldb, double* C,
                          std::ptrdiff_t ldc, std::ptrdiff_t M, std::ptrdiff_t N, std::ptrdiff_t K) {
  if (kernel == GemmKernel::automatic) kernel = widest_gemm_kernel();
#if KVQ_CALIB_X86_KERNELS
  const GemmKernel widest = widest_gemm_kernel();
  const bool supported = kernel == GemmKernel::sse2 ||
                         (kernel == GemmKernel::avx2 && widest != GemmKernel::sse2) ||
                         (kernel == GemmKernel::avx512 && widest == GemmKernel::avx512);
  if (supported) {
    switch (kernel) {
      case GemmKernel::avx512: return gemm_avx512(A, B, ldb, C, ldc, M, N, K);
      case GemmKernel::avx2: return gemm_avx2(A, B, ldb, C, ldc, M, N, K);
      case GemmKernel::sse2: return gemm_sse2(A, B, ldb, C, ldc, M, N, K);
      default: break;
    }
  }
#endif
  gemm_rows_scalar(A, B, ldb, C, ldc, 0, M, 0, N, K);
}

// Xᵀ by 8 × 8 tiles (a plain transposed copy writes one cache line per element).
inline MatD transposed(const Eigen::Ref<const MatD>& X) {
  const Eigen::Index R = X.rows(), C = X.cols();
  MatD T(C, R);
  for (Eigen::Index r0 = 0; r0 < R; r0 += 8)
    for (Eigen::Index c0 = 0; c0 < C; c0 += 8)
      for (Eigen::Index r = r0; r < r0 + 8 && r < R; ++r)
        for (Eigen::Index c = c0; c < c0 + 8 && c < C; ++c) T(c, r) = X(r, c);
  return T;
}

}  // namespace detail

enum class Trans { none, transpose };

// C = op(A)·op(B), each element Σ_k in ascending k with every product rounded on its own.
//   op(A): [M, K], op(B): [K, N], C: [M, N] (a block of a larger matrix is fine)
inline void gemm_into(const Eigen::Ref<const MatD>& A, Trans ta, const Eigen::Ref<const MatD>& B, Trans tb,
                      Eigen::Ref<MatD> C, GemmKernel kernel = GemmKernel::automatic) {
  const std::ptrdiff_t M = ta == Trans::none ? A.rows() : A.cols(), K = ta == Trans::none ? A.cols() : A.rows();
  const std::ptrdiff_t KB = tb == Trans::none ? B.rows() : B.cols(), N = tb == Trans::none ? B.cols() : B.rows();
  if (K != KB) throw Error(StatusCode::invalid_argument, "calib: gemm inner dimensions differ");
  if (C.rows() != M || C.cols() != N) throw Error(StatusCode::invalid_argument, "calib: gemm output has the wrong shape");
  if (M == 0 || N == 0) return;
  if (K == 0) {
    C.setZero();
    return;
  }
  const detail::DView a{A.data(), ta == Trans::none ? A.outerStride() : 1,
                        ta == Trans::none ? 1 : A.outerStride()};
  // The kernels read B row by row with unit stride: a transposed B is copied once (no
  // arithmetic, so the order of the sums is unchanged).
  MatD Bt;
  const double* b = B.data();
  std::ptrdiff_t ldb = B.outerStride();
  if (tb == Trans::transpose) {
    Bt = detail::transposed(B);
    b = Bt.data();
    ldb = Bt.outerStride();
  }
  detail::gemm_dispatch(kernel, a, b, ldb, C.data(), C.outerStride(), M, N, K);
}

// op(A)·op(B) as a new matrix (gemm_into's order).
inline MatD gemm(const Eigen::Ref<const MatD>& A, Trans ta, const Eigen::Ref<const MatD>& B, Trans tb,
                 GemmKernel kernel = GemmKernel::automatic) {
  MatD C(ta == Trans::none ? A.rows() : A.cols(), tb == Trans::none ? B.cols() : B.rows());
  gemm_into(A, ta, B, tb, C, kernel);
  return C;
}

inline MatD mm(const Eigen::Ref<const MatD>& A, const Eigen::Ref<const MatD>& B) {
  return gemm(A, Trans::none, B, Trans::none);
}
inline MatD mm_nt(const Eigen::Ref<const MatD>& A, const Eigen::Ref<const MatD>& B) {
  return gemm(A, Trans::none, B, Trans::transpose);
}
inline MatD mm_tn(const Eigen::Ref<const MatD>& A, const Eigen::Ref<const MatD>& B) {
  return gemm(A, Trans::transpose, B, Trans::none);
}

// Y += α·X elementwise (each α·x rounded before the add).   X, Y: same shape
inline void add_scaled(double alpha, const Eigen::Ref<const MatD>& X, Eigen::Ref<MatD> Y) {
  for (Eigen::Index i = 0; i < X.rows(); ++i)
    for (Eigen::Index j = 0; j < X.cols(); ++j) Y(i, j) += dmul(alpha, X(i, j));
}

// Σ_ij X∘Y, row-major order.
inline double sum_product(const Eigen::Ref<const MatD>& X, const Eigen::Ref<const MatD>& Y) {
  double s = 0;
  for (Eigen::Index i = 0; i < X.rows(); ++i)
    for (Eigen::Index j = 0; j < X.cols(); ++j) s += dmul(X(i, j), Y(i, j));
  return s;
}

// Σ_j X(i, j)·Y(i, j) for one row i.
inline double row_dot(const Eigen::Ref<const MatD>& X, const Eigen::Ref<const MatD>& Y, Eigen::Index i) {
  double s = 0;
  for (Eigen::Index j = 0; j < X.cols(); ++j) s += dmul(X(i, j), Y(i, j));
  return s;
}

// Column means of X [L, d], each summed over rows in order.
inline VecD column_means(const MatD& X) {
  VecD m = VecD::Zero(X.cols());
  for (Eigen::Index i = 0; i < X.rows(); ++i)
    for (Eigen::Index j = 0; j < X.cols(); ++j) m[j] += X(i, j);
  if (X.rows() > 0) m /= static_cast<double>(X.rows());
  return m;
}

}  // namespace kvq::calib
