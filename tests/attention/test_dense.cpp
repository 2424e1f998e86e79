#include <gtest/gtest.h>

#include <vector>

#include "common/test_utils.hpp"
#include "kvq/attention/dense.hpp"
#include "kvq/attention/reference.hpp"

namespace {

template <int D>
void run_golden(const nlohmann::json& a) {
  const auto q2 = a["q"].get<std::vector<std::vector<float>>>();
  const auto k2 = a["k"].get<std::vector<std::vector<float>>>();
  const auto v2 = a["v"].get<std::vector<std::vector<float>>>();
  const auto o2 = a["o"].get<std::vector<std::vector<double>>>();
  const auto lse_want = a["lse"].get<std::vector<double>>();
  const int nq = int(q2.size()), L = int(k2.size());
  // Each golden query row is its own query head over one shared KV head (GQA = nq),
  // with the mask disabled.
  std::vector<float> q, k, v, out(nq * D, kvq::test::kPoison), lse(nq, kvq::test::kPoison);
  for (auto& r : q2) q.insert(q.end(), r.begin(), r.end());
  for (auto& r : k2) k.insert(k.end(), r.begin(), r.end());
  for (auto& r : v2) v.insert(v.end(), r.begin(), r.end());
  const std::int32_t q_indptr[2] = {0, 1}, kv_indptr[2] = {0, L}, no_mask = 1 << 30;
  kvq::DecodeParams<float, float> p{q.data(), q_indptr, nq, &no_mask, a["tau"].get<float>(), false, out.data(), lse.data()};
  ASSERT_TRUE((kvq::dense_attention<D>(k.data(), v.data(), kv_indptr, 1, 1, p).ok()));
  std::vector<double> want;
  for (auto& r : o2) want.insert(want.end(), r.begin(), r.end());
  EXPECT_LT(kvq::test::rel_l2(out, want), 1e-6);
  for (int i = 0; i < nq; ++i) EXPECT_NEAR(lse[i], lse_want[i], 1e-5);
}

TEST(DenseAttention, GoldenVectors) {
  for (const auto& a : kvq::test::spec_vectors()["attention"]) {
    const auto d = a["q"][0].size();
    if (d == 64) run_golden<64>(a);
    else if (d == 128) run_golden<128>(a);
    else FAIL() << "unexpected head_dim " << d;
  }
}

// Pages in shuffled order; a page size of 5 puts page boundaries inside the decode's
// 64-token blocks, so a block's rows come from several page runs.
void check_paged_fp16_matches_ragged_rows(int P) {
  constexpr int D = 64, hkv = 2, hq = 8;
  const int lens[2] = {45, 70};
  const auto k = kvq::test::random_normal(115 * hkv * D, 1), v = kvq::test::random_normal(115 * hkv * D, 2);
  const auto q = kvq::test::random_normal(2 * hq * D, 3);
  kvq::DensePageLayout<kvq::half_t, D> layout{P, hkv};
  const int pages0 = (lens[0] + P - 1) / P, pages = pages0 + (lens[1] + P - 1) / P;
  const std::int32_t indptr[3] = {0, pages0, pages};
  const std::int32_t last[2] = {lens[0] - (pages0 - 1) * P, lens[1] - (pages - pages0 - 1) * P};
  std::vector<std::int32_t> indices(pages);
  for (int i = 0; i < pages; ++i) indices[i] = (7 * i + 3) % pages;  // 7 is prime to 8 and 23
  std::vector<std::byte> pool(layout.page_bytes() * pages);
  std::vector<float> kr(k.size()), vr(v.size());  // fp16-rounded rows for the ragged reference
  for (int b = 0, row = 0; b < 2; ++b)
    for (int t = 0; t < lens[b]; ++t, ++row)
      for (int h = 0; h < hkv; ++h)
        for (int d = 0; d < D; ++d) {
          std::byte* page = pool.data() + layout.page_bytes() * indices[indptr[b] + t / P];
          const std::size_t i = (std::size_t(row) * hkv + h) * D + d;
          layout.key_row(page, h, t % P)[d] = kvq::half_t(k[i]);
          layout.value_row(page, h, t % P)[d] = kvq::half_t(v[i]);
          kr[i] = kvq::half_t(k[i]).to_float();
          vr[i] = kvq::half_t(v[i]).to_float();
        }
  const std::int32_t q_indptr[3] = {0, 1, 2}, kv_indptr[3] = {0, 45, 115};
  std::vector<float> paged(q.size(), kvq::test::kPoison), ragged(q.size(), kvq::test::kPoison);
  kvq::DecodeParams<float, float> p{q.data(), q_indptr, hq, nullptr, 0.f, false, paged.data(), nullptr};
  const kvq::PageTableView table{indptr, indices.data(), last, 2, P};
  ASSERT_TRUE(kvq::dense_paged_attention<D>(pool.data(), pages, layout, table, p).ok());
  p.out = ragged.data();
  ASSERT_TRUE((kvq::dense_attention<D>(kr.data(), vr.data(), kv_indptr, 2, hkv, p).ok()));
  EXPECT_EQ(paged, ragged) << "page size " << P;
}

TEST(DenseAttention, PagedFp16MatchesRaggedRows) {
  check_paged_fp16_matches_ragged_rows(16);
  check_paged_fp16_matches_ragged_rows(5);
}

// An Inf value row reaches only the rows that give its token a nonzero weight.
TEST(DenseAttention, InfValueReachesOnlyTheRowsThatSeeIt) {
  constexpr int D = 64, hq = 4, nq = 2, len = 37;
  auto k = kvq::test::random_normal(len * D, 4), v = kvq::test::random_normal(len * D, 5);
  const auto q = kvq::test::random_normal(nq * hq * D, 6);
  v[std::size_t(len - 1) * D + 3] = INFINITY;  // the last token: visible to the last query only
  const std::int32_t q_indptr[2] = {0, nq}, kv_indptr[2] = {0, len};
  std::vector<float> out(q.size(), kvq::test::kPoison);
  const kvq::DecodeParams<float, float> p{q.data(), q_indptr, hq, nullptr, 0.f, false, out.data(), nullptr};
  ASSERT_TRUE((kvq::dense_attention<D>(k.data(), v.data(), kv_indptr, 1, 1, p).ok()));
  for (int j = 0; j < hq; ++j) {
    for (int d = 0; d < D; ++d) ASSERT_TRUE(std::isfinite(out[std::size_t(j) * D + d])) << "head " << j << " d " << d;
    EXPECT_TRUE(std::isinf(out[(std::size_t(hq) + j) * D + 3])) << "head " << j;
  }
}

// Up to 8 query rows per KV head the products read the rows in place (fp16/bf16 converted
// in registers) and accumulate values optimistically; more rows go through fp32 tiles.
// Both give the same bits for the same row, also when a block must be redone because a
// non-finite value reaches only some rows (the Inf in the last token, seen by the second
// query token alone).
template <class T>
void check_direct_rows_match_tiles(std::uint32_t seed) {
  constexpr int D = 128, nq = 2, len = 101, wide = 8;  // 2·8 = 16 rows: the tile path
  const auto kf = kvq::test::random_normal(len * D, seed), vf = kvq::test::random_normal(len * D, seed + 1);
  std::vector<T> k(kf.size()), v(vf.size());
  for (std::size_t i = 0; i < kf.size(); ++i) k[i] = T(kf[i]), v[i] = T(vf[i]);
  v[std::size_t(len - 1) * D + 3] = T(INFINITY);
  const auto q_wide = kvq::test::random_normal(nq * wide * D, seed + 2);
  const std::int32_t q_indptr[2] = {0, nq}, kv_indptr[2] = {0, len};
  auto run = [&](int hq) {  // query heads 0 .. hq-1 of q_wide
    std::vector<float> q, out(std::size_t(nq) * hq * D, kvq::test::kPoison), lse(nq * hq, kvq::test::kPoison);
    for (int i = 0; i < nq; ++i) q.insert(q.end(), q_wide.begin() + i * wide * D, q_wide.begin() + (i * wide + hq) * D);
    const kvq::DecodeParams<float, float> p{q.data(), q_indptr, hq, nullptr, 0.f, false, out.data(), lse.data()};
    EXPECT_TRUE((kvq::dense_attention<D>(k.data(), v.data(), kv_indptr, 1, 1, p).ok()));
    return std::pair{out, lse};
  };
  const auto [tile_out, tile_lse] = run(wide);
  for (int hq : {1, 2, 4}) {  // 2, 4 and 8 rows: the direct path
    const auto [out, lse] = run(hq);
    for (int i = 0; i < nq; ++i)
      for (int j = 0; j < hq; ++j) {
        ASSERT_EQ(lse[i * hq + j], tile_lse[i * wide + j]) << "hq " << hq << " token " << i << " head " << j;
        for (int d = 0; d < D; ++d) {
          const float got = out[(std::size_t(i) * hq + j) * D + d], want = tile_out[(std::size_t(i) * wide + j) * D + d];
          ASSERT_TRUE(got == want || (std::isnan(got) && std::isnan(want)))
              << "hq " << hq << " token " << i << " head " << j << " d " << d << ": " << got << " vs " << want;
        }
      }
    for (int j = 0; j < hq; ++j) EXPECT_TRUE(std::isinf(out[(std::size_t(hq) + j) * D + 3])) << "hq " << hq;
  }
}

TEST(DenseAttention, DirectRowsMatchTheTilePath) {
  check_direct_rows_match_tiles<kvq::half_t>(11);
  check_direct_rows_match_tiles<kvq::bfloat16_t>(12);
  check_direct_rows_match_tiles<float>(13);
}

// dense_decode attends up to 8 KV heads together, as many as 32 query rows hold
// (kLockstepRows): 5 heads × 2 rows go as one group of 5, GQA 12 as groups of 2, 2, 1
// heads, and 2 query tokens of GQA 12 (24 rows) as passes of 16 and 8 rows, groups of 2
// and 4. Every row must get the bits of its head attended alone, and stay within fp64
// attention over the rows.
void check_lockstep_heads_match_single_heads(int group, int nq, std::uint32_t seed) {
  constexpr int D = 64, hkv = 5, len = 150;
  const int hq = hkv * group;
  const auto k = kvq::test::random_normal(len * hkv * D, seed), v = kvq::test::random_normal(len * hkv * D, seed + 1);
  const auto q = kvq::test::random_normal(std::size_t(nq) * hq * D, seed + 2);
  const std::int32_t q_indptr[2] = {0, nq}, kv_indptr[2] = {0, len}, offset = len - nq - 20;  // causal, 20 tokens hidden
  std::vector<float> out(q.size(), kvq::test::kPoison), lse(std::size_t(nq) * hq, kvq::test::kPoison);
  const kvq::DecodeParams<float, float> p{q.data(), q_indptr, hq, &offset, 0.f, false, out.data(), lse.data()};
  ASSERT_TRUE((kvq::dense_attention<D>(k.data(), v.data(), kv_indptr, 1, hkv, p).ok()));
  const double tau = 1.0 / std::sqrt(double(D));
  for (int h = 0; h < hkv; ++h) {
    // Head h alone: its rows and its group's queries.
    std::vector<float> kh, vh, qh;
    for (int t = 0; t < len; ++t) {
      kh.insert(kh.end(), k.begin() + (std::size_t(t) * hkv + h) * D, k.begin() + (std::size_t(t) * hkv + h + 1) * D);
      vh.insert(vh.end(), v.begin() + (std::size_t(t) * hkv + h) * D, v.begin() + (std::size_t(t) * hkv + h + 1) * D);
    }
    for (int i = 0; i < nq; ++i) {
      const auto first = q.begin() + (std::size_t(i) * hq + h * group) * D;
      qh.insert(qh.end(), first, first + group * D);
    }
    std::vector<float> out1(qh.size(), kvq::test::kPoison), lse1(std::size_t(nq) * group, kvq::test::kPoison);
    const kvq::DecodeParams<float, float> p1{qh.data(), q_indptr, group, &offset, 0.f, false, out1.data(), lse1.data()};
    ASSERT_TRUE((kvq::dense_attention<D>(kh.data(), vh.data(), kv_indptr, 1, 1, p1).ok()));
    for (int i = 0; i < nq; ++i)
      for (int j = 0; j < group; ++j) {
        const std::size_t row = std::size_t(i) * hq + h * group + j, row1 = std::size_t(i) * group + j;
        ASSERT_EQ(lse[row], lse1[row1]) << "head " << h << " token " << i << " query head " << j;
        for (int d = 0; d < D; ++d) ASSERT_EQ(out[row * D + d], out1[row1 * D + d]) << "head " << h << " row " << row;
        double want[D];
        const double want_lse =
            kvq::exact_attention_row(q.data() + row * D, k.data() + h * D, v.data() + h * D, std::size_t(hkv) * D, len,
                                     offset + i, D, tau, want);
        EXPECT_NEAR(lse[row], want_lse, 1e-5) << "head " << h << " row " << row;
        for (int d = 0; d < D; ++d) EXPECT_NEAR(out[row * D + d], want[d], 1e-5) << "head " << h << " row " << row;
      }
  }
}

TEST(DenseAttention, LockstepHeadsMatchSingleHeads) {
  check_lockstep_heads_match_single_heads(2, 1, 21);
  check_lockstep_heads_match_single_heads(12, 1, 22);
  check_lockstep_heads_match_single_heads(12, 2, 23);
}

}  // namespace
