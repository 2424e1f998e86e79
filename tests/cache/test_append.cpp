#include <gtest/gtest.h>

#include <cmath>
#include <initializer_list>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "common/paged_case.hpp"
#include "kvq/cache/append.hpp"

namespace {

using kvq::test::kPoisonByte;
using kvq::test::make_paged_case;

// Byte ranges of one token slot of every head in a page.
template <kvq::Policy P>
std::vector<std::pair<std::size_t, std::size_t>> slot_ranges(const kvq::PageLayout<P>& L, int slot) {
  std::vector<std::pair<std::size_t, std::size_t>> r;
  for (int h = 0; h < L.num_kv_heads; ++h) {
    r.push_back({L.key_codes_offset(h) + slot * L.kKeyCodeBytes, L.kKeyCodeBytes});
    r.push_back({L.key_meta_offset(h) + slot * L.kKeyMetaBytes, L.kKeyMetaBytes});
    r.push_back({L.value_codes_offset(h) + slot * L.kValueCodeBytes, L.kValueCodeBytes});
    r.push_back({L.value_meta_offset(h) + slot * L.kValueMetaBytes, L.kValueMetaBytes});
  }
  return r;
}

TEST(Append, WritesExactlyItsSlotsAndNothingElse) {
  constexpr auto P = kvq::presets::K4V2_HC;
  auto c = make_paged_case<P>(1, 16, 3, 3, {40, 17}, {1, 1});
  // Append only token 21 of sequence 0 and token 16 of sequence 1.
  const std::int32_t bi[2] = {0, 1}, pos[2] = {21, 16};
  std::vector<float> k, v;
  for (int i = 0; i < 2; ++i) {
    const std::size_t row = (std::size_t(c.kv_rows[bi[i]]) + pos[i]) * 3 * 128;
    k.insert(k.end(), c.k.begin() + row, c.k.begin() + row + 3 * 128);
    v.insert(v.end(), c.v.begin() + row, c.v.begin() + row + 3 * 128);
  }
  ASSERT_TRUE(kvq::append_kv<P>(c.cache(), c.table(), k.data(), v.data(), 2, bi, pos, c.params.view()).ok());
  std::vector<bool> expected_written(c.pool.size(), false);
  const auto L = c.layout();
  for (int i = 0; i < 2; ++i) {
    const std::size_t page = std::size_t(c.table().page_of(bi[i], pos[i])) * L.page_bytes();
    for (auto [off, n] : slot_ranges(L, pos[i] % 16))
      for (std::size_t j = 0; j < n; ++j) expected_written[page + off + j] = true;
  }
  std::size_t written = 0;
  for (std::size_t j = 0; j < c.pool.size(); ++j) {
    if (!expected_written[j]) {
      ASSERT_EQ(c.pool[j], kPoisonByte) << "byte " << j << " outside the slots changed";
    }
    written += c.pool[j] != kPoisonByte;
  }
  EXPECT_GT(written, 2 * 3 * L.kBytesPerTokenHead / 2);  // the slots really were written
}

// fp16/bf16 rows are converted, centered and rotated in registers (cpu/quantize.hpp).
TEST(Append, HalfAndBfloatInputsQuantizeLikeTheirFp32Values) {
  constexpr auto P = kvq::presets::K2V2_HC;
  auto c = make_paged_case<P>(2, 16, 2, 2, {20}, {1});
  auto c16 = c, cbf = c;
  std::vector<kvq::half_t> kh(c.k.size()), vh(c.v.size());
  std::vector<kvq::bfloat16_t> kb(c.k.size()), vb(c.v.size());
  for (std::size_t i = 0; i < c.k.size(); ++i) {
    kh[i] = kvq::half_t(c.k[i]);
    vh[i] = kvq::half_t(c.v[i]);
    kb[i] = kvq::bfloat16_t(c.k[i]);
    vb[i] = kvq::bfloat16_t(c.v[i]);
  }
  std::vector<std::int32_t> bi(20, 0), pos(20);
  for (int i = 0; i < 20; ++i) pos[i] = i;
  ASSERT_TRUE(kvq::append_kv<P>(c16.cache(), c.table(), kh.data(), vh.data(), 20, bi.data(), pos.data(), c.params.view()).ok());
  ASSERT_TRUE(kvq::append_kv<P>(cbf.cache(), c.table(), kb.data(), vb.data(), 20, bi.data(), pos.data(), c.params.view()).ok());
  for (std::size_t i = 0; i < c.k.size(); ++i) c.k[i] = kh[i].to_float(), c.v[i] = vh[i].to_float();
  auto cf = c;
  ASSERT_TRUE(cf.append_all(3).ok());
  EXPECT_EQ(c16.pool, cf.pool);
  for (std::size_t i = 0; i < c.k.size(); ++i) c.k[i] = kb[i].to_float(), c.v[i] = vb[i].to_float();
  ASSERT_TRUE(c.append_all(4).ok());
  EXPECT_EQ(cbf.pool, c.pool);
}

TEST(Append, BadRequestsAreRejectedBeforeAnyWrite) {
  constexpr auto P = kvq::presets::K4V2_R;
  auto c = make_paged_case<P>(5, 16, 2, 2, {20}, {1});
  const auto before = c.pool;
  const std::vector<float> k(4 * 2 * 128, 1.f);
  std::int32_t bi[4] = {0, 0, 0, 0}, pos[4] = {0, 1, 2, 3};
  auto expect = [&](kvq::Status s, kvq::StatusCode code, const char* needle) {
    EXPECT_EQ(s.code(), code) << s.to_string();
    EXPECT_NE(s.message().find(needle), std::string::npos) << s.message();
    EXPECT_EQ(c.pool, before);
  };
  pos[3] = 20;  // == seq_len: the page table was not grown
  expect(kvq::append_kv<P>(c.cache(), c.table(), k.data(), k.data(), 4, bi, pos, c.params.view()),
         kvq::StatusCode::out_of_range, "grow the page table first");
  pos[3] = 3;
  bi[2] = 1;
  expect(kvq::append_kv<P>(c.cache(), c.table(), k.data(), k.data(), 4, bi, pos, c.params.view()),
         kvq::StatusCode::out_of_range, "batch_indices[2]");
  bi[2] = 0;
  expect(kvq::append_kv<P>(c.cache(), c.table(), k.data(), k.data(), 4, bi, pos, {}), kvq::StatusCode::invalid_argument,
         "key_mean");
  auto small = c.cache();
  small.num_pages = 1;  // the table points past the pool
  expect(kvq::append_kv<P>(small, c.table(), k.data(), k.data(), 4, bi, pos, c.params.view()),
         kvq::StatusCode::out_of_range, "outside the pool");
  expect(kvq::append_kv<P>(c.cache(), c.table(), k.data(), static_cast<const float*>(nullptr), 4, bi, pos,
                           c.params.view()),
         kvq::StatusCode::invalid_argument, "must not be null");
  EXPECT_TRUE(kvq::append_kv<P>(c.cache(), c.table(), k.data(), k.data(), 0, bi, pos, c.params.view()).ok());
}

// Every token of two sequences of 70 and 33 tokens, interleaved, then `repeats` (sequence,
// position) pairs once more (with other rows: the pool must end up holding those).
struct TokenOrder {
  std::vector<std::int32_t> bi, pos;
  int size() const { return int(bi.size()); }
};
TokenOrder interleaved_tokens(std::initializer_list<std::pair<int, int>> repeats) {
  TokenOrder o;
  for (int t = 0; t < 70; ++t) {
    o.bi.push_back(0), o.pos.push_back(t);
    if (t < 33) o.bi.push_back(1), o.pos.push_back(t);
  }
  for (auto [b, t] : repeats) o.bi.push_back(b), o.pos.push_back(t);
  return o;
}
std::vector<float> normal_rows(std::size_t count, std::uint32_t seed) {
  std::vector<float> x(count);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (auto& e : x) e = normal(rng);
  return x;
}

// The task-split append writes the serial append's bytes for any task count and task
// order, also when tokens repeat a position (the later token's rows are stored).
TEST(Append, TaskSplitWritesTheSerialBytes) {
  constexpr auto P = kvq::presets::K2V2_HC;
  constexpr int D = P.head_dim, hkv = 3;
  auto c = make_paged_case<P>(4, 16, hkv, hkv, {70, 33}, {1, 1});
  const TokenOrder tok = interleaved_tokens({{0, 5}, {1, 32}, {0, 69}});
  const auto& [bi, pos] = tok;
  const int n = tok.size();
  std::vector<float> k = normal_rows(std::size_t(n) * hkv * D, 9), v = normal_rows(k.size(), 90);
  const std::vector<std::byte> poisoned = c.pool;
  ASSERT_TRUE(kvq::append_kv<P>(c.cache(), c.table(), k.data(), v.data(), n, bi.data(), pos.data(), c.params.view()).ok());
  const std::vector<std::byte> serial = c.pool;
  ASSERT_NE(serial, poisoned);
  auto reversed = [](int count, auto&& task) {
    for (int i = count - 1; i >= 0; --i) task(i);
  };
  auto threads = [](int count, auto&& task) {
    std::vector<std::thread> pool;
    for (int i = 0; i < count; ++i) pool.emplace_back([&task, i] { task(i); });
    for (auto& t : pool) t.join();
  };
  for (int tasks : {1, 2, 3, 5, 16}) {
    c.pool = poisoned;
    ASSERT_TRUE(kvq::append_kv<P>(c.cache(), c.table(), k.data(), v.data(), n, bi.data(), pos.data(),
                                  c.params.view(), tasks, reversed).ok());
    EXPECT_EQ(c.pool, serial) << tasks << " tasks, reversed order";
    c.pool = poisoned;
    ASSERT_TRUE(kvq::append_kv<P>(c.cache(), c.table(), k.data(), v.data(), n, bi.data(), pos.data(),
                                  c.params.view(), tasks, threads).ok());
    EXPECT_EQ(c.pool, serial) << tasks << " tasks on threads";
  }
  // fp16 rows: with AVX-512 whole chunks go head by head, across lanes (cpu/quantize.hpp).
  std::vector<kvq::half_t> kh(k.begin(), k.end()), vh(v.begin(), v.end());
  c.pool = poisoned;
  ASSERT_TRUE(kvq::append_kv<P>(c.cache(), c.table(), kh.data(), vh.data(), n, bi.data(), pos.data(), c.params.view()).ok());
  const std::vector<std::byte> serial16 = c.pool;
  for (int tasks : {2, 3, 5}) {
    c.pool = poisoned;
    ASSERT_TRUE(kvq::append_kv<P>(c.cache(), c.table(), kh.data(), vh.data(), n, bi.data(), pos.data(),
                                  c.params.view(), tasks, threads).ok());
    EXPECT_EQ(c.pool, serial16) << tasks << " tasks on threads, fp16 rows";
  }
  c.pool = poisoned;
  const auto bad = kvq::append_kv<P>(c.cache(), c.table(), k.data(), v.data(), n, bi.data(), pos.data(),
                                     c.params.view(), 0, reversed);
  EXPECT_EQ(bad.code(), kvq::StatusCode::invalid_argument) << bad.to_string();
  EXPECT_EQ(c.pool, poisoned);
}

// Two tokens at one position in one call: the later one's rows are stored, also when
// groups of either are ones the SIMD path hands back to the scalar quantizer (non-finite
// rows, fp16 metadata that saturates), which it does after the whole batch's codes.
TEST(Append, RepeatedPositionStoresTheLaterTokensRows) {
  constexpr auto P = kvq::presets::K2V2_HC;
  constexpr int D = P.head_dim, hkv = 2;
  auto c = make_paged_case<P>(5, 16, hkv, hkv, {40}, {1});
  const std::vector<std::byte> poisoned = c.pool;
  std::vector<float> finite = normal_rows(std::size_t(hkv) * D, 21), odd = normal_rows(finite.size(), 22);
  odd[40] = std::nanf("");                              // key row of head 0: every group redone
  for (int e = 0; e < D; ++e) odd[D + e] *= 1e6f;       // key row of head 1: fp16 metadata saturates
  std::vector<float> odd_v = normal_rows(finite.size(), 23), finite_v = normal_rows(finite.size(), 24);
  odd_v[D + 3] = INFINITY;                              // value row of head 1
  auto stored = [&](std::initializer_list<std::pair<const std::vector<float>*, const std::vector<float>*>> tokens) {
    std::vector<float> k, v;
    for (auto [kt, vt] : tokens) k.insert(k.end(), kt->begin(), kt->end()), v.insert(v.end(), vt->begin(), vt->end());
    const int n = static_cast<int>(tokens.size());
    const std::vector<std::int32_t> bi(n, 0), pos(n, 5);
    c.pool = poisoned;
    EXPECT_TRUE(kvq::append_kv<P>(c.cache(), c.table(), k.data(), v.data(), n, bi.data(), pos.data(), c.params.view()).ok());
    return c.pool;
  };
  const auto only_finite = stored({{&finite, &finite_v}}), only_odd = stored({{&odd, &odd_v}});
  ASSERT_NE(only_finite, only_odd);
  EXPECT_EQ(stored({{&odd, &odd_v}, {&finite, &finite_v}}), only_finite);
  EXPECT_EQ(stored({{&finite, &finite_v}, {&odd, &odd_v}}), only_odd);
  EXPECT_EQ(stored({{&odd, &odd_v}, {&finite, &finite_v}, {&odd, &odd_v}, {&finite, &finite_v}}), only_finite);
}

// The append by pool slot (vLLM's slot_mapping, llama.cpp's cells) writes the bytes of the
// append by (batch index, position) into the same slots, repeated slots included (the later
// token's rows are stored); negative slots are padding and write nothing; a slot past the
// pool is rejected before any write.
TEST(Append, BySlotWritesTheBytesOfTheAppendByPosition) {
  constexpr auto P = kvq::presets::K2V2_HC;
  constexpr int D = P.head_dim, hkv = 3;
  auto c = make_paged_case<P>(6, 16, hkv, hkv, {70, 33}, {1, 1});
  const TokenOrder tok = interleaved_tokens({{1, 7}});
  const auto& [bi, pos] = tok;
  const int n = tok.size();
  // Two padding tokens' rows first.
  const std::vector<float> k = normal_rows(std::size_t(n + 2) * hkv * D, 10), v = normal_rows(k.size(), 11);
  const std::size_t skip = 2 * hkv * D;
  const std::vector<std::byte> poisoned = c.pool;
  ASSERT_TRUE(kvq::append_kv<P>(c.cache(), c.table(), k.data() + skip, v.data() + skip, n, bi.data(), pos.data(),
                                c.params.view())
                  .ok());
  const std::vector<std::byte> by_position = c.pool;
  std::vector<std::int64_t> slots = {-1, -5};
  for (int i = 0; i < n; ++i) slots.push_back(std::int64_t(c.table().page_of(bi[i], pos[i])) * 16 + pos[i] % 16);
  c.pool = poisoned;
  ASSERT_TRUE(kvq::append_kv<P>(c.cache(), k.data(), v.data(), n + 2, slots.data(), c.params.view()).ok());
  EXPECT_EQ(c.pool, by_position);

  c.pool = poisoned;
  slots[5] = std::int64_t(c.cache().num_pages) * 16;  // one past the pool's last slot
  const auto bad = kvq::append_kv<P>(c.cache(), k.data(), v.data(), n + 2, slots.data(), c.params.view());
  EXPECT_EQ(bad.code(), kvq::StatusCode::out_of_range) << bad.to_string();
  EXPECT_NE(bad.message().find("slot_mapping[5]"), std::string::npos) << bad.message();
  EXPECT_EQ(c.pool, poisoned);
  const auto null = kvq::append_kv<P>(c.cache(), k.data(), v.data(), n + 2, static_cast<const std::int64_t*>(nullptr),
                                      c.params.view());
  EXPECT_EQ(null.code(), kvq::StatusCode::invalid_argument) << null.to_string();
}

}  // namespace
