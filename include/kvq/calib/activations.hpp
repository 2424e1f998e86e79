// kvq/calib/activations.hpp — calibration inputs of one layer and their per-head views.
//
// DESIGN §6 input per layer: Q [L, Hq, d], post-RoPE K and V [L, Hkv, d] (L = all
// calibration tokens, sequences concatenated), sequence boundaries as CSR offsets
// [n_seq + 1] into L, and W_O [D, Hq·d] (PyTorch convention, y = concat_j(o_j)·W_Oᵀ).
// Query head j uses KV head ⌊j/g⌋, g = Hq/Hkv.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvq/calib/skew_exp.hpp"
#include "kvq/core/status.hpp"

namespace kvq::calib {

// How the captured q and k were rotated by position (rope_shift.hpp moves them).
enum class RopePairs { adjacent, half };  // (2i, 2i+1): GGUF/NORM; (i, i + d/2): NeoX/HF
struct RopeSpec {
  double theta = 0;  // base frequency; 0 = unknown
  RopePairs pairs = RopePairs::adjacent;
  std::int64_t context = 0;  // the model's context length; 0 = unknown
};

struct LayerActivations {
  int layer = 0;
  int n_tokens = 0;  // L
  int hq = 0, hkv = 0, head_dim = 0, hidden = 0;  // Hq, Hkv, d, D
  std::vector<float> q;                // [L, Hq, d]
  std::vector<float> k;                // [L, Hkv, d]
  std::vector<float> v;                // [L, Hkv, d]
  std::vector<float> w_o;              // [D, Hq·d]
  std::vector<std::int64_t> seq_offsets;  // [n_seq + 1], 0 = first, L = last
  // Optional [Hkv, d] key mean over key_mean_tokens tokens outside the sequences (more
  // than they hold); empty = OptR centers keys with the mean of its training tokens.
  std::vector<float> key_mean;
  std::int64_t key_mean_tokens = 0;
  RopeSpec rope;  // from the file's metadata "rope_theta", "rope" and "context_length"

  int group_size() const { return hkv > 0 ? hq / hkv : 0; }
  int n_seq() const { return static_cast<int>(seq_offsets.size()) - 1; }

  // Throws kvq::Error with the offending field named.
  void validate() const {
    auto fail = [&](const std::string& m) {
      throw Error(StatusCode::invalid_argument, "calib: layer " + std::to_string(layer) + ": " + m);
    };
    if (n_tokens <= 0 || hq <= 0 || hkv <= 0 || head_dim <= 0 || hidden <= 0)
      fail("all dimensions must be positive");
    if (hq % hkv != 0) fail("Hq (" + std::to_string(hq) + ") is not a multiple of Hkv (" +
                            std::to_string(hkv) + ")");
    const auto L = static_cast<std::size_t>(n_tokens), d = static_cast<std::size_t>(head_dim);
    if (q.size() != L * hq * d) fail("Q must have shape [L, Hq, d]");
    if (k.size() != L * hkv * d) fail("K must have shape [L, Hkv, d]");
    if (v.size() != L * hkv * d) fail("V must have shape [L, Hkv, d]");
    if (w_o.size() != static_cast<std::size_t>(hidden) * hq * d) fail("W_O must have shape [D, Hq*d]");
    if (!key_mean.empty() && (key_mean.size() != static_cast<std::size_t>(hkv) * d || key_mean_tokens < 1))
      fail("key_mean must have shape [Hkv, d] and a positive token count");
    if (seq_offsets.size() < 2 || seq_offsets.front() != 0 || seq_offsets.back() != n_tokens)
      fail("sequence offsets must start at 0 and end at L");
    for (std::size_t i = 1; i < seq_offsets.size(); ++i)
      if (seq_offsets[i] <= seq_offsets[i - 1]) fail("sequence offsets must be increasing");
  }
};

// One KV head of one layer in fp64 (the calibration works in double so that finite
// differences and the Fréchet derivative are accurate).
struct HeadData {
  MatD K, V;                         // [L, d]
  std::vector<MatD> Q;               // g × [L, d]: the query heads that read this KV head
  std::vector<MatD> W;               // g × [D, d]: their W_O slices
  std::vector<std::int64_t> seq_offsets;  // [n_seq + 1]
  VecD key_mean;                     // [d] from LayerActivations::key_mean, or empty
  int head_dim() const { return static_cast<int>(K.cols()); }
};

// Per-head view of `a` for KV head h, restricted to sequences [seq_begin, seq_end).
inline HeadData extract_head(const LayerActivations& a, int h, int seq_begin = 0, int seq_end = -1) {
  if (seq_end < 0) seq_end = a.n_seq();
  if (h < 0 || h >= a.hkv || seq_begin < 0 || seq_end > a.n_seq() || seq_begin >= seq_end)
    throw Error(StatusCode::out_of_range, "calib: extract_head: head or sequence range out of range");
  const int d = a.head_dim, g = a.group_size();
  const std::int64_t t0 = a.seq_offsets[seq_begin], t1 = a.seq_offsets[seq_end];
  const int L = static_cast<int>(t1 - t0);
  HeadData hd;
  hd.K.resize(L, d);
  hd.V.resize(L, d);
  hd.Q.assign(g, MatD(L, d));
  for (int t = 0; t < L; ++t) {
    const std::size_t tok = static_cast<std::size_t>(t0 + t);
    for (int i = 0; i < d; ++i) {
      hd.K(t, i) = a.k[(tok * a.hkv + h) * d + i];
      hd.V(t, i) = a.v[(tok * a.hkv + h) * d + i];
      for (int j = 0; j < g; ++j) hd.Q[j](t, i) = a.q[(tok * a.hq + h * g + j) * d + i];
    }
  }
  const std::size_t ld = static_cast<std::size_t>(a.hq) * d;
  hd.W.assign(g, MatD(a.hidden, d));
  for (int j = 0; j < g; ++j)
    for (int r = 0; r < a.hidden; ++r)
      for (int i = 0; i < d; ++i) hd.W[j](r, i) = a.w_o[r * ld + static_cast<std::size_t>(h * g + j) * d + i];
  for (int s = seq_begin; s <= seq_end; ++s) hd.seq_offsets.push_back(a.seq_offsets[s] - t0);
  if (!a.key_mean.empty()) {
    hd.key_mean.resize(d);
    for (int i = 0; i < d; ++i) hd.key_mean[i] = a.key_mean[static_cast<std::size_t>(h) * d + i];
  }
  return hd;
}

}  // namespace kvq::calib
