// The SIMD append path (kvq/cpu/quantize.hpp) against the scalar reference that CUDA
// runs too: the same bits for the FWHT, every group quantizer shape and whole
// quantize-appends, on random rows and on adversarial ones (NaN/Inf, constant groups,
// signed zeros, fp16 saturation, ranges below the metadata's resolution).
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "common/paged_case.hpp"
#include "common/quantizer_rows.hpp"
#include "kvq/cache/append.hpp"
#include "kvq/cpu/quantize.hpp"

namespace {

// Bit-identical except that a NaN may carry another sign or payload (which NaN an add
// of two NaNs returns depends on operand order, which compilers choose); the quantizer
// stores every non-finite group the same way.
template <int D>
void check_fwht(std::uint32_t sign_seed) {
  int index = 0;
  for (const auto& row : kvq::test::test_rows<D>(sign_seed + 3)) {
    std::vector<float> fast = row, generic = row;
    kvq::cpu::hadamard_forward_fast<D>(fast.data(), sign_seed);
    kvq::cpu::hadamard_forward_generic<D>(generic.data(), sign_seed);
    for (int i = 0; i < D; ++i) {
      if (std::isnan(generic[i])) {
        EXPECT_TRUE(std::isnan(fast[i])) << "D " << D << " row " << index << " i " << i;
      } else {
        EXPECT_EQ(std::memcmp(&fast[i], &generic[i], sizeof(float)), 0)
            << "D " << D << " seed " << sign_seed << " row " << index << " i " << i << ": " << fast[i] << " vs " << generic[i];
      }
    }
    ++index;
  }
}

TEST(CpuQuantize, FwhtIsBitIdenticalToTheScalarButterflies) {
  for (std::uint32_t seed : {0u, 17u, 123456u}) {
    check_fwht<64>(seed);
    check_fwht<128>(seed);
    check_fwht<256>(seed);
  }
}

// All test rows quantized in one quantize_rows_fast call (its phases run across rows),
// each row against the scalar quantize_row.
template <kvq::QuantSpec S, int D>
void check_quantize_row() {
  using Meta = kvq::MetaTraits<S.meta>;
  using MetaStorage = typename Meta::storage;
  constexpr int kBytes = D * S.bits / 8, kMeta = 2 * (D / S.group), kMaxRows = 80;
  int boundary_values = 0;
  const auto rows = kvq::test::quantizer_rows<S, D>(boundary_values);
  ASSERT_GT(boundary_values, D / 4) << kvq::to_string(S) << ": too few values on the rounding boundary";
  const int n = int(rows.size());
  ASSERT_LE(n, kMaxRows);
  std::vector<std::vector<std::uint8_t>> fast(n, std::vector<std::uint8_t>(kBytes, 0xAB));
  std::vector<std::vector<MetaStorage>> fast_meta(n, std::vector<MetaStorage>(kMeta));
  const float* x[kMaxRows];
  std::uint8_t* packed[kMaxRows];
  MetaStorage* meta[kMaxRows];
  for (int r = 0; r < n; ++r) {
    std::memset(fast_meta[r].data(), 0xAB, kMeta * sizeof(MetaStorage));
    x[r] = rows[r].data(), packed[r] = fast[r].data(), meta[r] = fast_meta[r].data();
  }
  kvq::cpu::quantize_rows_fast<S, D, kMaxRows>(n, x, packed, meta);
  for (int r = 0; r < n; ++r) {
    std::vector<std::uint8_t> generic(kBytes, 0xCD);
    std::vector<MetaStorage> generic_meta(kMeta);
    std::memset(generic_meta.data(), 0xCD, kMeta * sizeof(MetaStorage));
    kvq::cpu::quantize_row_generic<S, D>(rows[r].data(), generic.data(), generic_meta.data());
    EXPECT_EQ(fast[r], generic) << kvq::to_string(S) << " row " << r;
    EXPECT_EQ(std::memcmp(fast_meta[r].data(), generic_meta.data(), kMeta * sizeof(MetaStorage)), 0)
        << kvq::to_string(S) << " row " << r;
  }
}

using kvq::test::spec;

TEST(CpuQuantize, GroupQuantizerIsBitIdenticalToTheScalarOne) {
  using enum kvq::MetaType;
  check_quantize_row<spec(4, 32), 128>();
  check_quantize_row<spec(2, 32), 128>();
  check_quantize_row<spec(8, 32), 128>();
  check_quantize_row<spec(2, 128), 128>();
  check_quantize_row<spec(4, 128), 128>();
  check_quantize_row<spec(2, 16, bf16), 64>();
  check_quantize_row<spec(4, 64, fp32), 256>();
  check_quantize_row<spec(8, 128, bf16), 256>();
  // Clipping: the threshold selected a group per lane (detail::clip_rows) against the
  // scalar all-pairs ranking; kept lists of 2 and 4 keys (insertion), 5–16 (sorted blocks
  // of kLanes merged bitonically, with and without +∞ slots, blocks shorter than the list
  // on 8 lanes), 17 (bit by bit).
  check_quantize_row<spec(4, 32, fp16, 960), 128>();
  check_quantize_row<spec(2, 32, fp16, 900), 128>();
  check_quantize_row<spec(2, 128, fp16, 920), 128>();
  check_quantize_row<spec(4, 64, bf16, 850), 256>();
  check_quantize_row<spec(2, 16, fp32, 700), 64>();
  check_quantize_row<spec(2, 64, fp16, 920), 64>();    // 6 kept keys (K4V2_HC's values at d 64)
  check_quantize_row<spec(4, 32, fp16, 780), 128>();   // 8: two sorted blocks, no +∞ slots
  check_quantize_row<spec(4, 128, fp16, 875), 128>();  // 16 kept keys: the longest list
  check_quantize_row<spec(2, 128, fp16, 868), 128>();  // 17: selected bit by bit
  check_quantize_row<spec(4, 128, fp16, 1), 128>();    // rank 0: the smallest |x|
}

#if KVQ_CPU_APPEND_SIMD
// The clip selection's networks on scalars: the sort networks of 8 and 16 sort every 0/1
// input (so every input, by the 0-1 principle), and the merge keeps the K largest of a
// descending list of K and a descending block of B (16, or 8 as on AVX2, padded below
// every key when shorter than the list), sorted, for random lists with many ties.
template <int N>
void check_sort_network() {
  for (int bits = 0; bits < (1 << N); ++bits) {
    int v[N];
    for (int i = 0; i < N; ++i) v[i] = (bits >> i) & 1;
    kvq::cpu::detail::run_network<kvq::cpu::detail::kSortNetwork<N>>(v);
    for (int i = 1; i < N; ++i) ASSERT_GE(v[i - 1], v[i]) << "N " << N << " input " << bits;
  }
}

TEST(CpuQuantize, SelectionNetworksSortAndMerge) {
  using kvq::cpu::detail::kBitonicMerge;
  using kvq::cpu::detail::run_network;
  check_sort_network<8>();
  check_sort_network<16>();
  std::mt19937 rng(11);
  auto check = [&]<int K, int B>() {
    constexpr int P = int(std::bit_ceil(unsigned(K)));
    for (int trial = 0; trial < 2000; ++trial) {
      std::vector<int> a(K), b(B);
      for (int& x : a) x = int(rng() % 9);
      for (int& x : b) x = int(rng() % 9);
      std::sort(a.begin(), a.end(), std::greater<>());
      std::sort(b.begin(), b.end(), std::greater<>());
      int merged[P] = {};
      for (int i = 0; i < K; ++i) merged[i] = K - 1 - i >= B ? a[i] : std::max(a[i], b[K - 1 - i]);
      run_network<kBitonicMerge<K>>(merged);
      std::vector<int> both = a;
      both.insert(both.end(), b.begin(), b.end());
      std::sort(both.begin(), both.end(), std::greater<>());
      for (int i = 0; i < K; ++i) ASSERT_EQ(merged[P - K + i], both[i]) << "K " << K << " B " << B << " trial " << trial;
    }
  };
  [&]<int... K>(std::integer_sequence<int, K...>) {
    (check.template operator()<K, 16>(), ...);
    (check.template operator()<K, 8>(), ...);
  }(std::integer_sequence<int, 5, 6, 8, 11, 13, 16>{});
}
#endif

// Whole appends: every page byte equals what the scalar quantize_token_head writes.
// hkv × tokens (token, KV head) items go in batches of 16 (8 at d 256), and a learned
// rotation takes each batch's rows of one head in passes of 4, then 1–3: shapes with
// remainders reach the last partial batch and every pass size.
template <kvq::Policy P>
void check_append(std::uint32_t seed, int hkv = 2, int tokens = 40) {
  constexpr int D = P.head_dim;
  const int page_size = 16;
  auto c = kvq::test::make_paged_case<P>(seed, page_size, hkv, hkv, {tokens}, {1});
  std::vector<std::byte> reference = c.pool;  // the same poisoned bytes before any append
  ASSERT_TRUE(c.append_all(seed).ok());        // kvq::append_kv, the SIMD path where available
  const kvq::PagedCacheView<P> ref_cache{reference.data(), c.num_pages, c.layout()};
  std::vector<float> k(D), v(D);
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < hkv; ++h) {
      const std::size_t row = (std::size_t(t) * hkv + h) * D;
      for (int d = 0; d < D; ++d) k[d] = c.k[row + d], v[d] = c.v[row + d];
      kvq::quantize_token_head<P>(k.data(), v.data(), h, t % page_size, c.params.view(), c.layout(),
                                  ref_cache.page(c.table().page_of(0, t)));
    }
  EXPECT_EQ(std::memcmp(c.pool.data(), reference.data(), reference.size()), 0)
      << kvq::to_string(P) << ", " << hkv << " KV heads × " << tokens << " tokens";
}

TEST(CpuQuantize, AppendWritesTheScalarReferenceBytes) {
  using namespace kvq::presets;
  check_append<K4V2>(1);
  check_append<K2V2_HC>(2);
  check_append<K4V4_H.with_head_dim(256)>(3);
  check_append<K8V8_HC.with_head_dim(64)>(4);
  check_append<K2V2_R>(5);
  check_append<K4V2_R.with_head_dim(64)>(6);
  check_append<K2V2_R.with_head_dim(256)>(7);
  check_append<K4V2_HC.with_head_dim(256)>(8);  // centering and the FWHT in two parts
  // Remainders: a last batch of 15 (7 at d 256) with head runs of 6/5/5 rows (passes of
  // 4 + 2 and 4 + 1), one head of 7 rows (4 + 3), a single item.
  for (const auto& [hkv, tokens] : {std::pair{3, 37}, {1, 7}, {1, 1}}) {
    check_append<K2V2_HC>(9, hkv, tokens);
    check_append<K2V2_R>(10, hkv, tokens);
    check_append<K4V2_R.with_head_dim(64)>(11, hkv, tokens);
    check_append<K2V2_R.with_head_dim(256)>(12, hkv, tokens);
  }
}

// fp16 rows, the engines' usual source, through append_kv: with AVX-512 the d-128
// Hadamard presets' 2-bit unclipped kinds go across lanes (16 rows per vector,
// detail::quantize_rows_across_lanes), the others row by row; both against the scalar
// reference on random and adversarial rows (test_rows in fp16: NaN, ±∞, zeros of both
// signs, constants, beyond fp16), with means that allow lanes and ones that do not (huge,
// NaN), sign seeds, every group size, head counts that change the batch's head pattern,
// a remainder batch, and a position written twice inside one batch (the later row wins).
template <kvq::Policy P>
void check_append_fp16(std::uint32_t seed, int hkv, int tokens, float mean_scale) {
  constexpr int D = P.head_dim;
  const int page_size = 16, pages = (tokens + page_size - 1) / page_size + 1;
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  const auto special = kvq::test::test_rows<D>(seed);
  std::vector<kvq::half_t> k(std::size_t(tokens) * hkv * D), v(k.size());
  for (std::size_t r = 0; r < std::size_t(tokens) * hkv; ++r)
    for (int d = 0; d < D; ++d) {
      const bool adversarial = r % 2 == 1;  // every test row at 5 heads × 64 tokens
      k[r * D + d] = kvq::half_t(adversarial ? special[(r / 2) % special.size()][d] : 2.f * normal(rng) + 0.5f);
      v[r * D + d] = kvq::half_t(adversarial ? special[(r / 2 + 7) % special.size()][d] : normal(rng));
    }
  kvq::LayerParams params;
  params.key_mean.resize(std::size_t(hkv) * D);
  for (auto& m : params.key_mean) m = mean_scale * normal(rng);
  if (std::isnan(mean_scale)) params.key_mean.assign(params.key_mean.size(), 0.f), params.key_mean[D / 2] = mean_scale;
  // Pages in reverse pool order; token 5 is written again by the last token of the
  // first 16-row batch's span (position 5 twice when tokens > 8).
  std::vector<std::int32_t> indptr{0, pages - 1}, indices(pages - 1), last{tokens - (pages - 2) * page_size};
  for (int i = 0; i < pages - 1; ++i) indices[i] = pages - 1 - i;
  const kvq::PageTableView table{indptr.data(), indices.data(), last.data(), 1, page_size, pages - 1};
  std::vector<std::int32_t> batch(tokens, 0), positions(tokens);
  std::iota(positions.begin(), positions.end(), 0);
  if (tokens > 8) positions[7] = 5;
  const kvq::PageLayout<P> layout{page_size, hkv};
  std::vector<std::byte> pool(layout.page_bytes() * pages, kvq::test::kPoisonByte), reference = pool;
  ASSERT_TRUE(kvq::append_kv<P>(kvq::PagedCacheView<P>{pool.data(), pages, layout}, table, k.data(), v.data(), tokens,
                                batch.data(), positions.data(), params.view())
                  .ok());
  std::vector<float> kf(D), vf(D);
  for (int t = 0; t < tokens; ++t)
    for (int h = 0; h < hkv; ++h) {
      const std::size_t row = (std::size_t(t) * hkv + h) * D;
      for (int d = 0; d < D; ++d) kf[d] = float(k[row + d]), vf[d] = float(v[row + d]);
      kvq::quantize_token_head<P>(kf.data(), vf.data(), h, positions[t] % page_size, params.view(), layout,
                                  reference.data() + layout.page_bytes() * table.page_of(0, positions[t]));
    }
  EXPECT_EQ(std::memcmp(pool.data(), reference.data(), pool.size()), 0)
      << kvq::to_string(P) << ", " << hkv << " KV heads × " << tokens << " tokens, means ×" << mean_scale;
}

TEST(CpuQuantize, AppendFromFp16WritesTheScalarReferenceBytes) {
  using namespace kvq;
  using namespace kvq::presets;
  constexpr auto hadamard = Rotation::hadamard;
  constexpr Policy kGroups{QuantSpec{2, 16, hadamard, true, 1000, MetaType::fp16, 7},
                           QuantSpec{2, 64, hadamard, false, 1000, MetaType::fp16, 9}, 128};
  for (const auto& [hkv, tokens] : {std::pair{2, 40}, {3, 37}, {1, 1}, {16, 3}, {5, 64}, {40, 2}})
    for (float mean_scale : {1.f, 1e20f, 1e35f, std::numeric_limits<float>::quiet_NaN()}) {
      check_append_fp16<K2V2_HC>(1, hkv, tokens, mean_scale);
      check_append_fp16<kGroups>(2, hkv, tokens, mean_scale);
      check_append_fp16<K2V4_HC>(3, hkv, tokens, mean_scale);  // keys across lanes, values in rows
      check_append_fp16<K2V2_H>(4, hkv, tokens, mean_scale);
      check_append_fp16<K4V2_HC>(5, hkv, tokens, mean_scale);  // in rows
    }
}

}  // namespace
