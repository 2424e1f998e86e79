// Synthetic calibration layers with channel outliers (what makes INT2 keys hard):
// a few key channels carry a large offset and scale, one value channel is heavy,
// and queries are correlated with keys so the attention is not uniform.
#pragma once

#include <random>

#include "kvq/calib/activations.hpp"

namespace kvq::calib::synth {

inline LayerActivations synthetic_layer(int layer, int n_seq, int seq_len, int hkv, int g, int d, int hidden,
                                        unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> N(0.f, 1.f);
  LayerActivations a;
  a.layer = layer;
  a.n_tokens = n_seq * seq_len;
  a.hkv = hkv;
  a.hq = hkv * g;
  a.head_dim = d;
  a.hidden = hidden;
  for (int s = 0; s <= n_seq; ++s) a.seq_offsets.push_back(static_cast<std::int64_t>(s) * seq_len);
  const std::size_t L = a.n_tokens;
  a.q.resize(L * a.hq * d);
  a.k.resize(L * hkv * d);
  a.v.resize(L * hkv * d);
  a.w_o.resize(static_cast<std::size_t>(hidden) * a.hq * d);
  // Per-head channel profile: outlier channels differ per head.
  std::vector<float> kscale(hkv * d), koff(hkv * d), vscale(hkv * d);
  for (int h = 0; h < hkv; ++h)
    for (int i = 0; i < d; ++i) {
      const bool out = (i * 7 + h * 3) % 13 == 0;
      kscale[h * d + i] = out ? 6.f : 0.6f + 0.4f * std::abs(N(rng));
      koff[h * d + i] = out ? 8.f * (i % 2 ? 1.f : -1.f) : 0.3f * N(rng);
      vscale[h * d + i] = (i + h) % 17 == 0 ? 5.f : 1.f;
    }
  std::vector<float> dir(hkv * d);
  for (auto& x : dir) x = N(rng);
  for (std::size_t t = 0; t < L; ++t)
    for (int h = 0; h < hkv; ++h) {
      const float topic = N(rng);  // shared latent: makes some keys match queries
      for (int i = 0; i < d; ++i) {
        a.k[(t * hkv + h) * d + i] = koff[h * d + i] + kscale[h * d + i] * (N(rng) + 0.8f * topic * dir[h * d + i]);
        a.v[(t * hkv + h) * d + i] = vscale[h * d + i] * N(rng);
      }
      for (int j = 0; j < g; ++j)
        for (int i = 0; i < d; ++i)
          a.q[(t * a.hq + h * g + j) * d + i] = 0.5f * N(rng) + 0.6f * topic * dir[h * d + i] / kscale[h * d + i];
    }
  for (auto& w : a.w_o) w = N(rng) / std::sqrt(static_cast<float>(d));
  return a;
}

}  // namespace kvq::calib::synth
