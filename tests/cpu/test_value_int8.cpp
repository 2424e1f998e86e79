// Value accumulation with int8 weights (kvq/cpu/value_int8.hpp): the integer sums of the
// SIMD path equal the portable ones and an independent formula on unpacked codes, the
// stated bound per accumulator, and decode attention within its documented tolerance.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "decode_errors.hpp"
#include "kvq/core/packing.hpp"
#include "kvq/cpu/value_int8.hpp"

namespace {

using kvq::detail::kMaxRowsPerPass;
using kvq::detail::kTokensPerBlock;
using kvq::test::kPoison;

// One block of n tokens and `rows` rows (padded as the decode pads them) of random
// weights, codes and metadata.
template <int Bits, int G, int D>
void check_block(int n, int rows, std::uint32_t seed) {
  constexpr int row_bytes = D * Bits / 8, groups = D / G;
  const int rows_padded = kvq::detail::padded_rows(rows);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> unit(0.f, 1.f);
  alignas(64) float p[kMaxRowsPerPass][kTokensPerBlock] = {};
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < n; ++j) p[r][j] = rng() % 5 == 0 ? 0.f : std::pow(unit(rng), 3.f);  // zeros and a wide range
  std::vector<std::vector<std::uint8_t>> natural(n, std::vector<std::uint8_t>(D));
  // Rows back to back (as in a page) for odd seeds, with gaps for even ones: the SIMD path
  // loads consecutive rows together.
  const int stride = seed % 2 ? row_bytes : row_bytes + 16;
  std::vector<std::uint8_t> packed(std::size_t(n) * stride + 64);
  std::vector<const std::uint8_t*> codes(n);
  float meta[kTokensPerBlock][2 * groups];
  float scale[groups][kTokensPerBlock] = {}, lo[groups][kTokensPerBlock] = {};  // zero past n
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < D; ++i) natural[j][i] = std::uint8_t(rng() % (1u << Bits));
    kvq::pack_codes<Bits>(natural[j].data(), D, packed.data() + std::size_t(j) * stride);
    codes[j] = packed.data() + std::size_t(j) * stride;
    for (int g = 0; g < groups; ++g) {
      scale[g][j] = meta[j][2 * g] = 0.001f + unit(rng);
      lo[g][j] = meta[j][2 * g + 1] = -2.f + 4.f * unit(rng);
    }
  }
  auto block = std::make_unique<kvq::detail::Int8ValueBlock<Bits, G, D>>();
  // The portable weights first: the fast ones (four rows folded together with AVX-512)
  // must equal them bit for bit, every padded row written.
  auto twin = std::make_unique<kvq::detail::Int8ValueBlock<Bits, G, D>>();
  std::memset(twin.get(), 0x5a, sizeof *twin);
  ASSERT_TRUE(twin->set_weights_generic(p, rows_padded, scale, lo));
  std::memset(block.get(), 0xa5, sizeof *block);
  ASSERT_TRUE(block->set_weights(p, rows_padded, scale, lo));
  for (int r = 0; r < rows_padded; ++r)
    for (int g = 0; g < groups; ++g) {
      ASSERT_EQ(std::memcmp(block->w8[r][g], twin->w8[r][g], kTokensPerBlock), 0) << "row " << r << " group " << g;
      ASSERT_EQ(std::memcmp(&block->sigma[r][g], &twin->sigma[r][g], 4), 0) << "row " << r << " group " << g;
      ASSERT_EQ(std::memcmp(&block->bias[r][g], &twin->bias[r][g], 4), 0) << "row " << r << " group " << g;
      ASSERT_EQ(block->w8_sum[r][g], twin->w8_sum[r][g]) << "row " << r << " group " << g;
    }
  // Poisoned integer sums: every lane of every padded row must be written.
  std::memset(block->isum, 0x7f, sizeof block->isum);
  block->accumulate(codes.data(), n, rows_padded);
  const auto fast = std::vector<std::int32_t>(&block->isum[0][0], &block->isum[0][0] + rows_padded * D);
  std::memset(block->isum, 0x7f, sizeof block->isum);
  block->accumulate_generic(codes.data(), n, rows_padded);
  for (int i = 0; i < rows_padded * D; ++i) ASSERT_EQ(fast[i], (&block->isum[0][0])[i]) << "lane " << i;

  std::vector<float> acc(std::size_t(rows_padded) * D);
  for (auto& x : acc) x = 0.25f;
  block->add_to(acc.data(), rows_padded);
  // The fused pass (sums added from registers) gives the same floats.
  std::vector<float> fused(acc.size(), 0.25f);
  block->accumulate_add(codes.data(), n, rows_padded, fused.data());
  ASSERT_EQ(std::memcmp(fused.data(), acc.data(), acc.size() * sizeof(float)), 0);
  for (int r = 0; r < rows_padded; ++r) {
    double sigma[groups];
    for (int g = 0; g < groups; ++g) {
      double largest = 0;
      for (int j = 0; j < n; ++j) largest = std::max(largest, std::abs(double(p[r][j]) * meta[j][2 * g]));
      sigma[g] = largest / 255;
      for (int j = n; j < kTokensPerBlock; ++j) ASSERT_EQ(block->w8[r][g][j], 0) << "row " << r << " token " << j;
      for (int j = 0; j < n; ++j) {
        const double w = double(p[r][j]) * meta[j][2 * g];
        EXPECT_LE(std::abs(w - sigma[g] * block->w8[r][g][j]), sigma[g] / 2 * (1 + 1e-5) + 1e-30)
            << "row " << r << " group " << g << " token " << j;
      }
    }
    for (int i = 0; i < D; ++i) {
      // Independent formula: natural element i sits at slab_position(i), in group i / G.
      const int lane = kvq::detail::slab_position<Bits, D>(i), g = i / G;
      long long isum = 0;
      double exact = 0.25, with_w8 = 0.25, bound = 0, scale = 0.25;
      for (int j = 0; j < n; ++j) {
        const double sj = meta[j][2 * g], lo = meta[j][2 * g + 1];
        const int centered = natural[j][i] - (1 << (Bits - 1));
        isum += static_cast<long long>(block->w8[r][g][j]) * centered;
        exact += double(p[r][j]) * (sj * natural[j][i] + lo);
        with_w8 += sigma[g] * block->w8[r][g][j] * centered + double(p[r][j]) * (lo + sj * (1 << (Bits - 1)));
        bound += sigma[g] / 2 * std::abs(centered);
        // fp32 rounding scales with every term summed, the midpoint's included
        scale += std::abs(double(p[r][j])) * (std::abs(sj) * (natural[j][i] + (1 << Bits)) + std::abs(lo));
      }
      ASSERT_EQ(block->isum[r][lane], isum) << "row " << r << " element " << i;
      const double got = acc[std::size_t(r) * D + lane];
      EXPECT_NEAR(got, with_w8, 4e-7 * scale) << "row " << r << " element " << i;
      EXPECT_LE(std::abs(got - exact), bound + 4e-7 * scale) << "row " << r << " element " << i;
    }
  }
}

TEST(Int8Values, IntegerSumsMatchTheGenericPathAndTheBound) {
  std::uint32_t seed = 1;
  for (int n : {1, 3, 4, 5, 17, 31, 32, 33, 63, 64})
    for (int rows : {1, 4, 7, 16}) {
      SCOPED_TRACE(testing::Message() << "n " << n << " rows " << rows);
      check_block<2, 128, 128>(n, rows, seed++);
      check_block<2, 64, 64>(n, rows, seed++);
      check_block<2, 64, 256>(n, rows, seed++);
      check_block<4, 128, 128>(n, rows, seed++);
      check_block<4, 128, 256>(n, rows, seed++);
      check_block<4, 32, 64>(n, rows, seed++);
      check_block<8, 64, 64>(n, rows, seed++);
      check_block<8, 16, 128>(n, rows, seed++);
    }
}

// The block's metadata decode (16 tokens per step with AVX-512 for one group) gives the
// scalar decoder's floats for every bit pattern class: normals, subnormals, ±0, ±Inf, NaN.
template <kvq::MetaType M, int Groups>
void check_meta_decode(std::uint32_t seed) {
  using Storage = kvq::meta_storage_t<M>;
  std::mt19937 rng(seed);
  alignas(64) Storage raw[kTokensPerBlock][2 * Groups];
  for (auto& row : raw)
    for (auto& x : row) {
      std::uint32_t bits = rng();
      if constexpr (sizeof(Storage) == 2) {
        const std::uint16_t specials[] = {0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E01, 0x0001, 0x7F80, 0xFF81};
        bits = rng() % 4 == 0 ? specials[rng() % 8] : bits & 0xFFFFu;
        x = Storage(bits);
      } else {
        x = rng() % 4 == 0 ? (rng() % 2 ? INFINITY : NAN) : std::ldexp(float(int(bits % 2001) - 1000), int(rng() % 40) - 20);
      }
    }
  alignas(64) float scale[Groups][kTokensPerBlock], lo[Groups][kTokensPerBlock];
  std::memset(scale, 0x7f, sizeof scale);  // poison: every entry must be written
  std::memset(lo, 0x7f, sizeof lo);
  kvq::detail::decode_meta_block<M, Groups>(raw, scale, lo);
  for (int g = 0; g < Groups; ++g)
    for (int j = 0; j < kTokensPerBlock; ++j) {
      const float s = kvq::MetaTraits<M>::decode(raw[j][2 * g]), l = kvq::MetaTraits<M>::decode(raw[j][2 * g + 1]);
      EXPECT_EQ(std::memcmp(&scale[g][j], &s, 4), 0) << "group " << g << " token " << j << ": " << scale[g][j] << " vs " << s;
      EXPECT_EQ(std::memcmp(&lo[g][j], &l, 4), 0) << "group " << g << " token " << j << ": " << lo[g][j] << " vs " << l;
    }
}

TEST(Int8Values, BlockMetadataDecodeMatchesTheScalarDecoder) {
  check_meta_decode<kvq::MetaType::fp16, 1>(1);
  check_meta_decode<kvq::MetaType::bf16, 1>(2);
  check_meta_decode<kvq::MetaType::fp32, 1>(3);
  check_meta_decode<kvq::MetaType::fp16, 2>(4);
  check_meta_decode<kvq::MetaType::bf16, 4>(5);
}

TEST(Int8Values, NegativeOrNonFiniteWeightsAreRefused) {
  alignas(64) float p[kMaxRowsPerPass][kTokensPerBlock] = {};
  float scale[1][kTokensPerBlock] = {}, lo[1][kTokensPerBlock] = {};
  for (int j = 0; j < 8; ++j) p[0][j] = 0.5f, scale[0][j] = 0.1f, lo[0][j] = -1.f;
  auto block = std::make_unique<kvq::detail::Int8ValueBlock<2, 128, 128>>();
  EXPECT_TRUE(block->set_weights(p, 1, scale, lo));
  scale[0][3] = NAN;
  EXPECT_FALSE(block->set_weights(p, 1, scale, lo));
  scale[0][3] = INFINITY;
  EXPECT_FALSE(block->set_weights(p, 1, scale, lo));
  scale[0][3] = 0.1f;
  lo[0][5] = -INFINITY;
  EXPECT_FALSE(block->set_weights(p, 1, scale, lo));
  lo[0][5] = -1.f;
  scale[0][6] = -0.1f;  // no quantizer writes a negative scale
  EXPECT_FALSE(block->set_weights(p, 1, scale, lo));
  scale[0][6] = 0.1f;
  p[0][2] = NAN;
  EXPECT_FALSE(block->set_weights(p, 1, scale, lo));
  p[0][2] = 0.5f;
  EXPECT_TRUE(block->set_weights(p, 1, scale, lo));
  // Both paths refuse the same blocks, whichever of four folded rows holds the bad weight.
  for (int rows_padded : {4, 8})
    for (int bad = 0; bad < rows_padded; ++bad) {
      for (int r = 0; r < rows_padded; ++r)
        for (int j = 0; j < 8; ++j) p[r][j] = 0.25f + 0.05f * float(r);
      EXPECT_TRUE(block->set_weights(p, rows_padded, scale, lo));
      p[bad][bad % 8] = -0.5f;
      EXPECT_FALSE(block->set_weights(p, rows_padded, scale, lo)) << "row " << bad;
      EXPECT_FALSE(block->set_weights_generic(p, rows_padded, scale, lo)) << "row " << bad;
      p[bad][bad % 8] = INFINITY;
      EXPECT_FALSE(block->set_weights(p, rows_padded, scale, lo)) << "row " << bad;
      EXPECT_FALSE(block->set_weights_generic(p, rows_padded, scale, lo)) << "row " << bad;
    }
}

// Decode with int8 value weights, alone and with the int8 query. Against fp64 attention
// over the cache's own K̂, V̂ the error is the int8 paths' alone; it must stay well below
// the error the quantized cache already makes against full-precision attention.
template <kvq::Policy P>
void check_decode(const char* label, kvq::KeyScoring keys, double output_ratio, int page_size, int hkv, int hq,
                  std::vector<int> lens, std::vector<int> qlens, std::uint32_t seed) {
  constexpr int D = P.head_dim;
  static_assert(kvq::supports_int8_value_weights<P>());
  auto c = kvq::test::make_paged_case<P>(seed, page_size, hkv, hq, lens, qlens);
  ASSERT_TRUE(c.append_all(seed).ok());
  const kvq::CpuDecodeOptions opt{keys, kvq::ValueAccumulation::int8_weights};
  const auto e = kvq::test::decode_errors<P>(c, opt);
  const auto& lse = e.lse;
  const auto& cached = e.cached;
  const auto& cached_lse = e.cached_lse;
  const double err = e.err, cache_err = e.cache_err;
  EXPECT_LE(err, output_ratio * cache_err) << label;
  EXPECT_GT(err, 1e-6) << label;  // the int8 path really ran: it is not the fp32 one
  for (std::size_t r = 0; r < lse.size(); ++r) {
    if (std::isinf(cached_lse[r])) {
      EXPECT_TRUE(std::isinf(lse[r]) && lse[r] < 0) << label << " row " << r;
      continue;
    }
    if (keys == kvq::KeyScoring::fp32_tiles) {  // values do not touch the LSE
      EXPECT_NEAR(lse[r], cached_lse[r], 1e-4 * (1 + std::abs(cached_lse[r]))) << label << " row " << r;
    }
  }
  // The split decode runs the same passes.
  const kvq::SplitKvConfig split{kvq::detail::kTokensPerBlock};
  const auto params = c.decode_params(nullptr, nullptr);
  std::vector<std::byte> ws(kvq::split_decode_workspace_bytes<P>(c.table(), params, hkv, split) + 64);
  auto* aligned = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(ws.data()) + 63) / 64 * 64);
  std::vector<float> out_split(c.q.size(), kPoison), lse_split(lse.size(), kPoison);
  ASSERT_TRUE(kvq::decode_attention_split<P>(c.const_cache(), c.table(), c.decode_params(out_split.data(), lse_split.data()),
                                             c.params.view(), opt, split, {aligned, ws.size() - 64},
                                             kvq::cpu::SerialExecutor{})
                  .ok());
  EXPECT_LE(kvq::test::max_row_rel_err(out_split, cached, D), output_ratio * cache_err) << label << " split";
  for (std::size_t r = 0; r < lse.size(); ++r) {  // the split LSE: the unsplit one's, up to the merge's rounding
    if (std::isinf(lse[r])) {
      EXPECT_TRUE(std::isinf(lse_split[r]) && lse_split[r] < 0) << label << " split row " << r;
      continue;
    }
    EXPECT_NEAR(lse_split[r], lse[r], 1e-5 * (1 + std::abs(lse[r]))) << label << " split row " << r;
  }
  std::printf("%-10s int8 values%s: output error %.2e (cache %.2e)\n", label,
              keys == kvq::KeyScoring::int8_query ? " + int8 query" : "", err, cache_err);
}

TEST(Int8Values, DecodeErrorIsSmallNextToTheCacheError) {
  using namespace kvq::presets;
  constexpr auto fp32 = kvq::KeyScoring::fp32_tiles, int8 = kvq::KeyScoring::int8_query;
  check_decode<K4V2>("K4V2", fp32, 0.1, 16, 2, 8, {300, 5}, {1, 4}, 41);
  check_decode<K4V2>("K4V2", int8, 0.15, 16, 2, 8, {300, 5}, {1, 4}, 41);
  check_decode<K2V2_HC>("K2V2_HC", int8, 0.15, 32, 3, 12, {90, 91, 17}, {2, 1, 1}, 42);
  check_decode<K4V4_H.with_head_dim(256)>("K4V4_H256", fp32, 0.1, 16, 1, 4, {70}, {2}, 45);
  check_decode<K2V2_R.with_head_dim(64)>("K2V2_R64", fp32, 0.1, 16, 1, 13, {130}, {1}, 44);
  // 8-bit values: the weights' 8 bits per 64-token block add about the cache's own error
  // (1.04× here; 0.41× with 32-token blocks). The mode is meant for 2- and 4-bit values.
  check_decode<K8V8>("K8V8", fp32, 1.5, 16, 2, 2, {129, 33}, {1, 1}, 43);
}

// The decode hands the block scorers one pointer per token, taken from runs of slots in
// a page: pages of any size (runs that end inside a 16-token step, one-slot pages) give
// the bits of 16-token pages in the fastest mode.
template <kvq::Policy P>
void check_page_size_independence(std::uint32_t seed) {
  const kvq::CpuDecodeOptions opt{kvq::KeyScoring::int8_query, kvq::ValueAccumulation::int8_weights};
  std::vector<float> ref_out, ref_lse;
  for (int page : {16, 1, 5, 7, 33}) {
    auto c = kvq::test::make_paged_case<P>(seed, page, 2, 8, {300, 45}, {1, 3});
    ASSERT_TRUE(c.append_all(seed).ok());
    std::vector<float> out(c.q.size(), kPoison), lse(c.q.size() / P.head_dim, kPoison);
    ASSERT_TRUE(kvq::decode_attention<P>(c.const_cache(), c.table(), c.decode_params(out.data(), lse.data()),
                                         c.params.view(), opt)
                    .ok());
    if (page == 16) {
      ref_out = out;
      ref_lse = lse;
      continue;
    }
    ASSERT_EQ(std::memcmp(out.data(), ref_out.data(), out.size() * sizeof(float)), 0) << "page size " << page;
    ASSERT_EQ(std::memcmp(lse.data(), ref_lse.data(), lse.size() * sizeof(float)), 0) << "page size " << page;
  }
}

TEST(Int8Values, FastestModeDoesNotDependOnThePageSize) {
  check_page_size_independence<kvq::presets::K4V2>(51);
  check_page_size_independence<kvq::presets::K2V2_HC>(52);
}

// A NaN value scale reaches the rows that see the token, as on the fp32 path.
TEST(Int8Values, NonFiniteValueGroupPoisonsTheRowsThatSeeIt) {
  constexpr kvq::Policy P = kvq::presets::K4V2;
  auto c = kvq::test::make_paged_case<P>(7, 16, 1, 4, {40}, {2});
  ASSERT_TRUE(c.append_all(7).ok());
  // Token 35 (page 2, slot 3): every query row sees it.
  std::byte* page = c.pool.data() + std::size_t(c.indices[2]) * c.layout().page_bytes();
  const std::uint16_t nan_half = 0x7E00;
  std::memcpy(c.layout().value_meta_bytes(page, 0, 3), &nan_half, sizeof nan_half);
  for (auto va : {kvq::ValueAccumulation::fp32_tiles, kvq::ValueAccumulation::int8_weights}) {
    std::vector<float> out(c.q.size(), kPoison), lse(c.q.size() / P.head_dim, kPoison);
    ASSERT_TRUE(kvq::decode_attention<P>(c.const_cache(), c.table(), c.decode_params(out.data(), lse.data()),
                                         c.params.view(), {kvq::KeyScoring::fp32_tiles, va})
                    .ok());
    for (float x : out) EXPECT_TRUE(std::isnan(x));
  }
}

TEST(Int8Values, UnsupportedPolicyIsAClearError) {
  constexpr kvq::Policy P{kvq::QuantSpec{.bits = 4, .group = 32}, kvq::QuantSpec{.bits = 2, .group = 32}, 128};
  static_assert(!kvq::supports_int8_value_weights<P>());
  auto c = kvq::test::make_paged_case<P>(3, 16, 1, 2, {20}, {1});
  ASSERT_TRUE(c.append_all(3).ok());
  std::vector<float> out(c.q.size(), kPoison), lse(c.q.size() / P.head_dim, kPoison);
  const kvq::Status st = kvq::decode_attention<P>(c.const_cache(), c.table(), c.decode_params(out.data(), lse.data()),
                                                  c.params.view(), {kvq::KeyScoring::fp32_tiles,
                                                                    kvq::ValueAccumulation::int8_weights});
  EXPECT_EQ(st.code(), kvq::StatusCode::unsupported);
  EXPECT_NE(st.to_string().find("value group"), std::string::npos) << st.to_string();
  EXPECT_EQ(out[0], kPoison);
}

}  // namespace
