// Shared by the int8 decode tests: one decode of a paged case with given CPU options,
// against fp64 attention over the cache's own K̂, V̂ (the error of the option) and over
// the original K, V (the error the quantized cache already makes).
#pragma once

#include <gtest/gtest.h>

#include <vector>

#include "common/paged_case.hpp"
#include "kvq/attention/decode.hpp"

namespace kvq::test {

struct DecodeErrors {
  std::vector<float> out, lse;                       // [rows·D], [rows]; poisoned before the call
  std::vector<double> cached, cached_lse, full_lse;  // references over K̂, V̂ and over K, V
  double err = 0, cache_err = 0;                     // max row relative errors: out vs cached, cached vs full
};

template <Policy P>
DecodeErrors decode_errors(const PagedCase<P>& c, CpuDecodeOptions options) {
  constexpr int D = P.head_dim;
  DecodeErrors e;
  e.out.assign(c.q.size(), kPoison);
  e.lse.assign(c.q.size() / D, kPoison);
  const Status st =
      decode_attention<P>(c.const_cache(), c.table(), c.decode_params(e.out.data(), e.lse.data()), c.params.view(), options);
  EXPECT_TRUE(st.ok()) << st.to_string();
  std::vector<double> full;
  c.reference(e.cached, e.cached_lse);
  c.reference(full, e.full_lse, nullptr, 0.f, /*full_precision=*/true);
  e.err = max_row_rel_err(e.out, e.cached, D);
  e.cache_err = max_row_rel_err(e.cached, full, D);
  return e;
}

}  // namespace kvq::test
