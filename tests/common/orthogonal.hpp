// Random orthogonal matrices for tests (Gram–Schmidt in fp64 on a seeded Gaussian).
#pragma once

#include <cmath>
#include <vector>

#include "common/test_utils.hpp"

namespace kvq::test {

// [heads, d, d] row-major, each orthogonal to ~1e-7 (fp32 storage).
inline std::vector<float> random_orthogonal(int heads, int d, std::uint32_t seed) {
  std::vector<float> out(std::size_t(heads) * d * d);
  for (int h = 0; h < heads; ++h) {
    const auto g = random_normal(std::size_t(d) * d, seed + h);
    std::vector<double> q(g.begin(), g.end());
    for (int i = 0; i < d; ++i) {
      for (int pass = 0; pass < 2; ++pass)
        for (int j = 0; j < i; ++j) {
          double dot = 0;
          for (int k = 0; k < d; ++k) dot += q[i * d + k] * q[j * d + k];
          for (int k = 0; k < d; ++k) q[i * d + k] -= dot * q[j * d + k];
        }
      double n = 0;
      for (int k = 0; k < d; ++k) n += q[i * d + k] * q[i * d + k];
      n = std::sqrt(n);
      for (int k = 0; k < d; ++k) q[i * d + k] /= n;
    }
    for (std::size_t i = 0; i < q.size(); ++i) out[std::size_t(h) * d * d + i] = static_cast<float>(q[i]);
  }
  return out;
}

}  // namespace kvq::test
