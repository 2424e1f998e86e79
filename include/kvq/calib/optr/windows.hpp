// kvq/calib/optr/windows.hpp — which rows of a head OptR quantizes: per sequence the first
// `prefix` and last `recent` tokens stay exact (as in deployment) and the loss uses the
// last `qwin` query positions. The quantized rows of all sequences are stacked.
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
  int qb = 0, qe = 0;      // quantized tokens [qb, qe), relative to begin
  int nq = 0;              // query positions: the last nq tokens
  int qrow = 0;            // first row of this sequence's quantized block in the stacked matrices
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
    x.nq = std::min(c.qwin, x.len);
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

}  // namespace detail

}  // namespace kvq::calib
