// DESIGN §6.3: the OptR artifact is a function of its inputs and options, not of the ISA
// the calibration was compiled for. CTest runs this test in the portable test binary and
// in a -march=native twin (FMA contraction and wider vectors available to the compiler),
// each writing the artifact of the same calibration to KVQ_OPTR_ARTIFACT_OUT, and then
// compares the two files byte for byte (tests/calib/CMakeLists.txt).
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "kvq/calib/activation_file.hpp"
#include "kvq/calib/artifact.hpp"
#include "kvq/calib/optr.hpp"

namespace {

TEST(OptRIsa, WritesItsArtifactForTheCrossBuildComparison) {
  const char* out = std::getenv("KVQ_OPTR_ARTIFACT_OUT");
  if (!out) GTEST_SKIP() << "KVQ_OPTR_ARTIFACT_OUT is not set (the OptRIsa.* CTest entries set it)";
  std::filesystem::remove(out);  // a failed run must not leave an old file to compare
  const char* fixture = KVQ_TEST_DATA_DIR "/smollm2/activations_l2_15_28.safetensors";
  ASSERT_TRUE(std::filesystem::exists(fixture)) << fixture;
  constexpr kvq::Policy kP = kvq::presets::K2V2_R.with_head_dim(64);
  const auto layers = kvq::calib::read_activations(fixture, {28});
  kvq::calib::OptRConfig cfg;
  cfg.steps = 20;  // long enough that one differing bit would have spread (80 steps: 28% apart)
  cfg.eval_every = 5;
  const kvq::calib::Artifact a = kvq::calib::make_artifact(kvq::calib::calibrate(layers, kP, cfg), kP, cfg, "isa test");
  int kept = 0;
  for (const auto& l : a.layers) {
    for (std::uint8_t k : l.kept_k) kept += k;
    for (std::uint8_t v : l.kept_v) kept += v;
  }
  EXPECT_GT(kept, 0) << "no head moved off its base rotation: the comparison would test nothing";
  // fp32 rotations and fp64 (base, best) losses: a last-bit change in a loss shows here.
  const auto bytes = kvq::calib::artifact_writer(a).to_bytes();
  std::ofstream f(out, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << out;
}

}  // namespace
