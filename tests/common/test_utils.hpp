// Shared helpers for kvq tests: seeded random data, error norms, golden vectors.
#pragma once

#include <cmath>
#include <cstdint>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvq::test {

inline std::vector<float> random_normal(std::size_t n, std::uint32_t seed, float stddev = 1.f, float mean = 0.f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(mean, stddev);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// Keys with a few large-magnitude channels, as real post-RoPE keys have: each outlier
// channel has a fixed offset (what centering removes) and a large per-token spread
// (what a rotation must spread over the other channels).
inline std::vector<float> outlier_channels(std::size_t tokens, int heads, int d, std::uint32_t seed,
                                           int num_outliers = 4, float magnitude = 12.f) {
  auto v = random_normal(tokens * heads * d, seed);
  std::mt19937 gen(seed ^ 0x5bd1e995u);
  std::normal_distribution<float> n(0.f, 1.f);
  for (std::size_t t = 0; t < tokens; ++t)
    for (int h = 0; h < heads; ++h)
      for (int c = 0; c < num_outliers; ++c) {
        const int ch = (c * 37 + 5) % d;
        v[(t * heads + h) * d + ch] = magnitude * (0.5f * (c % 2 ? -1.f : 1.f) + 0.5f * n(gen));
      }
  return v;
}

// ‖a − b‖ / ‖b‖.
template <class A, class B>
double rel_l2(const A& a, const B& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < std::size(b); ++i) {
    num += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

inline const nlohmann::json& spec_vectors() {
  static const nlohmann::json j = [] {
    std::ifstream f(std::string(KVQ_TEST_DATA_DIR) + "/spec_vectors.json");
    if (!f) throw std::runtime_error("cannot open tests/data/spec_vectors.json");
    return nlohmann::json::parse(f);
  }();
  return j;
}

// Poison value for output buffers: any element left unwritten is caught.
inline constexpr float kPoison = 1234567.f;

}  // namespace kvq::test
