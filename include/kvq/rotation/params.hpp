// kvq/rotation/params.hpp — the run-time centering/rotation parameters of one layer
// (DESIGN §3): RotationParams, the non-owning view every kernel and host function takes,
// and LayerParams, the owned form that caches and calibration artifacts hold.
#pragma once

#include <vector>

#include "kvq/core/policy.hpp"
#include "kvq/core/status.hpp"

namespace kvq {

// Run-time parameters of one layer (non-owning). Heads are indexed locally: a
// tensor-parallel rank passes pointers offset to its first KV head.
struct RotationParams {
  const float* key_mean = nullptr;        // [Hkv, D]     required iff P.key.centered
  const float* key_rotation = nullptr;    // [Hkv, D, D]  required iff P.key.rotation == dense
  const float* value_mean = nullptr;      // [Hkv, D]     required iff P.value.centered
  const float* value_rotation = nullptr;  // [Hkv, D, D]  required iff P.value.rotation == dense
};

template <Policy P>
inline Status validate_rotation_params(const RotationParams& r) {
  using enum StatusCode;
  KVQ_CHECK_ARG(!P.key.centered || r.key_mean, invalid_argument,
                "policy centers keys but RotationParams::key_mean is null");
  KVQ_CHECK_ARG(P.key.rotation != Rotation::dense || r.key_rotation, invalid_argument,
                "policy uses a dense key rotation but RotationParams::key_rotation is null");
  KVQ_CHECK_ARG(!P.value.centered || r.value_mean, invalid_argument,
                "policy centers values but RotationParams::value_mean is null");
  KVQ_CHECK_ARG(P.value.rotation != Rotation::dense || r.value_rotation, invalid_argument,
                "policy uses a dense value rotation but RotationParams::value_rotation is null");
  return {};
}

// Owned run-time rotation/centering parameters of one layer. Empty vectors where the
// policy needs nothing. Shapes: means [Hkv·D], rotations [Hkv·D·D] (row-major, x ↦ x·R).
struct LayerParams {
  std::vector<float> key_mean, key_rotation, value_mean, value_rotation;
  RotationParams view() const {
    auto ptr = [](const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
    return {ptr(key_mean), ptr(key_rotation), ptr(value_mean), ptr(value_rotation)};
  }
};

}  // namespace kvq
