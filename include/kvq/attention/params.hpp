// kvq/attention/params.hpp — validation of the arguments of a CPU decode-attention call
// (quantized and full precision).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "kvq/core/decode_params.hpp"
#include "kvq/core/status.hpp"
#include "kvq/layout/page_table.hpp"

namespace kvq {

// Host-side checks of a decode call on the CPU (the host can read q_indptr): the
// argument struct itself is DecodeParams (kvq/core/decode_params.hpp).
template <class Params>
Status validate_decode_params(const Params& p, const PageTableView& table, int num_kv_heads) {
  using enum StatusCode;
  KVQ_CHECK_ARG(p.q && p.out && p.q_indptr, invalid_argument, "attention: q, q_indptr and out must not be null");
  KVQ_CHECK_ARG(num_kv_heads >= 1, invalid_argument, "attention: num_kv_heads must be >= 1");
  KVQ_CHECK_ARG(p.num_qo_heads >= 1 && p.num_qo_heads % num_kv_heads == 0, invalid_argument,
                "attention: num_qo_heads (" + std::to_string(p.num_qo_heads) +
                    ") must be a positive multiple of num_kv_heads (" + std::to_string(num_kv_heads) + ")");
  KVQ_CHECK_ARG(std::isfinite(p.sm_scale), invalid_argument, "attention: sm_scale must be finite");
  KVQ_CHECK_ARG(p.q_indptr[0] == 0, invalid_argument, "attention: q_indptr[0] must be 0");
  for (int b = 0; b < table.batch_size; ++b)
    if (p.q_indptr[b + 1] < p.q_indptr[b])
      return {invalid_argument, "attention: q_indptr must be non-decreasing (sequence " + std::to_string(b) + ")"};
  return {};
}

}  // namespace kvq
