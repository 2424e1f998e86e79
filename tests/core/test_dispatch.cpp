#include <gtest/gtest.h>

#include "kvq/core/dispatch.hpp"

namespace {

TEST(Dispatch, HeadDimSelectsTheInstantiatedValue) {
  int seen = 0;
  EXPECT_TRUE((kvq::dispatch_head_dim<64, 128>(128, [&]<int D>() { seen = D; }).ok()));
  EXPECT_EQ(seen, 128);
  const kvq::Status s = kvq::dispatch_head_dim<64, 128>(96, [&]<int D>() { seen = D; });
  EXPECT_EQ(s.code(), kvq::StatusCode::unsupported);
  EXPECT_NE(s.message().find("96"), std::string::npos);
  EXPECT_NE(s.message().find("64, 128"), std::string::npos);
}

TEST(Dispatch, MacroFormsPropagateStatus) {
  const kvq::Status s = KVQ_DISPATCH_HEAD_DIM(64, D, (64, 256), {
    return kvq::Status(kvq::StatusCode::invalid_argument, "from body " + std::to_string(D));
  });
  EXPECT_EQ(s.message(), "from body 64");
  kvq::Policy got{};
  const kvq::Status ok = KVQ_DISPATCH_PRESET("K2V4_H", 64, P, { got = P; });
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(got, kvq::presets::K2V4_H.with_head_dim(64));
}

TEST(Dispatch, UnknownPresetNamesTheAvailableOnes) {
  const kvq::Status s = kvq::dispatch_preset<128>("K3V3", [&]<kvq::Policy P>() {});
  EXPECT_EQ(s.code(), kvq::StatusCode::unsupported);
  EXPECT_NE(s.message().find("K3V3"), std::string::npos);
  EXPECT_NE(s.message().find("K4V2_HC"), std::string::npos);
}

// An engine's own list: spellings match by value, at the dispatched head_dim, and
// nothing outside the list is instantiated or reachable.
constexpr kvq::presets::NamedPolicy kShipped[] = {
    {"K4V2", kvq::presets::K4V2},
    {"K2V2_R:vclip=1000", kvq::presets::K2V2_R.with_clip(960, 1000)},
};

TEST(Dispatch, AnInstantiatedListSelectsByValue) {
  kvq::Policy got{};
  auto body = [&]<kvq::Policy P>() { got = P; };
  EXPECT_TRUE((kvq::dispatch_preset<64, kShipped>("K2V2_R:vclip=1000", body).ok()));
  EXPECT_EQ(got, kvq::presets::K2V2_R.with_clip(960, 1000).with_head_dim(64));
  // Another spelling of the same policy.
  EXPECT_TRUE((kvq::dispatch_preset<128, kShipped>("K2V2_R:kclip=960:vclip=1000", body).ok()));
  EXPECT_EQ(got, kvq::presets::K2V2_R.with_clip(960, 1000));
  // A valid policy that is not in the list, and a bad spelling.
  const kvq::Status absent = kvq::dispatch_preset<128, kShipped>("K2V2_R", body);
  EXPECT_EQ(absent.code(), kvq::StatusCode::unsupported);
  EXPECT_NE(absent.message().find("not instantiated"), std::string::npos);
  EXPECT_NE(absent.message().find("K2V2_R:vclip=1000"), std::string::npos);
  const kvq::Status bad = kvq::dispatch_preset<128, kShipped>("K4V2:vclip=0", body);
  EXPECT_EQ(bad.code(), kvq::StatusCode::unsupported);
  EXPECT_NE(bad.message().find("vclip=0"), std::string::npos);
  EXPECT_EQ(got, kvq::presets::K2V2_R.with_clip(960, 1000));  // no body ran
}

}  // namespace
