#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "kvq/calib/fake_quant.hpp"

namespace {

template <kvq::QuantSpec S>
void expect_matches_deployment(unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> N(0.f, 1.f);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> x(S.group);
    for (auto& v : x) v = N(rng) * (trial % 5 == 0 ? 30.f : 1.f) + (trial % 3 == 0 ? 5.f : 0.f);
    if (trial % 7 == 0) x[trial % S.group] = 100.f;  // an outlier the clip should cut
    std::vector<std::uint8_t> packed(S.group * S.bits / 8);
    kvq::meta_storage_t<S.meta> meta[2];
    kvq::quantize_group<S>(x.data(), packed.data(), meta);
    std::vector<float> ref(S.group), got(S.group);
    kvq::dequantize_group<S>(packed.data(), meta, ref.data());
    kvq::calib::fake_quant_group(S, x.data(), got.data());
    for (int i = 0; i < S.group; ++i) {
      std::uint32_t a, b;
      std::memcpy(&a, &ref[i], 4);
      std::memcpy(&b, &got[i], 4);
      ASSERT_EQ(a, b) << "trial " << trial << " element " << i;
    }
  }
}

using kvq::MetaType;
using kvq::QuantSpec;
using kvq::Rotation;

TEST(FakeQuant, BitIdenticalToDeploymentQuantizer) {
  expect_matches_deployment<QuantSpec{2, 32, Rotation::dense, true, 960, MetaType::fp16, 0}>(1);
  expect_matches_deployment<QuantSpec{2, 64, Rotation::dense, false, 920, MetaType::fp16, 0}>(2);
  expect_matches_deployment<QuantSpec{4, 32, Rotation::none, false, 1000, MetaType::fp16, 0}>(3);
  expect_matches_deployment<QuantSpec{8, 128, Rotation::none, false, 1000, MetaType::bf16, 0}>(4);
  expect_matches_deployment<QuantSpec{2, 16, Rotation::none, false, 500, MetaType::fp32, 0}>(5);
}

// The O(G) selection against the reference's rank counting, bit for bit, on groups full
// of ties and signed zeros (where the index tie-break decides the threshold's sign), for
// both selection paths: few elements above the rank (insertion) and many (nth_element).
TEST(FakeQuant, ClipThresholdIsTheReferenceRankValue) {
  std::mt19937 rng(9);
  const float pool[] = {0.f, -0.f, 1.f, -1.f, 2.f, -2.f, 0.5f, 3.f};
  std::normal_distribution<float> N(0.f, 1.f);
  for (const auto& [group, clip] : {std::pair{32, 960}, {64, 920}, {16, 500}, {128, 500}, {128, 920}, {256, 990}}) {
    const QuantSpec s{2, group, Rotation::none, false, clip, MetaType::fp16, 0};
    const int rank = kvq::clip_rank(group, clip);
    for (int trial = 0; trial < 300; ++trial) {
      std::vector<float> x(group);
      for (auto& v : x) v = trial % 3 == 2 ? N(rng) : pool[rng() % (trial % 3 == 0 ? 2 : 8)];
      const float want = kvq::kth_smallest_abs(x.data(), group, rank), got = kvq::calib::clip_threshold(s, x.data());
      ASSERT_EQ(kvq::float_bits(got), kvq::float_bits(want)) << "group " << group << " clip " << clip << " trial " << trial;
    }
  }
}

TEST(FakeQuant, NonFiniteGroupBecomesNaN) {
  QuantSpec s{2, 16, Rotation::none, false, 1000, MetaType::fp16, 0};
  std::vector<float> x(16, 1.f), out(16);
  x[3] = std::numeric_limits<float>::infinity();
  kvq::calib::fake_quant_group(s, x.data(), out.data());
  for (float v : out) EXPECT_TRUE(std::isnan(v));
}

TEST(FakeQuant, RejectsBadSpecs) {
  QuantSpec s{3, 32, Rotation::none, false, 1000, MetaType::fp16, 0};
  EXPECT_THROW(kvq::calib::check_spec(s, 64), kvq::Error);
  s.bits = 2;
  s.group = 48;
  EXPECT_THROW(kvq::calib::check_spec(s, 64), kvq::Error);
  s.group = 32;
  s.clip_permille = 0;
  EXPECT_THROW(kvq::calib::check_spec(s, 64), kvq::Error);
}

}  // namespace
