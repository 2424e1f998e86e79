// The committed activation fixture (tests/data/smollm2/, real SmolLM2 Q/K/V and W_O)
// through the kvq host cache: layout/metadata checks, the fp32 cache against a naive
// fp64 causal attention, and the post-W_O error of quantized caches. Needs no model.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "caches.hpp"
#include "kvq/io/safetensors.hpp"

namespace {

const char* kFixture = KVQ_TEST_DATA_DIR "/smollm2/activations_l2_15_28.safetensors";

struct Layer {
  std::vector<float> q, k, v, wo;
};

class Fixture : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { file_ = new kvq::io::SafetensorsFile(kvq::io::SafetensorsFile::open(kFixture)); }
  static void TearDownTestSuite() {
    delete file_;
    file_ = nullptr;
  }
  static int meta(const char* key) { return std::stoi(file_->metadata().at(key)); }
  static Layer layer(int l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    return {file_->to_float(p + "q"), file_->to_float(p + "k"), file_->to_float(p + "v"), file_->to_float(p + "w_o")};
  }
  static std::vector<std::int64_t> offsets() {
    const auto& t = file_->tensor("seq_offsets");
    std::vector<std::int64_t> o(t.data.size() / 8);
    std::memcpy(o.data(), t.data.data(), t.data.size());
    return o;
  }
  static inline kvq::io::SafetensorsFile* file_ = nullptr;
};

TEST_F(Fixture, LayoutAndMetadata) {
  EXPECT_EQ(file_->metadata().at("format"), "kvq.activations.v1");
  EXPECT_EQ(file_->metadata().at("layers"), "2,15,28");
  const int hq = meta("num_qo_heads"), hkv = meta("num_kv_heads"), d = meta("head_dim"), D = meta("hidden");
  EXPECT_EQ(hq, 9);
  EXPECT_EQ(hkv, 3);
  EXPECT_EQ(d, 64);
  const auto off = offsets();
  ASSERT_EQ(off.size(), 3u);
  EXPECT_EQ(off[0], 0);
  const std::int64_t L = off.back();
  for (int l : {2, 15, 28}) {
    const std::string p = "layers." + std::to_string(l) + ".";
    EXPECT_EQ(file_->tensor(p + "q").shape, (std::vector<std::int64_t>{L, hq, d}));
    EXPECT_EQ(file_->tensor(p + "k").shape, (std::vector<std::int64_t>{L, hkv, d}));
    EXPECT_EQ(file_->tensor(p + "v").shape, (std::vector<std::int64_t>{L, hkv, d}));
    EXPECT_EQ(file_->tensor(p + "w_o").shape, (std::vector<std::int64_t>{D, hq * d}));
    for (float x : file_->to_float(p + "k")) ASSERT_TRUE(std::isfinite(x));
  }
}

// Attention outputs [L, Hq, d] of one layer with a given cache policy, block-wise.
std::vector<float> attend_all(const Layer& a, const std::vector<std::int64_t>& off, const std::string& policy,
                              int hq, int hkv, int d, int block) {
  kvq::HostCacheOptions opt;
  opt.num_kv_heads = hkv;
  opt.num_qo_heads = hq;
  opt.sink_tokens = 16;
  opt.recent_tokens = 64;
  opt.max_query_tokens = block;
  auto cache = smollm2::make_kv_cache(policy, d, opt);
  std::vector<float> out(a.q.size());
  for (std::size_t s = 0; s + 1 < off.size(); ++s) {
    cache->clear();
    for (std::int64_t t = off[s]; t < off[s + 1]; t += block) {
      const int nb = static_cast<int>(std::min<std::int64_t>(block, off[s + 1] - t));
      cache->append(a.k.data() + t * hkv * d, a.v.data() + t * hkv * d, nb);
      cache->attend(a.q.data() + t * hq * d, nb, out.data() + t * hq * d);
    }
  }
  return out;
}

// y = o·W_Oᵀ per token: [L, D].
std::vector<double> project(const std::vector<float>& o, const std::vector<float>& wo, int D, int qd) {
  const std::size_t L = o.size() / qd;
  std::vector<double> y(L * D, 0.0);
  for (std::size_t t = 0; t < L; ++t)
    for (int r = 0; r < D; ++r) {
      double s = 0;
      for (int i = 0; i < qd; ++i) s += double(o[t * qd + i]) * wo[std::size_t(r) * qd + i];
      y[t * D + r] = s;
    }
  return y;
}

double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / den);
}

TEST_F(Fixture, FullPrecisionCacheMatchesNaiveAttention) {
  const int hq = meta("num_qo_heads"), hkv = meta("num_kv_heads"), d = meta("head_dim");
  const auto off = offsets();
  const Layer a = layer(15);
  const auto out = attend_all(a, off, "fp32", hq, hkv, d, 32);
  const int g = hq / hkv;
  double max_diff = 0;
  for (std::size_t s = 0; s + 1 < off.size(); ++s)
    for (std::int64_t t = off[s]; t < off[s + 1]; t += 37)  // a spread of positions
      for (int j = 0; j < hq; ++j) {
        const int h = j / g;
        std::vector<double> logit;
        double mx = -1e300;
        for (std::int64_t u = off[s]; u <= t; ++u) {
          double dot = 0;
          for (int i = 0; i < d; ++i) dot += double(a.q[(t * hq + j) * d + i]) * a.k[(u * hkv + h) * d + i];
          logit.push_back(dot / std::sqrt(double(d)));
          mx = std::max(mx, logit.back());
        }
        double z = 0;
        for (double& x : logit) z += (x = std::exp(x - mx));
        for (int i = 0; i < d; ++i) {
          double o = 0;
          for (std::int64_t u = off[s]; u <= t; ++u) o += logit[u - off[s]] / z * a.v[(u * hkv + h) * d + i];
          max_diff = std::max(max_diff, std::abs(o - out[(t * hq + j) * d + i]));
        }
      }
  EXPECT_LT(max_diff, 1e-4);
}

TEST_F(Fixture, QuantizedCachePostWoError) {
  const int hq = meta("num_qo_heads"), hkv = meta("num_kv_heads"), d = meta("head_dim"), D = meta("hidden");
  const auto off = offsets();
  for (int l : {2, 15, 28}) {
    const Layer a = layer(l);
    const auto ref = project(attend_all(a, off, "fp32", hq, hkv, d, 32), a.wo, D, hq * d);
    const double e8 = rel_err(project(attend_all(a, off, "K8V8", hq, hkv, d, 32), a.wo, D, hq * d), ref);
    const double e4 = rel_err(project(attend_all(a, off, "K4V4", hq, hkv, d, 32), a.wo, D, hq * d), ref);
    const double e2 = rel_err(project(attend_all(a, off, "K2V2", hq, hkv, d, 32), a.wo, D, hq * d), ref);
    EXPECT_LT(e8, 1e-2) << "layer " << l;
    EXPECT_LT(e8, e4) << "layer " << l;
    EXPECT_LT(e4, e2) << "layer " << l;
    RecordProperty("layer_" + std::to_string(l) + "_rel_err_K8V8_K4V4_K2V2",
                   std::to_string(e8) + " " + std::to_string(e4) + " " + std::to_string(e2));
    std::printf("layer %d post-W_O relative error: K8V8 %.3e  K4V4 %.3e  K2V2 %.3e\n", l, e8, e4, e2);
  }
}

}  // namespace
