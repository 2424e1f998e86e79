// kvq/rotation/folding.hpp — fold the value rotation R_V into the engine's weights
// (DESIGN §3), so values are produced and consumed directly in the rotated basis and
// the attention runs with DecodeParams::rotated_output = true.
//
// PyTorch convention: v = x·W_Vᵀ with W_V [Hkv·D, D_model]; y = concat_j(o_j)·W_Oᵀ with
// W_O [D_model, Hq·D]. With w = v·R_V per KV head h:
//   W_V rows of head h  (a [D, D_model] block B)   ← R_Vᵀ·B
//   W_O columns of query head j (a [D_model, D] slice S, KV head ⌊j/g⌋) ← S·R_V
// Then y is unchanged: o_j·S_jᵀ = (o_j·R_V)·(S_j·R_V)ᵀ for orthogonal R_V.
#pragma once

#include <cstddef>
#include <vector>

#include "kvq/core/status.hpp"

namespace kvq {

// w_v: [Hkv·D, d_model] row-major, modified in place. r_v: [Hkv, D, D] (x ↦ x·R).
inline Status fold_value_rotation_into_wv(float* w_v, int num_kv_heads, int head_dim, int d_model, const float* r_v) {
  KVQ_CHECK_ARG(w_v && r_v && num_kv_heads > 0 && head_dim > 0 && d_model > 0, StatusCode::invalid_argument,
                "fold: null pointer or non-positive size");
  const std::size_t D = head_dim, M = d_model;
  std::vector<double> col(D);
  for (int h = 0; h < num_kv_heads; ++h) {
    float* block = w_v + std::size_t(h) * D * M;
    const float* r = r_v + std::size_t(h) * D * D;
    for (std::size_t c = 0; c < M; ++c) {
      // new block[j][c] = Σ_i R[i][j]·block[i][c]
      for (std::size_t j = 0; j < D; ++j) {
        double s = 0;
        for (std::size_t i = 0; i < D; ++i) s += double(r[i * D + j]) * block[i * M + c];
        col[j] = s;
      }
      for (std::size_t j = 0; j < D; ++j) block[j * M + c] = static_cast<float>(col[j]);
    }
  }
  return {};
}

// w_o: [d_model, Hq·D] row-major, modified in place. r_v: [Hkv, D, D].
inline Status fold_value_rotation_into_wo(float* w_o, int num_qo_heads, int num_kv_heads, int head_dim, int d_model,
                                          const float* r_v) {
  KVQ_CHECK_ARG(w_o && r_v && num_kv_heads > 0 && head_dim > 0 && d_model > 0 && num_qo_heads > 0 &&
                    num_qo_heads % num_kv_heads == 0,
                StatusCode::invalid_argument, "fold: null pointer, bad size or Hq not a multiple of Hkv");
  const std::size_t D = head_dim, cols = std::size_t(num_qo_heads) * D;
  const int g = num_qo_heads / num_kv_heads;
  std::vector<double> row(D);
  for (int m = 0; m < d_model; ++m)
    for (int j = 0; j < num_qo_heads; ++j) {
      float* s = w_o + std::size_t(m) * cols + std::size_t(j) * D;
      const float* r = r_v + std::size_t(j / g) * D * D;
      for (std::size_t c = 0; c < D; ++c) {
        double acc = 0;
        for (std::size_t i = 0; i < D; ++i) acc += double(s[i]) * r[i * D + c];
        row[c] = acc;
      }
      for (std::size_t c = 0; c < D; ++c) s[c] = static_cast<float>(row[c]);
    }
  return {};
}

}  // namespace kvq
