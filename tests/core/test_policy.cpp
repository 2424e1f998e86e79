#include <gtest/gtest.h>

#include "kvq/core/policy.hpp"

namespace {

using namespace kvq;

TEST(Policy, BitsPerElementIncludeMetadata) {
  // DESIGN §5 examples at d = 128 with fp16 scale and min.
  EXPECT_DOUBLE_EQ((QuantSpec{2, 128}).bits_per_element(), 2.25);
  EXPECT_DOUBLE_EQ((QuantSpec{4, 32}).bits_per_element(), 5.0);
  EXPECT_DOUBLE_EQ(presets::K4V2.bits_per_element(), (5.0 + 2.25) / 2);
  EXPECT_DOUBLE_EQ(presets::K2V2.compression_vs_bf16(), 16.0 / ((3.0 + 2.25) / 2));
  EXPECT_DOUBLE_EQ((QuantSpec{8, 32, Rotation::none, false, 1000, MetaType::fp32}).bits_per_element(), 10.0);
}

TEST(Policy, PresetsAreValidAtEveryHeadDim) {
  for (const auto& p : presets::all)
    for (int d : {64, 128, 256}) EXPECT_TRUE(is_valid_policy(p.policy.with_head_dim(d))) << p.name << " d=" << d;
  EXPECT_EQ(presets::K2V2.with_head_dim(64).value.group, 64);  // capped to head_dim
  EXPECT_EQ(presets::K2V2.with_head_dim(256).value.group, 128);
}

TEST(Policy, RunTimeValidationRejectsWhatCompileTimeRejects) {
  Policy p = presets::K4V2;
  p.key.bits = 3;
  EXPECT_FALSE(is_valid_policy(p));
  p = presets::K4V2;
  p.value.group = 48;
  EXPECT_FALSE(is_valid_policy(p));
  p = presets::K4V2;
  p.head_dim = 96;
  EXPECT_FALSE(is_valid_policy(p));
  p = presets::K4V2;
  p.key.sign_seed = 7;  // signs without Hadamard
  EXPECT_FALSE(is_valid_policy(p));
  p.key.rotation = Rotation::hadamard;
  EXPECT_TRUE(is_valid_policy(p));
  static_assert(is_valid_policy(presets::K2V2_R));
  static_assert(!is_valid_policy(presets::K2V2.with_head_dim(32)));
}

TEST(Policy, PresetRecipes) {
  EXPECT_EQ(presets::K4V2_HC.key.rotation, Rotation::hadamard);
  EXPECT_TRUE(presets::K4V2_HC.key.centered);
  EXPECT_FALSE(presets::K4V2_HC.value.centered);
  EXPECT_EQ(presets::K4V2_HC.key.clip_permille, 1000);  // 2-bit values clipped, 4-bit keys not
  EXPECT_EQ(presets::K4V2_HC.value.clip_permille, 920);
  EXPECT_EQ(presets::K2V2_HC.value.clip_permille, 1000);
  EXPECT_EQ(presets::K2V2_R.key.clip_permille, 960);
  EXPECT_EQ(presets::K2V2_R.value.clip_permille, 920);
  EXPECT_EQ(presets::K2V2_R.value.rotation, Rotation::dense);
}

// The one description of a policy (messages, reports, the artifact's "policy" field);
// the enum names are stored in calibration artifacts and must not change.
TEST(Policy, ToStringIsStable) {
  EXPECT_STREQ(to_string(Rotation::none), "none");
  EXPECT_STREQ(to_string(Rotation::hadamard), "hadamard");
  EXPECT_STREQ(to_string(Rotation::dense), "dense");
  EXPECT_STREQ(to_string(MetaType::fp16), "fp16");
  EXPECT_STREQ(to_string(MetaType::bf16), "bf16");
  EXPECT_STREQ(to_string(MetaType::fp32), "fp32");
  EXPECT_EQ(to_string(presets::K4V2), "K{b4 g32 none clip1000 fp16} V{b2 g128 none clip1000 fp16} head_dim 128");
  EXPECT_EQ(to_string(presets::K2V2_R.with_head_dim(64)),
            "K{b2 g32 dense centered clip960 fp16} V{b2 g64 dense clip920 fp16} head_dim 64");
  Policy p = presets::K4V2_H.with_meta(MetaType::bf16);
  p.key.sign_seed = 7;
  EXPECT_EQ(to_string(p.key), "b4 g32 hadamard clip1000 bf16 seed7");
}

// Run-time spellings: a preset name, then :key=value modifiers applied left to right.
TEST(Policy, ParsesSpellings) {
  Policy p{};
  ASSERT_TRUE(parse_policy("K4V2_HC", p).ok());
  EXPECT_EQ(p, presets::K4V2_HC);
  ASSERT_TRUE(parse_policy("K4V2_HC:vclip=1000", p).ok());  // the preset before 2026-12-05
  Policy unclipped = presets::K4V2_H;
  unclipped.key.centered = true;
  EXPECT_EQ(p, unclipped);
  ASSERT_TRUE(parse_policy("K2V2_R:vclip=1000", p).ok());
  EXPECT_EQ(p, presets::K2V2_R.with_clip(960, 1000));
  ASSERT_TRUE(parse_policy("K4V2_HC:vclip=920:kclip=1", p).ok());
  EXPECT_EQ(p, presets::K4V2_HC.with_clip(1, 920));
  ASSERT_TRUE(parse_policy("K4V2:meta=bf16:kclip=960:kclip=970", p).ok());  // the last one wins
  EXPECT_EQ(p, presets::K4V2.with_meta(MetaType::bf16).with_clip(970, 1000));
  ASSERT_TRUE(parse_policy("K8V8:meta=fp32", p).ok());
  EXPECT_EQ(p.value.meta, MetaType::fp32);
}

TEST(Policy, RejectsBadSpellingsAndLeavesTheOutputAlone) {
  const Policy sentinel = presets::K8V8;
  for (const char* bad : {"", "K3V3", "k4v2", "K4V2 ", "K4V2:", "K4V2::vclip=5", "K4V2:vclip", "K4V2:vclip=",
                          "K4V2:vclip=0", "K4V2:vclip=1001", "K4V2:vclip=99999999999", "K4V2:vclip=-5",
                          "K4V2:vclip=9x", "K4V2:clip=900", "K4V2:meta=fp8", "K4V2:meta=", "K4V2,K2V2"}) {
    Policy p = sentinel;
    const Status s = parse_policy(bad, p);
    EXPECT_EQ(s.code(), StatusCode::invalid_argument) << "'" << bad << "'";
    EXPECT_FALSE(s.message().empty());
    EXPECT_EQ(p, sentinel) << "'" << bad << "'";
  }
  Policy p{};
  EXPECT_NE(parse_policy("K4V2:kclip=2000", p).message().find("kclip=2000"), std::string::npos);
  EXPECT_NE(parse_policy("K3V3", p).message().find("K4V2_HC"), std::string::npos);  // lists the presets
}

}  // namespace
