#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "common/test_utils.hpp"
#include "kvq/core/quantizer.hpp"

namespace {

using kvq::MetaType;
using kvq::QuantSpec;

// Quantization of a whole row under one spec, type-erased so that each spec is
// instantiated exactly once for all tests.
struct Quantized {
  int bits = 0, group = 0;
  std::vector<std::uint8_t> packed;
  std::vector<std::uint32_t> scale_bits, lo_bits;  // raw stored metadata
  std::vector<float> scale, lo;                    // decoded metadata
  std::vector<unsigned> codes;
  std::vector<float> dequant;
};
using QuantizeFn = Quantized (*)(const std::vector<float>&);

template <class T>
std::uint32_t bits_of(T v) {
  if constexpr (sizeof(T) == 2) return v;
  else return std::bit_cast<std::uint32_t>(v);
}

template <QuantSpec S>
Quantized run(const std::vector<float>& x) {
  using Meta = kvq::MetaTraits<S.meta>;
  Quantized q;
  q.bits = S.bits;
  q.group = S.group;
  const int groups = static_cast<int>(x.size()) / S.group;
  q.packed.assign(x.size() * S.bits / 8, 0xA5);  // poison
  std::vector<kvq::meta_storage_t<S.meta>> meta(2 * groups);
  q.dequant.assign(x.size(), kvq::test::kPoison);
  for (int g = 0; g < groups; ++g) {
    kvq::quantize_group<S>(x.data() + g * S.group, q.packed.data() + g * S.group * S.bits / 8, meta.data() + 2 * g);
    kvq::dequantize_group<S>(q.packed.data() + g * S.group * S.bits / 8, meta.data() + 2 * g,
                             q.dequant.data() + g * S.group);
    q.scale_bits.push_back(bits_of(meta[2 * g]));
    q.lo_bits.push_back(bits_of(meta[2 * g + 1]));
    q.scale.push_back(Meta::decode(meta[2 * g]));
    q.lo.push_back(Meta::decode(meta[2 * g + 1]));
  }
  for (std::size_t i = 0; i < x.size(); ++i) q.codes.push_back(kvq::unpack_code<S.bits>(q.packed.data(), int(i)));
  return q;
}

QuantizeFn quantizer(int bits, int group, int clip_permille, MetaType meta) {
  QuantizeFn fn = nullptr;
  auto one = [&]<int B, int G, int C, MetaType M>() {
    if (B == bits && G == group && C == clip_permille && M == meta)
      fn = &run<QuantSpec{B, G, kvq::Rotation::none, false, C, M, 0}>;
  };
  auto metas = [&]<int B, int G, int C>() {
    one.template operator()<B, G, C, MetaType::fp16>();
    one.template operator()<B, G, C, MetaType::fp32>();
    one.template operator()<B, G, C, MetaType::bf16>();
  };
  auto clips = [&]<int B, int G>() {
    metas.template operator()<B, G, 1000>();
    metas.template operator()<B, G, 960>();
    metas.template operator()<B, G, 920>();
  };
  auto groups = [&]<int B>() {
    clips.template operator()<B, 32>();
    clips.template operator()<B, 64>();
    clips.template operator()<B, 128>();
  };
  groups.template operator()<2>();
  groups.template operator()<4>();
  groups.template operator()<8>();
  if (!fn) ADD_FAILURE() << "spec not instantiated in the test: bits " << bits << " group " << group;
  return fn;
}

MetaType meta_of(const std::string& s) {
  return s == "fp16" ? MetaType::fp16 : s == "bf16" ? MetaType::bf16 : MetaType::fp32;
}

// An independent transcription of DESIGN §2 (std::sort for the clip threshold,
// plain fp32 expressions) used to check the library on random data.
struct SpecResult {
  std::vector<unsigned> codes;
  std::vector<float> scale, lo;  // stored values, decoded
};
SpecResult spec_quantize(const std::vector<float>& x, int G, int bits, int clip_permille, MetaType meta) {
  auto store = [&](float v) {
    if (meta == MetaType::fp16) return kvq::half_bits_to_float(kvq::float_to_half_bits(v, true));
    if (meta == MetaType::bf16) return kvq::bf16_bits_to_float(kvq::float_to_bf16_bits(v, true));
    return kvq::saturate_f32(v);
  };
  SpecResult r;
  const int levels = (1 << bits) - 1;
  for (std::size_t g0 = 0; g0 < x.size(); g0 += G) {
    std::vector<float> v(x.begin() + g0, x.begin() + g0 + G);
    if (clip_permille < 1000) {
      std::vector<float> a(G);
      for (int i = 0; i < G; ++i) a[i] = std::abs(v[i]);
      std::sort(a.begin(), a.end());
      const int k = std::clamp(static_cast<int>(std::floor(clip_permille / 1000.0 * G + 1e-9)), 0, G - 1);
      for (auto& e : v) e = std::clamp(e, -a[k], a[k]);
    }
    const float lo = *std::min_element(v.begin(), v.end()), hi = *std::max_element(v.begin(), v.end());
    const float s = std::max(hi - lo, 1e-8f) / float(levels);
    const float ss = store(s), ls = store(lo);
    r.scale.push_back(ss);
    r.lo.push_back(ls);
    for (int i = 0; i < G; ++i) {
      if (ss == 0.f) {
        r.codes.push_back(0);
        continue;
      }
      const float inv = 1.f / ss;
      const float t = (v[i] - ls) * inv;
      const float c = std::floor(t + 0.5f);
      r.codes.push_back(static_cast<unsigned>(std::clamp(c, 0.f, float(levels))));
    }
  }
  return r;
}

TEST(Quantizer, GoldenVectors) {
  const auto& vectors = kvq::test::spec_vectors()["quantizer"];
  ASSERT_GT(vectors.size(), 90u);
  for (const auto& v : vectors) {
    const std::vector<float> x = v["x"].get<std::vector<float>>();
    const int clip = v["clip"].is_null() ? 1000 : static_cast<int>(std::lround(v["clip"].get<double>() * 1000));
    SCOPED_TRACE(v["note"].get<std::string>() + " bits " + std::to_string(v["bits"].get<int>()) + " group " +
                 std::to_string(v["group"].get<int>()) + " clip " + std::to_string(clip) + " " +
                 v["meta"].get<std::string>());
    const QuantizeFn fn = quantizer(v["bits"], v["group"], clip, meta_of(v["meta"]));
    ASSERT_NE(fn, nullptr);
    const Quantized q = fn(x);
    EXPECT_EQ(q.codes, v["codes"].get<std::vector<unsigned>>());
    std::string hex;
    for (auto b : q.packed) {
      char buf[3];
      std::snprintf(buf, sizeof buf, "%02x", b);
      hex += buf;
    }
    EXPECT_EQ(hex, v["packed_hex"].get<std::string>());
    EXPECT_EQ(q.scale_bits, v["scale_bits"].get<std::vector<std::uint32_t>>());
    EXPECT_EQ(q.lo_bits, v["lo_bits"].get<std::vector<std::uint32_t>>());
    const auto dq = v["dequant"].get<std::vector<float>>();
    ASSERT_EQ(dq.size(), q.dequant.size());
    for (std::size_t i = 0; i < dq.size(); ++i) {
      if (std::isnan(dq[i])) {
        EXPECT_TRUE(std::isnan(q.dequant[i]));
        continue;
      }
      const float ulp = std::nextafter(std::abs(dq[i]), INFINITY) - std::abs(dq[i]);
      EXPECT_LE(std::abs(q.dequant[i] - dq[i]), ulp) << "element " << i;
    }
  }
}

TEST(Quantizer, MatchesSpecFormulaOnRandomData) {
  std::uint32_t seed = 100;
  for (int bits : {2, 4, 8})
    for (int group : {32, 64, 128})
      for (int clip : {1000, 960, 920})
        for (MetaType meta : {MetaType::fp16, MetaType::bf16, MetaType::fp32}) {
          const QuantizeFn fn = quantizer(bits, group, clip, meta);
          ASSERT_NE(fn, nullptr);
          for (int rep = 0; rep < 20; ++rep) {
            const float spread = std::pow(10.f, float(rep % 7) - 3.f);  // 1e-3 .. 1e3
            const auto x = kvq::test::random_normal(256, ++seed, spread, spread * float(rep % 3 - 1));
            const Quantized q = fn(x);
            const SpecResult ref = spec_quantize(x, group, bits, clip, meta);
            ASSERT_EQ(q.codes, ref.codes) << "bits " << bits << " group " << group << " clip " << clip;
            ASSERT_EQ(q.scale, ref.scale);
            ASSERT_EQ(q.lo, ref.lo);
          }
        }
}

TEST(Quantizer, ErrorAtMostHalfScaleWithoutClipping) {
  // fp32 metadata stores the exact group lo/scale, so each element is within s/2
  // (+ fp32 rounding of the dequantization) of its reconstruction.
  for (auto [bits, group] : {std::pair{2, 32}, {4, 64}, {8, 128}, {2, 128}}) {
    const QuantizeFn fn = quantizer(bits, group, 1000, MetaType::fp32);
    for (int rep = 0; rep < 50; ++rep) {
      const auto x = kvq::test::random_normal(256, 1000 + rep, 1.f + rep);
      const Quantized q = fn(x);
      for (std::size_t i = 0; i < x.size(); ++i) {
        const float s = q.scale[i / group];
        ASSERT_LE(std::abs(q.dequant[i] - x[i]), 0.5f * s * (1 + 1e-5f) + 1e-6f * std::abs(x[i]))
            << "bits " << bits << " element " << i;
      }
    }
  }
}

TEST(Quantizer, ClipThresholdIsTheSpecifiedOrderStatistic) {
  // x = 1, −2, 3, …, 31, −32: |x| sorted is 1..32, ⌊0.96·32⌋ = 30 → t = 31,
  // so only −32 is clipped (to −31).
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = float(i + 1) * (i % 2 ? -1.f : 1.f);
  const Quantized q = quantizer(4, 32, 960, MetaType::fp32)(x);
  EXPECT_EQ(q.lo[0], -31.f);
  EXPECT_EQ(q.scale[0], 62.f / 15.f);
  EXPECT_EQ(q.codes[31], 0u);
  EXPECT_EQ(q.codes[30], 15u);
  EXPECT_EQ(q.dequant[31], -31.f);
  // ⌊0.92·32⌋ = 29 → t = 30: both 31 and −32 are clipped.
  const Quantized q2 = quantizer(4, 32, 920, MetaType::fp32)(x);
  EXPECT_EQ(q2.lo[0], -30.f);
  EXPECT_EQ(q2.scale[0], 4.f);
}

TEST(Quantizer, ConstantGroupStoresZeroScaleAndZeroCodes) {
  const Quantized q = quantizer(2, 32, 1000, MetaType::fp16)(std::vector<float>(64, 0.3f));
  EXPECT_EQ(q.scale_bits[0], 0u);  // 1e-8/3 underflows in fp16
  for (auto c : q.codes) EXPECT_EQ(c, 0u);
  for (auto d : q.dequant) EXPECT_EQ(d, kvq::half_bits_to_float(kvq::float_to_half_bits(0.3f)));
  const Quantized q32 = quantizer(4, 32, 1000, MetaType::fp32)(std::vector<float>(32, -7.f));
  EXPECT_GT(q32.scale[0], 0.f);  // fp32 keeps 1e-8/15
  for (auto d : q32.dequant) EXPECT_EQ(d, -7.f);
}

TEST(Quantizer, HugeValuesSaturateMetadata) {
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = float(i - 16) * 1e6f;
  const Quantized q = quantizer(4, 32, 1000, MetaType::fp16)(x);
  EXPECT_EQ(q.scale_bits[0], 0x7bffu);  // 65504
  EXPECT_EQ(q.lo_bits[0], 0xfbffu);     // −65504
  for (auto d : q.dequant) EXPECT_TRUE(std::isfinite(d));
  for (auto c : q.codes) EXPECT_LE(c, 15u);

  std::vector<float> y(32, 3e38f);
  y[0] = -3e38f;  // hi − lo overflows fp32: the scale saturates to FLT_MAX, nothing is UB
  const Quantized q8 = quantizer(8, 32, 1000, MetaType::fp32)(y);
  EXPECT_EQ(q8.scale[0], std::numeric_limits<float>::max());
  EXPECT_EQ(q8.codes[0], 0u);
  EXPECT_EQ(q8.codes[1], 255u);
}

TEST(Quantizer, NonFiniteGroupDequantizesToNaNAndOnlyThatGroup) {
  for (float bad : {NAN, INFINITY, -INFINITY})
    for (MetaType meta : {MetaType::fp16, MetaType::bf16, MetaType::fp32}) {
      auto x = kvq::test::random_normal(64, 5);
      x[40] = bad;
      const Quantized q = quantizer(2, 32, 960, meta)(x);
      EXPECT_TRUE(std::isnan(q.scale[1]));
      for (int i = 32; i < 64; ++i) {
        EXPECT_EQ(q.codes[i], 0u);
        EXPECT_TRUE(std::isnan(q.dequant[i]));
      }
      for (int i = 0; i < 32; ++i) EXPECT_TRUE(std::isfinite(q.dequant[i]));
    }
}

}  // namespace
