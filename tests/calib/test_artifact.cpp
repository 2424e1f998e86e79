#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "kvq/calib/artifact.hpp"
#include "synthetic.hpp"

using namespace kvq::calib;

namespace {

constexpr kvq::Policy kP = kvq::presets::K2V2_R.with_head_dim(64);

const Artifact& sample() {
  static const Artifact a = [] {
    std::vector<LayerActivations> ls;
    for (int l : {3, 7}) ls.push_back(synth::synthetic_layer(l, 4, 64, 2, 2, 64, 16, l));
    OptRConfig c;
    c.prefix = 4;
    c.recent = 8;
    c.qwin = 8;
    c.steps = 4;
    c.eval_every = 2;
    c.margin = 0;
    return make_artifact(calibrate(ls, kP, c), kP, c, "synthetic");
  }();
  return a;
}

std::vector<std::byte> bytes_of(const Artifact& a) { return artifact_writer(a).to_bytes(); }

Artifact reread(std::vector<std::byte> b) { return read_artifact(kvq::io::SafetensorsFile::from_bytes(std::move(b))); }

TEST(Artifact, RoundTripIsBitExact) {
  const Artifact& a = sample();
  ASSERT_EQ(a.layers.size(), 2u);
  const auto path = std::filesystem::temp_directory_path() / "kvq_calib_artifact_test.safetensors";
  write_artifact(a, path);
  const Artifact b = read_artifact(path);
  std::filesystem::remove(path);
  EXPECT_TRUE(b.policy == kP);
  EXPECT_EQ(b.info, a.info);
  ASSERT_EQ(b.layers.size(), a.layers.size());
  for (std::size_t i = 0; i < a.layers.size(); ++i) {
    const auto &x = a.layers[i], &y = b.layers[i];
    EXPECT_EQ(x.layer, y.layer);
    ASSERT_EQ(x.r_k.size(), y.r_k.size());
    EXPECT_EQ(std::memcmp(x.r_k.data(), y.r_k.data(), 4 * x.r_k.size()), 0);
    EXPECT_EQ(std::memcmp(x.r_v.data(), y.r_v.data(), 4 * x.r_v.size()), 0);
    EXPECT_EQ(std::memcmp(x.mu_k.data(), y.mu_k.data(), 4 * x.mu_k.size()), 0);
    EXPECT_EQ(std::memcmp(x.loss_k.data(), y.loss_k.data(), 8 * x.loss_k.size()), 0);
    EXPECT_TRUE(x == y);
  }
  // Written bytes are reproducible.
  EXPECT_EQ(bytes_of(a), bytes_of(b));
}

TEST(Artifact, LoaderProducesRunTimeParameters) {
  const Artifact& a = sample();
  const kvq::LayerParams p = layer_params<kP>(a, 7);
  EXPECT_EQ(p.key_mean.size(), 2u * 64);
  EXPECT_EQ(p.key_rotation.size(), 2u * 64 * 64);
  EXPECT_TRUE(p.value_mean.empty());  // K2V2_R does not center values
  EXPECT_EQ(p.value_rotation, a.layers[1].r_v);
  EXPECT_THROW(layer_params<kP>(a, 5), kvq::Error);
}

TEST(Artifact, HeadTransformsMatchStoredRotations) {
  const Artifact& a = sample();
  const auto t = head_transforms(a, 3);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(static_cast<float>(t[1].RK(2, 5)), a.layers[0].r_k[(64 + 2) * 64 + 5]);
  EXPECT_EQ(static_cast<float>(t[0].mu_k[7]), a.layers[0].mu_k[7]);
  EXPECT_EQ(t[0].nu_v.squaredNorm(), 0.0);  // K2V2_R does not center values
  EXPECT_LT(orthogonality_error(t[1].RV), 1e-5);
  EXPECT_THROW(head_transforms(a, 4), kvq::Error);
}

TEST(Artifact, PolicyMismatchIsRejectedClearly) {
  const Artifact& a = sample();
  try {
    require_policy<kvq::presets::K2V2_R>(a);  // head_dim 128
    FAIL() << "mismatch accepted";
  } catch (const kvq::Error& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 64"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("head_dim 128"), std::string::npos) << e.what();
  }
  EXPECT_THROW(require_policy<kvq::presets::K4V2_R.with_head_dim(64)>(a), kvq::Error);  // key bits
  EXPECT_THROW(require_policy<kP.with_clip(1000, 920)>(a), kvq::Error);
  EXPECT_NO_THROW(require_policy<kP>(a));
}

TEST(Artifact, CorruptionIsRejected) {
  const std::vector<std::byte> good = bytes_of(sample());
  // Truncation.
  EXPECT_THROW(reread({good.begin(), good.begin() + good.size() / 2}), kvq::Error);
  // Rotations that are not orthogonal, and non-finite means.
  Artifact a = sample();
  a.layers[0].r_k[5] += 0.5f;
  EXPECT_THROW(reread(bytes_of(a)), kvq::Error);
  a = sample();
  a.layers[0].mu_k[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(reread(bytes_of(a)), kvq::Error);
  // Missing tensor, wrong format, wrong shapes, bad metadata.
  {
    kvq::io::SafetensorsWriter w = artifact_writer(sample());
    w.set_metadata("format", "something.else");
    EXPECT_THROW(reread(w.to_bytes()), kvq::Error);
  }
  {
    kvq::io::SafetensorsWriter w = artifact_writer(sample());
    w.set_metadata("layers", "3,7,9");
    EXPECT_THROW(reread(w.to_bytes()), kvq::Error);
  }
  {
    kvq::io::SafetensorsWriter w = artifact_writer(sample());
    w.set_metadata("key_bits", "two");
    EXPECT_THROW(reread(w.to_bytes()), kvq::Error);
  }
  {
    kvq::io::SafetensorsWriter w = artifact_writer(sample());
    w.set_metadata("key_group", "48");
    EXPECT_THROW(reread(w.to_bytes()), kvq::Error);
  }
  {
    kvq::io::SafetensorsWriter w;
    w.set_metadata("format", kArtifactFormat);
    w.set_metadata("head_dim", "64");
    EXPECT_THROW(reread(w.to_bytes()), kvq::Error);  // no policy keys
  }
  // Inconsistent in-memory artifacts are refused at write time.
  a = sample();
  a.layers[0].r_v.pop_back();
  EXPECT_THROW(bytes_of(a), kvq::Error);
}

}  // namespace
