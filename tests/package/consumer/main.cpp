// Quantizes and attends with kvq::presets::K4V2 through the installed package.
#include <cmath>
#include <cstdio>
#include <vector>

#include <kvq/kvq.hpp>

int main() {
  kvq::HostCacheOptions o;
  o.num_kv_heads = 1;
  o.num_qo_heads = 4;
  o.sink_tokens = 4;
  o.recent_tokens = 8;
  kvq::HostKVCache<kvq::presets::K4V2> cache(o);
  std::vector<float> k(200 * 128), v(200 * 128), q(4 * 128), out(4 * 128);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = std::sin(0.1f * i), v[i] = std::cos(0.07f * i);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.3f * i);
  cache.append(k.data(), v.data(), 200);
  cache.attend(q.data(), 1, out.data());
  std::printf("quantized tokens %d, out[0] %.4f\n", cache.quantized_tokens(), out[0]);
  return cache.quantized_tokens() > 0 && std::isfinite(out[0]) ? 0 : 1;
}
