// kvq quickstart: build a host KV cache with a preset, append tokens, attend, and
// compare with full precision — for every preset, on one fixed synthetic layer whose
// keys have outlier channels (as real post-RoPE keys do).
//
//   kvq_quickstart [tokens=4096] [head_dim=128]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"

namespace {

struct Layer {
  int tokens, hkv = 4, hq = 16, head_dim;
  std::vector<float> k, v, q;  // k, v: [tokens, hkv, d]; q: [1, hq, d]
};

Layer make_layer(int tokens, int d) {
  Layer L{tokens, 4, 16, d, {}, {}, {}};
  std::mt19937 gen(2024);
  std::normal_distribution<float> n(0.f, 1.f);
  L.k.resize(std::size_t(tokens) * L.hkv * d);
  L.v.resize(L.k.size());
  L.q.resize(std::size_t(L.hq) * d);
  // Keys: a shared offset plus a few outlier channels with a large per-token spread, as
  // real post-RoPE keys have. Values: a per-channel mean plus Gaussian noise.
  std::vector<float> value_mean(std::size_t(L.hkv) * d);
  for (auto& x : value_mean) x = n(gen);
  for (std::size_t i = 0; i < L.k.size(); ++i) {
    const int ch = int(i % d);
    L.k[i] = ch % 29 == 3 ? 6.f + 6.f * n(gen) : 1.f + n(gen);
    L.v[i] = value_mean[i % value_mean.size()] + n(gen);
  }
  for (auto& x : L.q) x = n(gen);
  return L;
}

template <int D>
void compare(const Layer& L) {
  kvq::HostCacheOptions opt;
  opt.num_kv_heads = L.hkv;
  opt.num_qo_heads = L.hq;
  opt.sink_tokens = 64;
  opt.recent_tokens = 256;

  std::vector<float> ref(L.q.size()), out(L.q.size());
  auto fp = kvq::make_kv_cache<D>("fp32", opt);
  fp->append(L.k.data(), L.v.data(), L.tokens);
  fp->attend(L.q.data(), 1, ref.data());

  // Key means for the centered presets: the calibration mean of this layer's keys.
  kvq::LayerParams centered;
  centered.key_mean.assign(std::size_t(L.hkv) * D, 0.f);
  for (int t = 0; t < L.tokens; ++t)
    for (int i = 0; i < L.hkv * D; ++i) centered.key_mean[i] += L.k[std::size_t(t) * L.hkv * D + i] / L.tokens;

  std::printf("%d tokens, %d KV heads, %d query heads, head_dim %d; sink 64 + recent 256 kept in full precision\n\n",
              L.tokens, L.hkv, L.hq, D);
  std::printf("%-9s %10s %12s %14s %16s\n", "policy", "bits/elem", "vs BF16", "rel. L2 error", "quantized bytes");
  for (const auto& preset : kvq::presets::all) {
    const kvq::Policy P = preset.policy.with_head_dim(D);
    if (P.key.rotation == kvq::Rotation::dense) continue;  // needs a calibration artifact (OptR)
    auto cache = kvq::make_kv_cache<D>(preset.name, opt, P.key.centered ? centered : kvq::LayerParams{});
    cache->append(L.k.data(), L.v.data(), L.tokens);
    cache->attend(L.q.data(), 1, out.data());
    double num = 0, den = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      num += (out[i] - ref[i]) * double(out[i] - ref[i]);
      den += ref[i] * double(ref[i]);
    }
    const std::size_t quant_tokens = std::size_t(std::max(0, L.tokens - 64 - 256));
    std::printf("%-9.*s %10.3f %11.2fx %14.5f %16zu\n", int(preset.name.size()), preset.name.data(),
                P.bits_per_element(), P.compression_vs_bf16(), std::sqrt(num / den),
                cache->bytes() - (std::size_t(L.tokens) - quant_tokens) * L.hkv * D * 2 * sizeof(float));
  }
  std::printf("\nBF16 cache for the same %zu quantized tokens: %zu bytes\n", std::size_t(std::max(0, L.tokens - 320)),
              std::size_t(std::max(0, L.tokens - 320)) * L.hkv * D * 2 * 2);
}

}  // namespace

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? std::atoi(argv[1]) : 4096;
  const int head_dim = argc > 2 ? std::atoi(argv[2]) : 128;
  if (tokens < 1) {
    std::fprintf(stderr, "usage: kvq_quickstart [tokens>=1] [head_dim=64|128|256]\n");
    return 2;
  }
  try {
    const Layer L = make_layer(tokens, head_dim);
    const kvq::Status s = kvq::dispatch_head_dim<64, 128, 256>(head_dim, [&]<int D>() { compare<D>(L); });
    if (!s.ok()) {
      std::fprintf(stderr, "kvq_quickstart: %s\n", s.to_string().c_str());
      return 2;
    }
  } catch (const kvq::Error& e) {
    std::fprintf(stderr, "kvq_quickstart: %s\n", e.what());
    return 1;
  }
  return 0;
}
