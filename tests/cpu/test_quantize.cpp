// The SIMD append path (kvq/cpu/quantize.hpp) against the scalar reference that CUDA
// runs too: the same bits for the FWHT, every group quantizer shape and whole
// quantize-appends, on random rows and on adversarial ones (NaN/Inf, constant groups,
// signed zeros, fp16 saturation, ranges below the metadata's resolution).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "common/paged_case.hpp"
#include "kvq/cache/append.hpp"
#include "kvq/cpu/quantize.hpp"

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

// Rows of D floats: random normals at several scales, then adversarial patterns.
template <int D>
std::vector<std::vector<float>> test_rows(std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<float>> rows;
  for (float scale : {1.f, 1e-3f, 300.f, 1e6f}) {
    std::normal_distribution<float> n(0.f, scale);
    for (int k = 0; k < 8; ++k) {
      std::vector<float> r(D);
      for (auto& x : r) x = n(rng);
      rows.push_back(r);
    }
  }
  std::vector<float> r(D, 0.f);
  rows.push_back(r);                                        // all +0
  for (int i = 0; i < D; i += 3) r[i] = -0.f;
  rows.push_back(r);                                        // ±0 mixed: the zero extremum's sign
  for (int i = 0; i < D; ++i) r[i] = i % 5 == 0 ? -0.f : float(i % 7) * 0.25f;
  rows.push_back(r);                                        // min is a signed zero
  for (int i = 0; i < D; ++i) r[i] = -float(i % 7) * 0.25f;
  for (int i = 0; i < D; i += 6) r[i] = (i % 12 == 0) ? 0.f : -0.f;
  rows.push_back(r);                                        // max is a signed zero
  std::fill(r.begin(), r.end(), 3.25f);
  rows.push_back(r);                                        // constant
  for (int i = 0; i < D; ++i) r[i] = 1.f + float(i % 3) * 1e-9f;
  rows.push_back(r);                                        // range below fp16's resolution
  for (int i = 0; i < D; ++i) r[i] = (i % 2 ? 1.f : -1.f) * 7e4f * float(1 + i % 3);
  rows.push_back(r);                                        // beyond fp16: saturating metadata
  for (int i = 0; i < D; ++i) r[i] = 3e38f * (1.f - float(i % 3) * 0.01f);
  rows.push_back(r);                                        // finite, but sums overflow
  for (float sign : {1.f, -1.f}) {
    for (int i = 0; i < D; ++i) r[i] = sign * (1e6f + float(i % 3) * 0.0625f);
    rows.push_back(r);                                      // lo beyond fp16, small range
  }
  for (int i = 0; i < D; ++i) r[i] = i % 2 ? 3e38f : 1e30f;
  rows.push_back(r);                                        // codes far beyond 2^31 before the clamp
  std::fill(r.begin(), r.end(), 1e30f + 1e24f);
  rows.push_back(r);                                        // constant, lo rounded by bf16 metadata
  for (int i = 0; i < D; ++i) r[i] = float(i) * 1e-40f;
  rows.push_back(r);                                        // denormals
  for (int special : {0, 1, 2}) {
    std::normal_distribution<float> n;
    for (auto& x : r) x = n(rng);
    const float v = special == 0 ? std::nanf("") : (special == 1 ? kInf : -kInf);
    r[5] = v;
    r[D - 1] = v;
    rows.push_back(r);                                      // non-finite groups next to finite ones
  }
  return rows;
}

// Bit-identical except that a NaN may carry another sign or payload (which NaN an add
// of two NaNs returns depends on operand order, which compilers choose); the quantizer
// stores every non-finite group the same way.
template <int D>
void check_fwht(std::uint32_t sign_seed) {
  int index = 0;
  for (const auto& row : test_rows<D>(sign_seed + 3)) {
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

// Rows on the rounding boundary of the code formula ⌊(x − lo)·inv + 0.5⌋: every group
// holds 0 (its min, so lo = 0), a random max, and values x just below s/2 for which the
// separately rounded product x·inv, plus 0.5, gives code 1 while a fused multiply-add
// gives 0 (x·inv rounds up to 0.5 − 2⁻²⁵, whose sum with 0.5 ties to even at 1). A SIMD
// path that let the compiler fuse its multiply and add (GCC contracts intrinsics too)
// writes other codes than the scalar reference here. `found` counts such values.
template <kvq::QuantSpec S, int D>
std::vector<std::vector<float>> rounding_boundary_rows(std::uint32_t seed, int& found) {
  using Meta = kvq::MetaTraits<S.meta>;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> mantissa(1.f, 2.f);
  found = 0;
  std::vector<std::vector<float>> rows(4, std::vector<float>(D));
  for (auto& row : rows)
    for (int g = 0; g < D / S.group; ++g) {
      float* x = row.data() + g * S.group;
      const float hi = std::ldexp(mantissa(rng), int(rng() % 16) - 8);
      const float s = Meta::decode(Meta::encode(kvq::div_rn(hi, float(S.levels()))));
      const float inv = kvq::div_rn(1.f, s);
      x[0] = 0.f;
      x[1] = hi;
      for (int i = 2; i < S.group; ++i) {
        float v = kvq::mul_rn(0.5f, s);
        for (int step = 0; step < 16; ++step) v = std::nextafter(v, 0.f);
        x[i] = kvq::mul_rn(0.5f, s);
        for (int step = 0; step < 32; ++step, v = std::nextafter(v, hi)) {
          const bool split = std::floor(kvq::add_rn(kvq::mul_rn(v, inv), 0.5f)) == 1.f;
          if (split && std::floor(std::fma(v, inv, 0.5f)) == 0.f) {
            x[i] = v;
            ++found;
            break;
          }
        }
      }
    }
  return rows;
}

// All test rows quantized in one quantize_rows_fast call (its phases run across rows),
// each row against the scalar quantize_row.
template <kvq::QuantSpec S, int D>
void check_quantize_row() {
  using Meta = kvq::MetaTraits<S.meta>;
  using MetaStorage = typename Meta::storage;
  constexpr int kBytes = D * S.bits / 8, kMeta = 2 * (D / S.group), kMaxRows = 80;
  auto rows = test_rows<D>(S.bits * 1000 + S.group);
  if constexpr (S.meta == kvq::MetaType::fp16)
    for (float m : {1.3f, 1.45f, 1.49f}) {
      // s = m·2⁻²⁴ is stored as the subnormal 2⁻²⁴, so the group's max gives
      // ⌊m·levels + ½⌋ > levels before the clamp (the byte clamp of the SIMD path).
      std::vector<float> r(D);
      for (int i = 0; i < D; ++i) r[i] = i % 2 ? m * std::ldexp(1.f, -24) * float(S.levels()) : 0.f;
      rows.push_back(r);
    }
  if constexpr (S.clips()) {
    // The clip threshold's rank lands on ties: many equal |x| of both signs, or zeros of
    // both signs (the rank-k zero's sign is the threshold's) beside larger or denormal
    // values.
    std::vector<float> r(D);
    for (int i = 0; i < D; ++i) r[i] = (i % 2 ? 1.f : -1.f) * float(1 + i % 4) * 0.375f;
    rows.push_back(r);
    for (int zeros_per_16 : {15, 14, 12, 8}) {
      for (int i = 0; i < D; ++i) r[i] = i % 16 < zeros_per_16 ? (i % 3 ? 0.f : -0.f) : -2.5f * float(1 + i % 5);
      rows.push_back(r);
      for (int i = 0; i < D; ++i) r[i] = i % 16 < zeros_per_16 ? (i % 3 ? -0.f : 0.f) : 1e-40f * float(1 + i % 5);
      rows.push_back(r);  // the values beyond the zeros are denormals
    }
  }
  int boundary_values = 0;
  for (auto& row : rounding_boundary_rows<S, D>(S.bits * 7 + S.group, boundary_values)) rows.push_back(row);
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

constexpr kvq::QuantSpec spec(int bits, int group, kvq::MetaType meta = kvq::MetaType::fp16, int clip = 1000) {
  return kvq::QuantSpec{bits, group, kvq::Rotation::none, false, clip, meta, 0};
}

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
  // Clipping: the threshold found from the top (detail::clip_rows) against the scalar
  // all-pairs ranking.
  check_quantize_row<spec(4, 32, fp16, 960), 128>();
  check_quantize_row<spec(2, 32, fp16, 900), 128>();
  check_quantize_row<spec(2, 128, fp16, 920), 128>();
  check_quantize_row<spec(4, 64, bf16, 850), 256>();
  check_quantize_row<spec(2, 16, fp32, 700), 64>();
  check_quantize_row<spec(4, 128, fp16, 1), 128>();  // rank 0: the smallest |x|
}

// Whole appends: every page byte equals what the scalar quantize_token_head writes.
template <kvq::Policy P>
void check_append(std::uint32_t seed) {
  constexpr int D = P.head_dim;
  const int hkv = 2, tokens = 40, page_size = 16;
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
  EXPECT_EQ(std::memcmp(c.pool.data(), reference.data(), reference.size()), 0) << kvq::to_string(P);
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
}

}  // namespace
