// Uses the calib and io components through the package: a policy's artifact metadata
// round-trips through safetensors in memory (kvq::io), and the OptR artifact reader
// (kvq::calib, Eigen) accepts a one-layer artifact with identity rotations.
#include <cstdio>
#include <vector>

#include <kvq/calib/artifact.hpp>
#include <kvq/io/safetensors.hpp>

int main() {
  constexpr kvq::Policy P = kvq::presets::K4V2_R.with_head_dim(64);
  kvq::calib::Artifact a;
  a.policy = P;
  kvq::calib::ArtifactLayer L;
  L.hkv = 1;
  L.head_dim = 64;
  L.mu_k.assign(64, 0.f);
  L.nu_v.assign(64, 0.f);
  L.r_k.assign(64 * 64, 0.f);
  for (int i = 0; i < 64; ++i) L.r_k[i * 64 + i] = 1.f;
  L.r_v = L.r_k;
  L.kept_k = L.kept_v = {0};
  L.loss_k = L.loss_v = {1.0, 1.0};
  a.layers.push_back(L);
  const auto bytes = kvq::calib::artifact_writer(a).to_bytes();
  const kvq::calib::Artifact back = kvq::calib::read_artifact(kvq::io::SafetensorsFile::from_bytes(bytes));
  const kvq::LayerParams p = kvq::calib::layer_params<P>(back, 0);
  std::printf("artifact: %s, %zu rotation floats\n", kvq::to_string(back.policy).c_str(), p.key_rotation.size());
  return back.policy == P && p.key_rotation.size() == 64 * 64 ? 0 : 1;
}
