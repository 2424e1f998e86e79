#include <gtest/gtest.h>

#include <utility>
#include <vector>

#include "common/orthogonal.hpp"
#include "common/paged_case.hpp"
#include "kvq/cache/host_cache.hpp"

namespace {

using kvq::test::max_row_rel_err;

// sink (exact) + quantized pages (dequantized) + recent (exact) through the host cache
// == exact fp64 attention over the same effective K̂/V̂.
template <kvq::Policy P>
void check_three_parts(int sink, int recent, int flush, int tokens, int n_q, std::uint32_t seed) {
  constexpr int D = P.head_dim;
  const int hkv = 2, hq = 6;
  kvq::HostCacheOptions o;
  o.num_kv_heads = hkv;
  o.num_qo_heads = hq;
  o.sink_tokens = sink;
  o.recent_tokens = recent;
  o.flush_block = flush;
  o.page_size = 16;
  auto data = kvq::test::make_paged_case<P>(seed, 16, hkv, hq, {tokens}, {n_q});
  kvq::HostKVCache<P> cache(o, data.params);
  // Append in uneven chunks.
  for (int t = 0; t < tokens;) {
    const int n = std::min(tokens - t, 1 + (t * 7) % 23);
    cache.append(data.k.data() + std::size_t(t) * hkv * D, data.v.data() + std::size_t(t) * hkv * D, n);
    t += n;
  }
  ASSERT_EQ(cache.size(), tokens);
  const int s = std::min(sink, tokens);
  EXPECT_EQ(cache.sink_size(), s);
  EXPECT_GE(cache.recent_size(), std::min(recent, tokens - s));
  EXPECT_LT(cache.recent_size(), recent + flush);
  EXPECT_EQ(cache.quantized_tokens() % flush, 0);

  // Effective keys/values: exact windows around the dequantized middle.
  std::vector<float> k = data.k, v = data.v;
  const int qn = cache.quantized_tokens();
  if (qn > 0) {
    ASSERT_TRUE(kvq::dequantize_sequence<P>(cache.pages(), cache.table(), 0, data.params.view(),
                                            k.data() + std::size_t(s) * hkv * D, v.data() + std::size_t(s) * hkv * D)
                    .ok());
  }
  // The pages hold the right tokens: each dequantized row is nearer its own token's row
  // than its neighbours' (a flush off by one token would still match the reference
  // above, which reads the middle back from the same pages).
  auto dist2 = [&](const std::vector<float>& a, int ta, const std::vector<float>& b, int tb, int h) {
    double d2 = 0;
    for (int d = 0; d < D; ++d) {
      const double e = a[(std::size_t(ta) * hkv + h) * D + d] - double(b[(std::size_t(tb) * hkv + h) * D + d]);
      d2 += e * e;
    }
    return d2;
  };
  for (int t = s; t < s + qn; ++t)
    for (int h = 0; h < hkv; ++h)
      for (const auto* x : {&std::as_const(data.k), &std::as_const(data.v)}) {
        const std::vector<float>& deq = x == &data.k ? k : v;
        const double own = dist2(deq, t, *x, t, h);
        if (t > 0) {
          EXPECT_LT(own, dist2(deq, t, *x, t - 1, h)) << "token " << t << " head " << h;
        }
        if (t + 1 < tokens) {
          EXPECT_LT(own, dist2(deq, t, *x, t + 1, h)) << "token " << t << " head " << h;
        }
      }
  std::vector<float> out(std::size_t(n_q) * hq * D, kvq::test::kPoison), lse(std::size_t(n_q) * hq);
  cache.attend(data.q.data(), n_q, out.data(), lse.data());
  std::vector<double> ref(out.size());
  const double tau = 1.0 / std::sqrt(double(D));
  for (int i = 0; i < n_q; ++i)
    for (int j = 0; j < hq; ++j) {
      const int h = j / (hq / hkv);
      const double l = kvq::exact_attention_row(data.q.data() + (i * hq + j) * D, k.data() + h * D, v.data() + h * D,
                                                std::size_t(hkv) * D, tokens, tokens - n_q + i, D, tau,
                                                ref.data() + (i * hq + j) * D);
      EXPECT_NEAR(lse[i * hq + j], l, 1e-5 * (1 + std::abs(l)));
    }
  EXPECT_LE(max_row_rel_err(out, ref, D), 1e-5) << "sink " << sink << " recent " << recent << " tokens " << tokens;
}

TEST(HostCache, SinkQuantizedRecentEqualsReferenceOverEffectiveCache) {
  using namespace kvq::presets;
  check_three_parts<K4V2_HC>(64, 256, 16, 700, 1, 1);
  check_three_parts<K2V2>(8, 32, 8, 300, 3, 2);
  check_three_parts<K2V2_R>(4, 16, 16, 200, 2, 3);
  check_three_parts<K8V8_H.with_head_dim(64)>(0, 0, 1, 90, 4, 4);   // everything quantized
  check_three_parts<K4V4>(16, 1000, 16, 100, 1, 5);                  // nothing quantized yet
  check_three_parts<K2V4_H>(200, 8, 4, 150, 2, 6);                   // all in the sink
}

TEST(HostCache, RuntimePolicyAndFullPrecisionAgreeWithoutQuantizedTokens) {
  kvq::HostCacheOptions o;
  o.num_kv_heads = 1;
  o.num_qo_heads = 2;
  auto q = kvq::make_kv_cache<64>("K2V2", o);
  auto f = kvq::make_kv_cache<64>("fp32", o);
  EXPECT_EQ(q->policy_name(), "K2V2");
  const auto k = kvq::test::random_normal(100 * 64, 1), v = kvq::test::random_normal(100 * 64, 2);
  const auto x = kvq::test::random_normal(2 * 64, 3);
  q->append(k.data(), v.data(), 100);  // 64 sink + 36 recent: nothing quantized
  f->append(k.data(), v.data(), 100);
  std::vector<float> a(128, kvq::test::kPoison), b(128, kvq::test::kPoison);
  q->attend(x.data(), 1, a.data());
  f->attend(x.data(), 1, b.data());
  EXPECT_LT(kvq::test::rel_l2(a, b), 1e-6);
  std::vector<double> ref(128);  // fp64 attention of both query heads over the 100 rows
  for (int j = 0; j < 2; ++j)
    kvq::exact_attention_row(x.data() + j * 64, k.data(), v.data(), 64, 100, 99, 64, 0.125, ref.data() + j * 64);
  EXPECT_LE(max_row_rel_err(b, ref, 64), 1e-5);
  EXPECT_GT(f->bytes(), 0u);
}

TEST(HostCache, ErrorsAreClear) {
  kvq::HostCacheOptions o;
  o.num_kv_heads = 2;
  o.num_qo_heads = 3;
  EXPECT_THROW(kvq::make_kv_cache<128>("K4V2", o), kvq::Error);
  o.num_qo_heads = 4;
  try {
    kvq::make_kv_cache<128>("K5V1", o);
    FAIL();
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::StatusCode::unsupported);
    EXPECT_NE(std::string(e.what()).find("K5V1"), std::string::npos);
  }
  try {  // key_mean missing: the message names the policy, the field, its size and its source
    kvq::make_kv_cache<128>("K4V2_HC", o);
    FAIL();
  } catch (const kvq::Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(e.code(), kvq::StatusCode::invalid_argument);
    for (const char* part : {"policy K4V2_HC centers keys", "key_mean must hold", "= 256 floats", "calibration"})
      EXPECT_NE(m.find(part), std::string::npos) << part << " not in: " << m;
  }
  kvq::LayerParams wrong;
  wrong.key_mean.assign(7, 0.f);
  EXPECT_THROW(kvq::make_kv_cache<128>("K4V2_HC", o, wrong), kvq::Error);
  auto c = kvq::make_kv_cache<128>("K4V2", o);
  std::vector<float> q(4 * 128), out(4 * 128);
  EXPECT_THROW(c->attend(q.data(), 1, out.data()), kvq::Error);  // empty cache
  EXPECT_THROW(c->append(nullptr, nullptr, 1), kvq::Error);
}

// attend()'s scratch, max_query_tokens·num_qo_heads·head_dim floats, is refused before
// anything is allocated once it no longer fits an int.
TEST(HostCache, QueryScratchBeyondIntIsRefused) {
  kvq::HostCacheOptions o;
  o.num_kv_heads = 1;
  o.num_qo_heads = 1;
  o.max_query_tokens = 1 << 24;  // · 128 = 2^31
  try {
    kvq::make_kv_cache<128>("K4V2", o);
    FAIL() << "expected kvq::Error";
  } catch (const kvq::Error& e) {
    EXPECT_EQ(e.code(), kvq::StatusCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("head_dim"), std::string::npos) << e.what();
  }
  EXPECT_THROW(kvq::FullPrecisionKVCache<128>{o}, kvq::Error);
  o.max_query_tokens = 64;
  o.num_qo_heads = 1 << 20;  // 64·2^20·64 = 2^32 at head_dim 64
  EXPECT_THROW(kvq::make_kv_cache<64>("K4V2", o), kvq::Error);
}

}  // namespace
