// Key scoring with an int8 query (kvq/cpu/query_int8.hpp): exact integer sums, the
// stated error bound per logit, and decode attention within its documented tolerance.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "decode_errors.hpp"
#include "kvq/core/packing.hpp"

namespace {

using kvq::test::kPoison;

// One token of random codes and metadata against fp64 evaluations of the formula.
template <int Bits, int G, int D>
void check_scoring(std::uint32_t seed) {
  constexpr int NK = D / G, rows = 5;
  std::mt19937 rng(seed);
  const auto q = kvq::test::random_normal(std::size_t(rows) * D, seed, 3.f);
  kvq::detail::Int8Query<Bits, G, D> q8;
  for (int r = 0; r < rows; ++r) q8.set_row(r, q.data() + r * D);
  std::vector<std::uint8_t> natural(D), packed(D * Bits / 8);
  for (int i = 0; i < D; ++i) natural[i] = std::uint8_t(rng() % (1u << Bits));
  kvq::pack_codes<Bits>(natural.data(), D, packed.data());
  float s[NK], lo[NK], meta[2 * NK];
  for (int g = 0; g < NK; ++g) {
    s[g] = meta[2 * g] = 0.01f + 0.2f * float(rng() % 100) / 100.f;
    lo[g] = meta[2 * g + 1] = -1.f + float(rng() % 100) / 50.f;
  }
  float logits[rows * 3];
  for (float& x : logits) x = kPoison;
  q8.score(packed.data(), meta, rows, logits, 3);
  for (int r = 0; r < rows; ++r) {
    double with_q8 = 0, exact = 0, bound = 0, magnitude = 0;  // magnitude: Σ|terms|, for fp32 rounding
    for (int g = 0; g < NK; ++g) {
      constexpr double mid = ((1 << Bits) - 1) / 2.0;  // μ
      double amax = 0, off_mid = 0, residuals = 0;
      for (int i = g * G; i < (g + 1) * G; ++i) amax = std::max(amax, std::abs(double(q[r * D + i])));
      const float sigma = float(amax) / 127.f;
      for (int i = g * G; i < (g + 1) * G; ++i) {
        const double qi = q[r * D + i];
        const int q8i = q8.q8[r][kvq::detail::slab_position<Bits, D>(i)];
        EXPECT_EQ(q8i, int(std::nearbyint(qi / sigma))) << "r " << r << " i " << i;
        with_q8 += double(s[g]) * sigma * q8i * natural[i] + double(lo[g]) * qi;
        residuals += qi - double(sigma) * q8i;
        exact += qi * (double(s[g]) * natural[i] + lo[g]);
        magnitude += std::abs(qi) * (double(s[g]) * (natural[i] + mid) + std::abs(lo[g]));
        off_mid += std::abs(natural[i] - mid);
      }
      with_q8 += double(s[g]) * mid * residuals;
      bound += double(s[g]) * sigma / 2 * off_mid;
    }
    // fp32 sums of ~D/4 lane terms: a few units of 2⁻²⁴ of the terms' magnitude.
    EXPECT_NEAR(logits[r * 3], with_q8, 2e-6 + 4e-7 * magnitude) << "row " << r;
    EXPECT_LE(std::abs(logits[r * 3] - exact), bound * 1.001 + 1e-5) << "row " << r;
    if (r + 1 < rows) {
      EXPECT_EQ(logits[r * 3 + 1], kPoison);
    }
  }
}

TEST(Int8Query, ScoringIsExactInIntegersAndWithinItsBound) {
  check_scoring<2, 32, 128>(1);
  check_scoring<4, 32, 128>(2);
  check_scoring<8, 32, 128>(3);
  check_scoring<2, 16, 64>(4);
  check_scoring<4, 64, 256>(5);
  check_scoring<8, 64, 64>(6);
  check_scoring<8, 32, 256>(7);  // four 64-byte group patterns
  check_scoring<2, 16, 256>(8);  // sixteen groups
}

// score_block (the SIMD path the decode uses: metadata widened in registers, 16 tokens
// reduced by one transpose) against score_generic token by token, on every metadata
// type, full and partial blocks, and all row counts of a pass. The integer sums are
// exact on both; only the fp32 summation order differs. Token j's row is row j of the
// buffer, or with `scattered` row 7·j mod 64, so that no two consecutive tokens are
// neighbours in memory (rows from different pages: the SIMD paths gather metadata).
template <int Bits, int G, int D, kvq::MetaType M>
void check_block_against_generic(std::uint32_t seed, bool scattered = false) {
  using Meta = kvq::MetaTraits<M>;
  constexpr int NK = D / G, kBlock = kvq::detail::kTokensPerBlock, kRows = kvq::detail::kMaxRowsPerPass;
  std::mt19937 rng(seed);
  const auto q = kvq::test::random_normal(std::size_t(kRows) * D, seed, 2.f);
  kvq::detail::Int8Query<Bits, G, D> q8;
  for (int r = 0; r < kRows; ++r) q8.set_row(r, q.data() + r * D);
  std::vector<std::uint8_t> codes(std::size_t(kBlock) * D * Bits / 8);
  for (auto& c : codes) c = std::uint8_t(rng());
  std::vector<typename Meta::storage> meta(std::size_t(kBlock) * 2 * NK);
  for (auto& m : meta) m = Meta::encode(-1.f + float(rng() % 1000) / 500.f);
  const std::uint8_t* code_rows[kBlock];
  const typename Meta::storage* meta_rows[kBlock];
  for (int j = 0; j < kBlock; ++j) {
    const std::size_t row = scattered ? std::size_t(7 * j % kBlock) : std::size_t(j);
    code_rows[j] = codes.data() + row * D * Bits / 8;
    meta_rows[j] = meta.data() + row * 2 * NK;
  }
  for (int rows : {1, 2, 3, 4, 7, kRows})  // 1, 2, 4: rows in registers (AVX-512 VNNI)
    for (int n : {kBlock, 17, 16, 5, 1}) {
      alignas(64) float s[kRows][kBlock];
      for (auto& row : s)
        for (float& x : row) x = kPoison;
      q8.template score_block<M>(n, code_rows, meta_rows, rows, s);
      for (int j = 0; j < kBlock; ++j) {
        float decoded[2 * NK];
        for (int i = 0; i < 2 * NK; ++i) decoded[i] = Meta::decode(meta_rows[j][i]);
        float expected[kRows];
        q8.score_generic(code_rows[j], decoded, rows, expected, 1);
        for (int r = 0; r < kRows; ++r) {
          if (r < rows && j < n) {
            // Summation order alone: the tolerance scales with the terms, which cancel.
            double magnitude = 0;
            for (int i = 0; i < D; ++i)
              magnitude += std::abs(double(q[r * D + i])) * (std::abs(decoded[2 * (i / G)]) * kvq::unpack_code<Bits>(code_rows[j], i) +
                                                              std::abs(decoded[2 * (i / G) + 1]));
            EXPECT_NEAR(s[r][j], expected[r], 2e-6 * (1 + magnitude))
                << "bits " << Bits << " G " << G << " D " << D << " rows " << rows << " n " << n << " r " << r << " j " << j;
          } else {
            EXPECT_EQ(s[r][j], kPoison) << "wrote outside the block: rows " << rows << " n " << n << " r " << r << " j " << j;
          }
        }
      }
    }
}

TEST(Int8Query, BlockScoringMatchesTheGenericPath) {
  using enum kvq::MetaType;
  check_block_against_generic<4, 32, 128, fp16>(11);
  check_block_against_generic<2, 32, 128, fp16>(12);
  check_block_against_generic<8, 32, 128, bf16>(13);   // two accumulator vectors
  check_block_against_generic<4, 16, 256, fp32>(14);   // 32 metadata values: two vectors
  check_block_against_generic<2, 16, 64, bf16>(15);
  check_block_against_generic<4, 64, 128, fp32>(17);  // AVX2 block path with fp32 metadata
  check_block_against_generic<8, 64, 256, fp16>(16);   // four 64-byte group patterns
  // The transposed AVX-512 layout: 64-byte rows with 16-, 32- and 64-byte groups, 32-byte
  // rows (two tokens per vector) with 8- and 16-byte groups, bf16 metadata.
  check_block_against_generic<4, 64, 128, bf16>(18);
  check_block_against_generic<8, 32, 64, fp16>(19);
  check_block_against_generic<2, 128, 256, bf16>(20);
  check_block_against_generic<4, 32, 64, bf16>(21);
  check_block_against_generic<2, 32, 128, bf16>(22);
  // 16-byte rows (four tokens per vector) with 8- and 16-byte groups; 128- and 256-byte
  // rows read in 64-byte parts.
  static_assert(kvq::detail::Int8Query<2, 32, 64>::kTransposed && kvq::detail::Int8Query<4, 32, 256>::kParts == 2 &&
                kvq::detail::Int8Query<8, 32, 256>::kParts == 4 && kvq::detail::Int8Query<8, 16, 128>::kTransposed);
  check_block_against_generic<2, 32, 64, fp16>(23);
  check_block_against_generic<2, 64, 64, bf16>(24);
  check_block_against_generic<4, 32, 256, fp16>(25);
  check_block_against_generic<4, 128, 256, bf16>(26);
  check_block_against_generic<8, 32, 256, bf16>(27);
  check_block_against_generic<8, 16, 128, fp16>(28);
  // The AVX2 block path with 16 metadata values (two halves) and 32 accumulator lanes.
  check_block_against_generic<2, 32, 256, fp16>(29);
  check_block_against_generic<4, 32, 256, bf16>(30);
  // Rows and metadata that are not consecutive (the gathers).
  check_block_against_generic<2, 32, 64, fp16>(31, true);
  check_block_against_generic<4, 32, 128, fp16>(32, true);
  check_block_against_generic<2, 32, 128, bf16>(33, true);
  check_block_against_generic<4, 32, 256, fp16>(34, true);
  check_block_against_generic<4, 32, 64, fp16>(35, true);
}

TEST(Int8Query, NonFiniteQueryGroupMakesTheLogitNaN) {
  constexpr int D = 64;
  std::vector<float> q(D, 0.5f);
  q[40] = NAN;
  kvq::detail::Int8Query<4, 32, D> q8;
  q8.set_row(0, q.data());
  std::vector<std::uint8_t> packed(D / 2, 0x33);
  const float meta[4] = {0.1f, 0.f, 0.1f, 0.f};
  float logit = 0.f;
  q8.score(packed.data(), meta, 1, &logit, 1);
  EXPECT_TRUE(std::isnan(logit));
}

// Decode with int8 key scoring. Against fp64 attention over the cache's own K̂, V̂ its
// error is the int8 query's alone; for 2/4-bit keys it must stay well below the error the
// quantized cache already makes against full-precision attention (the cost an engine
// accepts with the policy): outputs ≤ 1/10 of it, LSEs ≤ 1/2 (max over rows; measured
// 1/30–1/70 and 1/25–1/3). With 8-bit keys the two are comparable (measured 0.6× and
// 5×), as the header says.
template <kvq::Policy P>
void check_int8_decode(const char* label, double output_ratio, double lse_ratio, int page_size, int hkv, int hq, std::vector<int> lens, std::vector<int> qlens,
                       std::uint32_t seed) {
  auto c = kvq::test::make_paged_case<P>(seed, page_size, hkv, hq, lens, qlens);
  ASSERT_TRUE(c.append_all(seed).ok());
  const auto e = kvq::test::decode_errors<P>(c, {kvq::KeyScoring::int8_query});
  const auto& lse = e.lse;
  const auto& cached_lse = e.cached_lse;
  const auto& full_lse = e.full_lse;
  const double int8_err = e.err, cache_err = e.cache_err;
  double int8_lse = 0, cache_lse = 0;
  for (std::size_t r = 0; r < lse.size(); ++r) {
    if (std::isinf(cached_lse[r])) {
      EXPECT_TRUE(std::isinf(lse[r]) && lse[r] < 0) << "row " << r;
      continue;
    }
    int8_lse = std::max(int8_lse, std::abs(lse[r] - cached_lse[r]));
    cache_lse = std::max(cache_lse, std::abs(cached_lse[r] - full_lse[r]));
  }
  EXPECT_LE(int8_err, output_ratio * cache_err) << label;
  EXPECT_LE(int8_lse, lse_ratio * cache_lse) << label;
  EXPECT_GT(int8_err, 1e-6);  // the int8 path really ran: it is not the fp32 one
  std::printf("%-8s int8-query error: output %.2e (cache %.2e), LSE %.2e (cache %.2e)\n", label, int8_err,
              cache_err, int8_lse, cache_lse);
}

TEST(Int8Query, DecodeErrorIsSmallNextToTheCacheError) {
  using namespace kvq::presets;
  check_int8_decode<K4V2>("K4V2", 0.1, 0.5, 16, 2, 8, {300, 5}, {1, 4}, 31);
  check_int8_decode<K2V2_HC>("K2V2_HC", 0.1, 0.5, 32, 3, 12, {90, 91, 17}, {2, 1, 1}, 32);
  check_int8_decode<K4V4_H.with_head_dim(256)>("K4V4_H256", 0.1, 0.5, 16, 1, 4, {70}, {2}, 35);
  check_int8_decode<K2V2_R.with_head_dim(64)>("K2V2_R64", 0.1, 0.5, 16, 1, 13, {130}, {1}, 34);
  check_int8_decode<K8V8>("K8V8", 1.0, 8.0, 16, 2, 2, {129, 33}, {1, 1}, 33);
}

}  // namespace
