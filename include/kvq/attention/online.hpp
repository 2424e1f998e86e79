// kvq/attention/online.hpp — the CPU online-softmax driver shared by the quantized
// and the full-precision attention, so both have the same engineering (DESIGN §9).
//
// A "part" is a run of `length` keys attended by `rows` query rows (the query heads of
// one KV head × the query tokens of one sequence). The key source supplies logits for
// one token and all rows at once, and accumulates values — it reads each token once
// per GQA group, whatever the number of rows.
#pragma once

#include <algorithm>

#include "kvq/attention/softmax.hpp"
#include "kvq/core/config.hpp"

namespace kvq::detail {

inline constexpr int kMaxRowsPerPass = 16;   // query rows sharing one pass over the keys
inline constexpr int kTokensPerBlock = 32;   // keys whose logits are computed before one rescale

// Runs the online softmax over tokens [0, length).
//   row_limit[r]      : row r sees tokens t ≤ row_limit[r] (causal); < 0 sees none
//   key_logits(t, l)  : writes l[r] = τ·(stored-domain logit) for r < rows
//   value_acc(t, p, acc): acc[r·D + i] += p[r]·v̂_t[i] for rows with p[r] ≠ 0
//   acc  : [rows, D] zero-initialized by the driver; on return holds Σ p·v̂ (unnormalized)
//   m, l : [rows] running max and sum
template <int D, class KeyLogits, class ValueAcc>
void attend_part(int length, int rows, const int* row_limit, float* acc, float* m, float* l,
                 KeyLogits&& key_logits, ValueAcc&& value_acc) {
  for (int r = 0; r < rows; ++r) {
    m[r] = neg_inf_f();
    l[r] = 0.f;
  }
  std::fill(acc, acc + rows * D, 0.f);
  int max_limit = -1;
  for (int r = 0; r < rows; ++r) max_limit = std::max(max_limit, row_limit[r]);
  const int end = std::min(length, max_limit + 1);

  float logits[kTokensPerBlock][kMaxRowsPerPass];
  float p[kMaxRowsPerPass];
  for (int t0 = 0; t0 < end; t0 += kTokensPerBlock) {
    const int n = std::min(kTokensPerBlock, end - t0);
    for (int j = 0; j < n; ++j) {
      key_logits(t0 + j, logits[j]);
      for (int r = 0; r < rows; ++r)
        if (t0 + j > row_limit[r]) logits[j][r] = neg_inf_f();
    }
    // One rescale per block and row.
    for (int r = 0; r < rows; ++r) {
      float block_max = neg_inf_f();
      for (int j = 0; j < n; ++j) block_max = std::max(block_max, logits[j][r]);
      if (block_max == neg_inf_f()) {  // nothing visible in this block for row r
        for (int j = 0; j < n; ++j) logits[j][r] = 0.f;
        continue;
      }
      const float m_new = std::max(m[r], block_max);
      const float correction = exp_f(m[r] - m_new);  // 0 when m was −∞
      if (correction != 1.f) {
        l[r] *= correction;
        for (int i = 0; i < D; ++i) acc[r * D + i] *= correction;
      }
      m[r] = m_new;
      for (int j = 0; j < n; ++j) {
        logits[j][r] = exp_f(logits[j][r] - m_new);  // now the probability weight
        l[r] += logits[j][r];
      }
    }
    for (int j = 0; j < n; ++j) {
      bool any = false;
      for (int r = 0; r < rows; ++r) {
        p[r] = m[r] == neg_inf_f() ? 0.f : logits[j][r];
        any = any || p[r] != 0.f;
      }
      if (any) value_acc(t0 + j, p, acc);
    }
  }
}

// Dot product with 8 independent partial sums (vectorizes without -ffast-math).
template <int D>
KVQ_FORCE_INLINE float dot(const float* KVQ_RESTRICT a, const float* KVQ_RESTRICT b) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < D; i += 8)
    for (int k = 0; k < 8; ++k) s[k] += a[i + k] * b[i + k];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

}  // namespace kvq::detail
