// kvq/calib/rope_shift.hpp — calibration sequences moved to other absolute positions.
//
// A capture of L-token sequences shows the quantizer keys whose RoPE pairs have turned by
// p·θ^(−2i/d) for p < L only. At the model's context length the low-frequency pairs reach
// angles the capture never shows, and a learned rotation fitted to the narrow arc can
// quantize them worse than the base it replaced. Turning q and k of a sequence by the same
// RoPE(Δ) leaves every logit q·k — hence the attention, the outputs and every loss target —
// unchanged (RoPE(p + Δ) = RoPE(Δ)·RoPE(p), and rotations preserve dot products), while
// the keys take the absolute phases of positions [Δ, Δ + L). The key mean μ_K is not
// moved: deployment subtracts the same μ_K at every position.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kvq/calib/activations.hpp"
#include "kvq/core/status.hpp"

namespace kvq::calib {

// Offsets Δ_s ∈ [0, max_position − len_s], one per sequence of `seq_offsets` ([n_seq + 1]),
// from a fixed hash of s: the same for every layer and head, and for any thread count.
inline std::vector<std::int64_t> rope_shift_offsets(const std::vector<std::int64_t>& seq_offsets,
                                                    std::int64_t max_position) {
  std::vector<std::int64_t> delta;
  for (std::size_t s = 0; s + 1 < seq_offsets.size(); ++s) {
    const std::int64_t len = seq_offsets[s + 1] - seq_offsets[s];
    if (len > max_position)
      throw Error(StatusCode::invalid_argument, "calib: sequence " + std::to_string(s) + " has " +
                                                    std::to_string(len) + " tokens, more than rope_shift " +
                                                    std::to_string(max_position));
    std::uint64_t z = 0x6b7671u + 0x9e3779b97f4a7c15ull * (s + 1);  // splitmix64
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    delta.push_back(static_cast<std::int64_t>(z % static_cast<std::uint64_t>(max_position - len + 1)));
  }
  return delta;
}

// Turns the rows of sequence s in hd.K and every hd.Q[j] by RoPE(delta[s]), in place.
// delta: [n_seq of hd]. Pair i (i < d/2) of frequency θ^(−2i/d) is (2i, 2i+1) or (i, i + d/2).
inline void apply_rope_shift(HeadData& hd, const RopeSpec& rope, std::span<const std::int64_t> delta) {
  const int d = hd.head_dim();
  if (!(rope.theta > 0) || d % 2 != 0)
    throw Error(StatusCode::invalid_argument, "calib: rope_shift needs the capture's RoPE (metadata rope_theta, rope) "
                                              "and an even head_dim");
  if (delta.size() + 1 != hd.seq_offsets.size())
    throw Error(StatusCode::invalid_argument, "calib: rope_shift needs one offset per sequence");
  const int half = d / 2;
  for (std::size_t s = 0; s < delta.size(); ++s) {
    std::vector<double> c(half), sn(half);
    for (int i = 0; i < half; ++i) {
      const double angle = static_cast<double>(delta[s]) * std::pow(rope.theta, -2.0 * i / d);
      c[i] = std::cos(angle);
      sn[i] = std::sin(angle);
    }
    auto turn = [&](MatD& m) {
      for (std::int64_t t = hd.seq_offsets[s]; t < hd.seq_offsets[s + 1]; ++t)
        for (int i = 0; i < half; ++i) {
          const int a = rope.pairs == RopePairs::adjacent ? 2 * i : i;
          const int b = rope.pairs == RopePairs::adjacent ? 2 * i + 1 : i + half;
          const double x = m(t, a), y = m(t, b);
          m(t, a) = x * c[i] - y * sn[i];
          m(t, b) = x * sn[i] + y * c[i];
        }
    };
    turn(hd.K);
    for (MatD& q : hd.Q) turn(q);
  }
}

}  // namespace kvq::calib
