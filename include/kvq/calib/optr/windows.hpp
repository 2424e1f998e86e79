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
