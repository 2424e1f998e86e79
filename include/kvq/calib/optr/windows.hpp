// kvq/calib/optr/windows.hpp — which rows of a head OptR quantizes, and which query positions
// its loss uses. Per sequence the first `prefix` tokens stay exact (the sink), and so do the
// `recent` latest tokens of the cache *as each query sees it*: tokens are appended and
// attended `qblock` at a time (a prefill chunk; 1 = token-by-token decode), so the query at
// position p sees quantized keys [prefix, e − recent) with e = p + 1 rounded up to a multiple
// of qblock (at most len, and never past p), as the host cache does. The loss uses `qwin`
// query positions spaced `qstride` apart (0: spread over the positions that see quantized
// keys), the last at the sequence's end. The rows any query sees quantized, [prefix,
// len − recent), are stacked over all sequences.
#pragma once

#include <algorithm>
#include <vector>

#include "kvq/calib/activations.hpp"
#include "kvq/calib/fixed_order.hpp"
#include "kvq/calib/optr/config.hpp"
#include "kvq/calib/skew_exp.hpp"

namespace kvq::calib {

namespace detail {

// Row layout of one sequence inside a head's [L, d] matrices.
struct SeqWin {
  int begin = 0, len = 0;  // token range of the sequence
  int qb = 0, qe = 0;      // rows any query sees quantized: [qb, qe), relative to begin
  int nq = 0;              // query positions
  int qstride = 1;         // their spacing
  int recent = 0;          // exact recent tokens, counted back from the end of each query's block
  int qblock = 1;          // tokens appended and attended at a time
  int qrow = 0;            // first row of this sequence's quantized block in the stacked matrices

  // Position (relative to begin) of query i, 0 ≤ i < nq, ascending.
  int query_pos(int i) const { return len - 1 - (nq - 1 - i) * qstride; }
  // Query i sees tokens [0, visible(i)); of them [qb, quantized_end(i)) quantized.
  int visible(int i) const { return query_pos(i) + 1; }
  int quantized_end(int i) const {
    const int appended = std::min((visible(i) + qblock - 1) / qblock * qblock, len);
    return std::clamp(std::min(appended - recent, visible(i)), qb, qe);  // causal: at most visible(i)
  }
  // Quantized columns query i sees, counted from qb: [0, seen(i)), nondecreasing in i.
  int seen(int i) const { return quantized_end(i) - qb; }
};

// Query rows [r0, r1) of one sequence; the last (and so every) row sees at most the first
// `cols` quantized columns.
struct QueryBand {
  int r0, r1, cols;
};

// The query rows in bands of up to kRows (consecutive bands that see the same columns
// merged), rows and cols ascending. Products over a sequence's [nq, m] probability or
// logit block skip what no row of a band sees: with queries spread over the sequence and
// decoded token by token, that is about half of the block.
inline std::vector<QueryBand> query_bands(const SeqWin& s) {
  constexpr int kRows = 8;
  std::vector<QueryBand> out;
  for (int r0 = 0; r0 < s.nq; r0 += kRows) {
    const int r1 = std::min(r0 + kRows, s.nq), cols = s.seen(r1 - 1);
    if (!out.empty() && out.back().cols == cols)
      out.back().r1 = r1;
    else
      out.push_back({r0, r1, cols});
  }
  return out;
}

// The fixed-order products (fixed_order.hpp) of a sequence's query block with its
// quantized rows, restricted to what each band sees. Every element they compute has the
// bits of the full product: a skipped term is +0·x, and adding ±0 never changes a sum
// that starts from +0 (IEEE round-to-nearest: +0 + −0 = +0). Finite inputs assumed.

// A·B with A [nq, k] and B [k, m]: [nq, m], a band's columns from `cols` on left 0.
inline MatD seen_columns(const Eigen::Ref<const MatD>& A, const Eigen::Ref<const MatD>& B, const SeqWin& s) {
  MatD out = MatD::Zero(A.rows(), B.cols());
  for (const QueryBand& b : query_bands(s))
    if (b.cols > 0)
      gemm_into(A.middleRows(b.r0, b.r1 - b.r0), Trans::none, B.leftCols(b.cols), Trans::none,
                out.block(b.r0, 0, b.r1 - b.r0, b.cols));
  return out;
}

// P·X with P [nq, m] zero where its query does not see the column and X [m, d]: [nq, d],
// each row summed over the columns its band sees (the rest are +0 terms).
inline MatD seen_product(const Eigen::Ref<const MatD>& P, const Eigen::Ref<const MatD>& X, const SeqWin& s) {
  MatD out = MatD::Zero(P.rows(), X.cols());
  for (const QueryBand& b : query_bands(s))
    if (b.cols > 0)
      gemm_into(P.block(b.r0, 0, b.r1 - b.r0, b.cols), Trans::none, X.topRows(b.cols), Trans::none,
                out.middleRows(b.r0, b.r1 - b.r0));
  return out;
}

// Pᵀ·X with P [nq, m] as above and X [nq, d]: [m, d]. Column t first seen by band b sums
// rows from b's first on (the rows before are +0 terms); columns no query sees stay 0.
inline MatD seen_product_tn(const Eigen::Ref<const MatD>& P, const Eigen::Ref<const MatD>& X, const SeqWin& s) {
  MatD out = MatD::Zero(P.cols(), X.cols());
  int done = 0;
  for (const QueryBand& b : query_bands(s))
    if (b.cols > done) {
      const int rows = static_cast<int>(P.rows()) - b.r0;
      gemm_into(P.block(b.r0, done, rows, b.cols - done), Trans::transpose, X.bottomRows(rows), Trans::none,
                out.middleRows(done, b.cols - done));
      done = b.cols;
    }
  return out;
}

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
    x.qstride = c.qstride > 0 ? c.qstride : std::max(1, (x.len - c.prefix - c.recent) / c.qwin);
    x.recent = c.recent;
    x.qblock = c.qblock;
    x.nq = x.len > 0 ? std::min(c.qwin, (x.len - 1) / x.qstride + 1) : 0;
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

// The query rows of one sequence   [nq, d]
inline MatD gather_queries(const MatD& Q, const SeqWin& s) {
  MatD out(s.nq, Q.cols());
  for (int i = 0; i < s.nq; ++i) out.row(i) = Q.row(s.begin + s.query_pos(i));
  return out;
}

}  // namespace detail

}  // namespace kvq::calib
