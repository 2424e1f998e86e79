// kvq/core/decode_params.hpp — the arguments of a decode-attention call, shared by the
// quantized and full-precision paths on CPU (kvq/attention/) and CUDA (kvq/cuda/).
// A plain parameter struct: validation lives with each path.
#pragma once

#include <cmath>
#include <cstdint>

#include "kvq/core/numeric.hpp"

namespace kvq {

// Queries of a ragged batch and where the results go.
//   q        : [total_q, Hq, D]  rows of sequence b are q_indptr[b] .. q_indptr[b+1]
//   out      : [total_q, Hq, D]
//   lse      : [total_q, Hq]     natural-log LSE of τ·q·k over the visible keys, in the
//                                original (un-centered) logit domain; −∞ if none visible
// Causal mask: key t of the part is visible to query i of sequence b iff
//   t ≤ i + causal_offset[b]. With causal_offset == nullptr the queries are the last
//   n_q tokens of the part (offset = seq_len − n_q); a huge offset disables the mask.
// GQA: query head j reads KV head ⌊j / (Hq/Hkv)⌋.
template <ActivationType QT = float, ActivationType OT = float>
struct DecodeParams {
  const QT* q = nullptr;
  const std::int32_t* q_indptr = nullptr;  // [batch + 1]
  int num_qo_heads = 0;                    // Hq, a positive multiple of Hkv
  const std::int32_t* causal_offset = nullptr;  // [batch] or null
  float sm_scale = 0.f;                    // τ; 0 → 1/√D
  bool rotated_output = false;             // leave o in the stored value basis (R_V folded
                                           // into W_O); needs un-centered values
  OT* out = nullptr;
  float* lse = nullptr;                    // optional

  float scale(int head_dim) const { return sm_scale != 0.f ? sm_scale : 1.f / std::sqrt(float(head_dim)); }
};

}  // namespace kvq
