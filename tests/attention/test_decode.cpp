#include <gtest/gtest.h>

#include <cmath>
#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

#include "common/paged_case.hpp"
#include "kvq/attention/decode.hpp"
#include "kvq/attention/softmax.hpp"

namespace {

using kvq::test::kPoison;
using kvq::test::make_paged_case;
using kvq::test::max_row_rel_err;

// Quantized attention == exact fp64 attention over the dequantized K̂/V̂ (incl. LSE).
// sm_scale: DecodeParams::sm_scale (0: 1/√D).
template <kvq::Policy P>
void check_against_reference(int page_size, int hkv, int hq, std::vector<int> lens, std::vector<int> qlens,
                             std::uint32_t seed, float sm_scale = 0.f) {
  constexpr int D = P.head_dim;
  auto c = make_paged_case<P>(seed, page_size, hkv, hq, lens, qlens);
  ASSERT_TRUE(c.append_all(seed).ok());
  std::vector<float> out(c.q.size(), kPoison), lse(c.q.size() / D, kPoison);
  const kvq::Status s = kvq::decode_attention<P>(
      c.const_cache(), c.table(), c.decode_params(out.data(), lse.data(), sm_scale), c.params.view());
  ASSERT_TRUE(s.ok()) << s.to_string();
  std::vector<double> ref, ref_lse;
  c.reference(ref, ref_lse, nullptr, sm_scale);
  EXPECT_LE(max_row_rel_err(out, ref, D), 1e-5) << "page " << page_size << " hkv " << hkv << " hq " << hq;
  for (std::size_t r = 0; r < lse.size(); ++r) {
    if (std::isinf(ref_lse[r])) {
      EXPECT_TRUE(std::isinf(lse[r]) && lse[r] < 0) << "row " << r;
      continue;
    }
    EXPECT_NEAR(lse[r], ref_lse[r], 1e-5 * (1 + std::abs(ref_lse[r]))) << "row " << r;
  }
}

TEST(DecodeAttention, MatchesExactAttentionOverDequantizedCache) {
  using namespace kvq::presets;
  // Ragged lengths (incl. an empty sequence, a partial last page), GQA 1/4/8, several
  // query tokens per sequence (causal), page sizes 5–256 (5: page runs that start and end
  // inside the decode's 64-token blocks).
  check_against_reference<K8V8>(16, 2, 8, {37, 0, 129}, {1, 0, 3}, 1);
  check_against_reference<K4V2>(5, 2, 8, {77, 40}, {1, 2}, 26);
  check_against_reference<K4V4>(64, 1, 1, {200}, {2}, 2);
  check_against_reference<K4V2>(16, 2, 16, {300, 5}, {1, 4}, 3);
  check_against_reference<K2V4>(256, 4, 16, {513}, {1}, 4);
  check_against_reference<K2V2>(32, 3, 12, {90, 91, 17}, {2, 1, 1}, 5);
  // An explicit softmax scale (not 1/√D; the LSE moves with it).
  check_against_reference<K4V2>(16, 2, 8, {77, 40}, {1, 2}, 27, 0.05f);
  check_against_reference<K2V2_HC>(16, 2, 8, {130}, {3}, 28, 0.3f);
}

TEST(DecodeAttention, RowAndTokenCountsOfTheCpuTiles) {
  using namespace kvq::presets;
  // Rows per pass 1 (MHA decode), 3, 13, 16 and 17 (two passes); lengths around the
  // 64-token blocks (kTokensPerBlock) and the 4-token sub-blocks of kvq/cpu/tile.hpp.
  check_against_reference<K4V2>(16, 2, 2, {1, 31, 63, 64, 65, 97, 129}, {1, 1, 1, 1, 1, 1, 1}, 21);
  check_against_reference<K2V2>(16, 1, 3, {6, 65}, {1, 1}, 22);
  check_against_reference<K2V4.with_head_dim(64)>(32, 1, 13, {130}, {1}, 23);
  check_against_reference<K8V8>(16, 2, 16, {64}, {1}, 24);
  check_against_reference<K4V4_HC>(16, 1, 1, {45}, {17}, 25);
}

TEST(DecodeAttention, RotatedAndCenteredPolicies) {
  using namespace kvq::presets;
  check_against_reference<K4V2_H>(16, 2, 8, {150, 33}, {1, 2}, 6);
  check_against_reference<K2V2_HC>(16, 2, 8, {150, 33}, {3, 1}, 7);
  check_against_reference<K2V2_R>(16, 2, 4, {99}, {2}, 8);
  check_against_reference<K4V2_R.with_head_dim(64)>(32, 3, 9, {120, 64}, {1, 1}, 9);
  constexpr kvq::Policy centered_values = [] {
    kvq::Policy p = K4V4_H.with_head_dim(256);
    p.value.centered = true;
    p.key.sign_seed = 17;
    return p;
  }();
  check_against_reference<centered_values>(16, 1, 2, {70}, {1}, 10);
}

// An executor on real threads: `threads` workers take tasks from a shared counter.
struct ThreadExecutor {
  int threads;
  template <class Task>
  void operator()(int count, Task&& task) const {
    std::atomic<int> next{0};
    std::vector<std::thread> workers;
    for (int w = 0; w < threads; ++w)
      workers.emplace_back([&] {
        for (int i = next++; i < count; i = next++) task(i);
      });
    for (auto& w : workers) w.join();
  }
};

// Split-KV decode == exact fp64 attention (as decode_attention), and bit-identical
// whatever executor runs it and however many threads it has.
template <kvq::Policy P>
void check_split(int page_size, int hkv, int hq, std::vector<int> lens, std::vector<int> qlens, int chunk,
                 kvq::KeyScoring scoring, std::uint32_t seed) {
  constexpr int D = P.head_dim;
  auto c = make_paged_case<P>(seed, page_size, hkv, hq, lens, qlens);
  ASSERT_TRUE(c.append_all(seed).ok());
  std::vector<float> whole(c.q.size(), kPoison), whole_lse(c.q.size() / D, kPoison);
  ASSERT_TRUE(kvq::decode_attention<P>(c.const_cache(), c.table(), c.decode_params(whole.data(), whole_lse.data()),
                                       c.params.view(), {scoring})
                  .ok());
  const auto params = c.decode_params(nullptr, nullptr);
  const std::size_t bytes = kvq::split_decode_workspace_bytes<P>(c.table(), params, hkv, {chunk});
  std::vector<std::byte> storage(bytes + 64);
  auto* aligned = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(storage.data()) + 63) / 64 * 64);
  const std::span<std::byte> workspace(aligned, bytes);
  std::vector<std::vector<float>> outs;
  auto run = [&](auto&& executor) {
    std::vector<float> out(c.q.size(), kPoison), lse(c.q.size() / D, kPoison);
    std::memset(workspace.data(), 0xFF, workspace.size());  // NaN everywhere: unwritten partials show
    const kvq::Status s = kvq::decode_attention_split<P>(c.const_cache(), c.table(), c.decode_params(out.data(), lse.data()),
                                                         c.params.view(), {scoring}, {chunk}, workspace, executor);
    ASSERT_TRUE(s.ok()) << s.to_string();
    out.insert(out.end(), lse.begin(), lse.end());
    outs.push_back(out);
  };
  run(kvq::cpu::SerialExecutor{});
  run(ThreadExecutor{2});
  run(ThreadExecutor{3});
  ASSERT_EQ(outs.size(), 3u);
  EXPECT_EQ(std::memcmp(outs[0].data(), outs[1].data(), outs[0].size() * sizeof(float)), 0) << "2 threads differ";
  EXPECT_EQ(std::memcmp(outs[0].data(), outs[2].data(), outs[0].size() * sizeof(float)), 0) << "3 threads differ";
  const std::vector<float> split(outs[0].begin(), outs[0].begin() + whole.size());
  std::vector<double> ref, ref_lse;
  c.reference(ref, ref_lse);
  if (scoring == kvq::KeyScoring::fp32_tiles) {
    EXPECT_LE(max_row_rel_err(split, ref, D), 1e-5) << "vs fp64";
  }
  std::vector<double> whole_d(whole.begin(), whole.end());
  EXPECT_LE(max_row_rel_err(split, whole_d, D), 1e-5) << "vs one pass, chunk " << chunk;
  for (std::size_t r = 0; r < whole_lse.size(); ++r) {
    const float lse = outs[0][whole.size() + r];
    if (std::isinf(whole_lse[r])) {
      EXPECT_TRUE(std::isinf(lse) && lse < 0) << "row " << r;
    } else {
      EXPECT_NEAR(lse, whole_lse[r], 1e-5 * (1 + std::abs(whole_lse[r]))) << "row " << r;
    }
  }
}

TEST(DecodeAttentionSplit, MatchesOnePassOnAnyExecutor) {
  using namespace kvq::presets;
  using enum kvq::KeyScoring;
  // Chunks of one block to many; ragged and empty sequences; causal query tokens whose
  // limits end before later chunks; two passes of rows (GQA 17 rows).
  check_split<K4V2>(16, 2, 8, {1000, 0, 33}, {1, 0, 2}, 64, int8_query, 41);
  check_split<K4V2>(16, 2, 8, {1000, 0, 33}, {1, 0, 2}, 256, fp32_tiles, 42);
  check_split<K2V2_HC>(32, 1, 17, {700}, {1}, 64, int8_query, 43);
  check_split<K2V2_R.with_head_dim(64)>(16, 2, 4, {300, 301}, {3, 1}, 128, fp32_tiles, 44);
  check_split<K8V8>(64, 1, 1, {5000}, {1}, 4096, int8_query, 45);
}

TEST(DecodeAttentionSplit, RejectsBadChunksAndWorkspaces) {
  using namespace kvq::presets;
  auto c = make_paged_case<K4V2>(7, 16, 2, 8, {100}, {1});
  ASSERT_TRUE(c.append_all(7).ok());
  std::vector<float> out(c.q.size(), kPoison), lse(c.q.size() / 128, kPoison);
  const auto params = c.decode_params(out.data(), lse.data());
  const std::size_t bytes = kvq::split_decode_workspace_bytes<K4V2>(c.table(), params, 2, {64});
  alignas(64) static std::byte storage[1 << 20];
  ASSERT_LE(bytes, sizeof storage);
  auto call = [&](int chunk, std::span<std::byte> ws) {
    return kvq::decode_attention_split<K4V2>(c.const_cache(), c.table(), params, c.params.view(), {}, {chunk}, ws,
                                             kvq::cpu::SerialExecutor{});
  };
  EXPECT_TRUE(call(64, {storage, bytes}).ok());
  EXPECT_EQ(kvq::split_decode_workspace_bytes<K4V2>(c.table(), params, 2, {0}), 0u);  // no division by zero
  for (int chunk : {0, -64, 32, 96}) {  // not multiples of the 64-token block
    const kvq::Status s = call(chunk, {storage, sizeof storage});
    EXPECT_EQ(s.code(), kvq::StatusCode::invalid_argument) << chunk;
    EXPECT_NE(s.message().find("chunk_tokens"), std::string::npos) << s.to_string();
  }
  const kvq::Status small = call(64, {storage, bytes - 1});
  EXPECT_EQ(small.code(), kvq::StatusCode::invalid_argument);
  EXPECT_NE(small.message().find("split_decode_workspace_bytes"), std::string::npos) << small.to_string();
  EXPECT_EQ(call(64, {storage + 4, bytes}).code(), kvq::StatusCode::invalid_argument);
}

TEST(DecodeAttention, HeadDims) {
  using namespace kvq::presets;
  check_against_reference<K2V2.with_head_dim(64)>(16, 2, 8, {65}, {1}, 11);
  check_against_reference<K4V2_HC.with_head_dim(256)>(16, 1, 4, {40}, {2}, 12);
}

TEST(DecodeAttention, SplitThenMergeEqualsWhole) {
  constexpr auto P = kvq::presets::K4V2_HC;
  constexpr int D = P.head_dim;
  auto c = make_paged_case<P>(20, 16, 2, 8, {160}, {3});
  ASSERT_TRUE(c.append_all(20).ok());
  std::vector<float> whole(c.q.size()), whole_lse(c.q.size() / D);
  ASSERT_TRUE(kvq::decode_attention<P>(c.const_cache(), c.table(), c.decode_params(whole.data(), whole_lse.data()),
                                       c.params.view()).ok());
  // Part A: the first 4 pages (64 tokens); part B: the remaining 6. The causal offsets
  // keep absolute positions: queries sit at 157..159.
  const std::int32_t ind_a[2] = {0, 4}, ind_b[2] = {0, 6}, last_a = 16, last_b = 16;
  const kvq::PageTableView ta{ind_a, c.indices.data(), &last_a, 1, 16};
  const kvq::PageTableView tb{ind_b, c.indices.data() + 4, &last_b, 1, 16};
  const std::int32_t off_a = 160 - 3, off_b = 160 - 3 - 64;
  std::vector<float> oa(c.q.size(), kPoison), la(c.q.size() / D, kPoison), ob(c.q.size(), kPoison),
      lb(c.q.size() / D, kPoison);
  auto pa = c.decode_params(oa.data(), la.data());
  pa.causal_offset = &off_a;
  auto pb = c.decode_params(ob.data(), lb.data());
  pb.causal_offset = &off_b;
  ASSERT_TRUE(kvq::decode_attention<P>(c.const_cache(), ta, pa, c.params.view()).ok());
  ASSERT_TRUE(kvq::decode_attention<P>(c.const_cache(), tb, pb, c.params.view()).ok());
  std::vector<float> merged(c.q.size()), merged_lse(la.size());
  kvq::merge_states(oa.data(), la.data(), ob.data(), lb.data(), int(la.size()), D, merged.data(), merged_lse.data());
  EXPECT_LT(kvq::test::rel_l2(merged, whole), 1e-6);
  for (std::size_t r = 0; r < la.size(); ++r) EXPECT_NEAR(merged_lse[r], whole_lse[r], 1e-5);
}

TEST(DecodeAttention, GqaMapsQueryHeadsToTheirKvHead) {
  // Constant values per KV head (exactly representable): the output of query head j
  // is the value of KV head ⌊j/4⌋ whatever the attention weights.
  constexpr auto P = kvq::presets::K8V8;
  auto c = make_paged_case<P>(30, 16, 2, 8, {40}, {1});
  for (int t = 0; t < 40; ++t)
    for (int d = 0; d < 128; ++d) c.v[(t * 2 + 0) * 128 + d] = -3.f, c.v[(t * 2 + 1) * 128 + d] = 5.f;
  ASSERT_TRUE(c.append_all(30).ok());
  std::vector<float> out(c.q.size(), kPoison);
  ASSERT_TRUE(kvq::decode_attention<P>(c.const_cache(), c.table(), c.decode_params(out.data(), nullptr)).ok());
  for (int j = 0; j < 8; ++j) {
    const bool reads_head1 = j >= 4;
    for (int d = 0; d < 128; ++d) EXPECT_NEAR(out[j * 128 + d], reads_head1 ? 5.f : -3.f, 1e-5);
  }
}

TEST(DecodeAttention, HalfPrecisionQueriesAndOutputs) {
  constexpr auto P = kvq::presets::K4V2;
  auto c = make_paged_case<P>(40, 16, 1, 4, {77}, {1});
  ASSERT_TRUE(c.append_all(40).ok());
  std::vector<kvq::half_t> qh(c.q.size());
  for (std::size_t i = 0; i < qh.size(); ++i) qh[i] = kvq::half_t(c.q[i]);
  for (std::size_t i = 0; i < qh.size(); ++i) c.q[i] = qh[i].to_float();  // reference sees the same query
  std::vector<kvq::bfloat16_t> out(c.q.size());
  kvq::DecodeParams<kvq::half_t, kvq::bfloat16_t> p{qh.data(), c.q_indptr.data(), 4, nullptr, 0.f, false, out.data(), nullptr};
  ASSERT_TRUE(kvq::decode_attention<P>(c.const_cache(), c.table(), p).ok());
  std::vector<double> ref, ref_lse;
  c.reference(ref, ref_lse);
  std::vector<float> of(out.size());
  for (std::size_t i = 0; i < out.size(); ++i) of[i] = out[i].to_float();
  EXPECT_LE(max_row_rel_err(of, ref, 128), 8e-3);  // bf16 output rounding
}

TEST(DecodeAttention, RotatedOutputLeavesTheValueBasis) {
  constexpr auto P = kvq::presets::K2V2_R;
  auto c = make_paged_case<P>(50, 16, 1, 2, {50}, {1});
  ASSERT_TRUE(c.append_all(50).ok());
  std::vector<float> out(c.q.size(), kPoison), rot(c.q.size(), kPoison);
  ASSERT_TRUE(kvq::decode_attention<P>(c.const_cache(), c.table(), c.decode_params(out.data(), nullptr), c.params.view()).ok());
  std::vector<double> ref, ref_lse;
  c.reference(ref, ref_lse);
  EXPECT_LE(max_row_rel_err(out, ref, 128), 1e-5);  // the original basis, as every test checks it
  auto p = c.decode_params(rot.data(), nullptr);
  p.rotated_output = true;
  ASSERT_TRUE(kvq::decode_attention<P>(c.const_cache(), c.table(), p, c.params.view()).ok());
  std::vector<float> back(128), scratch(128);
  for (int j = 0; j < 2; ++j) {
    kvq::rotate_dense_transposed<128>(rot.data() + j * 128, c.params.value_rotation.data(), back.data());
    EXPECT_LT(kvq::test::rel_l2(back, std::vector<float>(out.begin() + j * 128, out.begin() + (j + 1) * 128)), 1e-5);
  }
}

TEST(DecodeAttention, BadInputsAreRejectedWithoutWriting) {
  constexpr auto P = kvq::presets::K4V2_HC;
  auto c = make_paged_case<P>(60, 16, 2, 8, {40}, {1});
  ASSERT_TRUE(c.append_all(60).ok());
  std::vector<float> out(c.q.size(), kPoison);
  auto expect_error = [&](kvq::Status s, kvq::StatusCode code, const char* needle) {
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
    for (float x : out) ASSERT_EQ(x, kPoison);
  };
  auto p = c.decode_params(out.data(), nullptr);
  expect_error(kvq::decode_attention<P>(c.const_cache(), c.table(), p, {}), kvq::StatusCode::invalid_argument, "key_mean");
  p.num_qo_heads = 7;
  expect_error(kvq::decode_attention<P>(c.const_cache(), c.table(), p, c.params.view()),
               kvq::StatusCode::invalid_argument, "multiple of num_kv_heads");
  p = c.decode_params(out.data(), nullptr);
  auto bad = c.indices;
  bad[1] = c.num_pages;
  kvq::PageTableView t = c.table();
  t.indices = bad.data();
  expect_error(kvq::decode_attention<P>(c.const_cache(), t, p, c.params.view()), kvq::StatusCode::out_of_range,
               "outside the pool");
  t = c.table();
  t.page_size = 32;
  expect_error(kvq::decode_attention<P>(c.const_cache(), t, p, c.params.view()), kvq::StatusCode::invalid_argument,
               "page_size");
  p.q = nullptr;
  expect_error(kvq::decode_attention<P>(c.const_cache(), c.table(), p, c.params.view()),
               kvq::StatusCode::invalid_argument, "must not be null");
}

TEST(DecodeAttention, NaNInTheCachePropagatesVisibly) {
  constexpr auto P = kvq::presets::K4V4;
  auto c = make_paged_case<P>(70, 16, 1, 1, {20}, {1});
  c.k[5 * 128 + 3] = NAN;
  ASSERT_TRUE(c.append_all(70).ok());
  std::vector<float> out(128, kPoison), lse(1);
  ASSERT_TRUE(kvq::decode_attention<P>(c.const_cache(), c.table(), c.decode_params(out.data(), lse.data())).ok());
  for (float x : out) EXPECT_TRUE(std::isnan(x));
  // The NaN key alone in the last block of the pass.
  constexpr int kBlock = kvq::detail::kTokensPerBlock;
  auto last = make_paged_case<P>(72, 16, 1, 1, {kBlock + 1}, {1});
  last.k[kBlock * 128 + 3] = NAN;
  ASSERT_TRUE(last.append_all(72).ok());
  std::fill(out.begin(), out.end(), kPoison);
  ASSERT_TRUE(kvq::decode_attention<P>(last.const_cache(), last.table(), last.decode_params(out.data(), lse.data())).ok());
  for (float x : out) EXPECT_TRUE(std::isnan(x));
  EXPECT_TRUE(std::isnan(lse[0]));
}

// A NaN value group reaches only the rows that give its token a nonzero weight: the
// causal mask hides it from the earlier query tokens of the same sequence.
TEST(DecodeAttention, NaNValueReachesOnlyTheRowsThatSeeIt) {
  constexpr auto P = kvq::presets::K4V2;
  constexpr int D = P.head_dim, hq = 4, nq = 3, len = 40;
  auto c = make_paged_case<P>(71, 16, 1, hq, {len}, {nq});
  c.v[std::size_t(len - 1) * D + 10] = NAN;  // the last token: visible to the last query only
  ASSERT_TRUE(c.append_all(71).ok());
  std::vector<float> out(std::size_t(nq) * hq * D, kPoison), lse(nq * hq);
  ASSERT_TRUE(kvq::decode_attention<P>(c.const_cache(), c.table(), c.decode_params(out.data(), lse.data())).ok());
  for (int i = 0; i < nq; ++i)
    for (int j = 0; j < hq; ++j)
      for (int d = 0; d < D; ++d) {
        const float x = out[(std::size_t(i) * hq + j) * D + d];
        if (i == nq - 1) EXPECT_TRUE(std::isnan(x)) << "query " << i << " head " << j;
        else ASSERT_TRUE(std::isfinite(x)) << "query " << i << " head " << j << " d " << d;
      }
}

}  // namespace
