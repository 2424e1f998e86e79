// kvq/calib/artifact.hpp — the OptR artifact (DESIGN §6.3) and its loader.
//
// One safetensors file. Per calibrated layer l (Hkv heads, head_dim d):
//   layers.<l>.mu_k    F32 [Hkv, d]      key mean (zeros unless the policy centers keys)
//   layers.<l>.nu_v    F32 [Hkv, d]      value mean (zeros unless the policy centers values)
//   layers.<l>.r_k     F32 [Hkv, d, d]   row-major, x ↦ x·R (Rotation::dense)
//   layers.<l>.r_v     F32 [Hkv, d, d]
//   layers.<l>.kept_k  U8  [Hkv]         1 = learned rotation kept, 0 = base R0
//   layers.<l>.kept_v  U8  [Hkv]
//   layers.<l>.loss_k  F64 [Hkv, 2]      held-out (base, best) K-phase loss
//   layers.<l>.loss_v  F64 [Hkv, 2]
// Metadata: format, the policy field by field, windows, optimizer settings, base,
// parameterization, source, and the list of layers. The loader checks that the
// calibration policy equals the policy an engine instantiated (bits, group, clip,
// centering, metadata dtype, rotation and head_dim); a mismatch is an error.
#pragma once

#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "kvq/calib/bit_allocation.hpp"
#include "kvq/calib/optr.hpp"
#include "kvq/core/policy.hpp"
#include "kvq/core/status.hpp"
#include "kvq/io/safetensors.hpp"
#include "kvq/rotation/params.hpp"

namespace kvq::calib {

inline constexpr const char* kArtifactFormat = "kvq.optr.v1";

struct ArtifactLayer {
  int layer = 0;
  int hkv = 0, head_dim = 0;
  std::vector<float> mu_k, nu_v;          // [Hkv·d]
  std::vector<float> r_k, r_v;            // [Hkv·d·d]
  std::vector<std::uint8_t> kept_k, kept_v;  // [Hkv]
  std::vector<double> loss_k, loss_v;     // [Hkv·2] (base, best)
  bool operator==(const ArtifactLayer&) const = default;
};

struct Artifact {
  Policy policy{};
  std::map<std::string, std::string> info;  // windows, optimizer, base, source ...
  std::vector<ArtifactLayer> layers;
};

// ---- policy <-> metadata --------------------------------------------------------------
// Field by field with the names of kvq::to_string(Rotation / MetaType); "policy" holds
// kvq::to_string(Policy) for people reading the header.

namespace detail {

inline void put_spec(io::SafetensorsWriter& w, const std::string& pre, const QuantSpec& s) {
  w.set_metadata(pre + "bits", std::to_string(s.bits));
  w.set_metadata(pre + "group", std::to_string(s.group));
  w.set_metadata(pre + "rotation", to_string(s.rotation));
  w.set_metadata(pre + "centered", s.centered ? "1" : "0");
  w.set_metadata(pre + "clip_permille", std::to_string(s.clip_permille));
  w.set_metadata(pre + "meta", to_string(s.meta));
  w.set_metadata(pre + "sign_seed", std::to_string(s.sign_seed));
}

[[noreturn]] inline void bad_artifact(const std::string& m) {
  throw Error(StatusCode::corrupt_data, "OptR artifact: " + m);
}

inline const std::string& need(const std::map<std::string, std::string>& md, const std::string& k) {
  auto it = md.find(k);
  if (it == md.end()) bad_artifact("metadata key '" + k + "' is missing");
  return it->second;
}

inline long long parse_int(const std::map<std::string, std::string>& md, const std::string& k) {
  const std::string& v = need(md, k);
  try {
    std::size_t pos = 0;
    const long long x = std::stoll(v, &pos);
    if (pos != v.size()) throw std::invalid_argument(v);
    return x;
  } catch (const std::exception&) {
    bad_artifact("metadata '" + k + "' is not an integer: '" + v + "'");
  }
}

// The enumerator among `all` whose kvq::to_string is `name` (the inverse of put_spec).
template <class E>
bool parse_name(const std::string& name, std::initializer_list<E> all, E& out) {
  for (E e : all)
    if (name == to_string(e)) {
      out = e;
      return true;
    }
  return false;
}

inline QuantSpec get_spec(const std::map<std::string, std::string>& md, const std::string& pre) {
  QuantSpec s;
  s.bits = static_cast<int>(parse_int(md, pre + "bits"));
  s.group = static_cast<int>(parse_int(md, pre + "group"));
  const std::string& r = need(md, pre + "rotation");
  if (!parse_name(r, {Rotation::none, Rotation::hadamard, Rotation::dense}, s.rotation))
    bad_artifact("unknown rotation '" + r + "'");
  s.centered = parse_int(md, pre + "centered") != 0;
  s.clip_permille = static_cast<int>(parse_int(md, pre + "clip_permille"));
  const std::string& m = need(md, pre + "meta");
  if (!parse_name(m, {MetaType::fp16, MetaType::bf16, MetaType::fp32}, s.meta))
    bad_artifact("unknown metadata dtype '" + m + "'");
  s.sign_seed = static_cast<std::uint32_t>(parse_int(md, pre + "sign_seed"));
  return s;
}

template <class T>
std::vector<T> read_exact(const io::SafetensorsFile& f, const std::string& name, io::DType dt,
                          const std::vector<std::int64_t>& shape) {
  if (!f.contains(name)) bad_artifact("tensor '" + name + "' is missing");
  const io::TensorView& t = f.tensor(name);
  if (t.dtype != dt) bad_artifact("tensor '" + name + "' has dtype " + io::dtype_name(t.dtype) +
                                  ", expected " + io::dtype_name(dt));
  if (t.shape != shape) bad_artifact("tensor '" + name + "' has the wrong shape");
  std::vector<T> out(static_cast<std::size_t>(t.numel()));
  if (t.data.size() != out.size() * sizeof(T)) bad_artifact("tensor '" + name + "' has the wrong size");
  if (!out.empty()) std::memcpy(out.data(), t.data.data(), t.data.size());
  return out;
}

}  // namespace detail

// ---- building ---------------------------------------------------------------------------

// Converts calibration results into an artifact (rotations rounded to fp32).
inline Artifact make_artifact(const std::vector<LayerResult>& results, const Policy& policy,
                              const OptRConfig& cfg, const std::string& source) {
  Artifact a;
  a.policy = policy;
  a.info = {{"prefix", std::to_string(cfg.prefix)}, {"recent", std::to_string(cfg.recent)},
            {"qwin", std::to_string(cfg.qwin)},     {"qstride", std::to_string(cfg.qstride)},
            {"qblock", std::to_string(cfg.qblock)},
            {"steps", std::to_string(cfg.steps)},
            {"v_steps", std::to_string(cfg.v_steps >= 0 ? cfg.v_steps : cfg.steps)},
            {"lr", std::to_string(cfg.lr)},         {"lambda", std::to_string(cfg.lambda)},
            {"margin", std::to_string(cfg.margin)}, {"base", to_string(cfg.base)},
            {"param", to_string(cfg.param)},        {"source", source},
            {"lr_schedule", cfg.cosine_lr ? "cosine" : "constant"},
            {"k_token", std::to_string(cfg.k_token)}, {"v_token", std::to_string(cfg.v_token)},
            {"v_uniform", std::to_string(cfg.v_uniform)},
            {"rope_shift", std::to_string(cfg.rope_shift)}};
  const int d = policy.head_dim;
  for (const LayerResult& lr : results) {
    ArtifactLayer L;
    L.layer = lr.layer;
    L.hkv = static_cast<int>(lr.heads.size());
    L.head_dim = d;
    for (const HeadResult& h : lr.heads) {
      if (h.RK.rows() != d || h.RV.rows() != d)
        throw Error(StatusCode::invalid_argument, "calib: result head_dim does not match the policy");
      for (int i = 0; i < d; ++i) {
        L.mu_k.push_back(static_cast<float>(h.mu_k[i]));
        L.nu_v.push_back(static_cast<float>(h.nu_v[i]));
      }
      for (int i = 0; i < d; ++i)
        for (int j = 0; j < d; ++j) {
          L.r_k.push_back(static_cast<float>(h.RK(i, j)));
          L.r_v.push_back(static_cast<float>(h.RV(i, j)));
        }
      L.kept_k.push_back(h.k.kept);
      L.kept_v.push_back(h.v.kept);
      L.loss_k.insert(L.loss_k.end(), {h.k.base_loss, h.k.best_loss});
      L.loss_v.insert(L.loss_v.end(), {h.v.base_loss, h.v.best_loss});
    }
    a.layers.push_back(std::move(L));
  }
  return a;
}

// ---- writing / reading --------------------------------------------------------------------

inline io::SafetensorsWriter artifact_writer(const Artifact& a) {
  io::SafetensorsWriter w;
  w.set_metadata("format", kArtifactFormat);
  w.set_metadata("head_dim", std::to_string(a.policy.head_dim));
  detail::put_spec(w, "key_", a.policy.key);
  detail::put_spec(w, "value_", a.policy.value);
  w.set_metadata("policy", to_string(a.policy));
  for (const auto& [k, v] : a.info) w.set_metadata("info." + k, v);
  std::string ids;
  for (const ArtifactLayer& L : a.layers) {
    const std::int64_t H = L.hkv, d = L.head_dim;
    if (d != a.policy.head_dim || L.mu_k.size() != static_cast<std::size_t>(H * d) ||
        L.nu_v.size() != L.mu_k.size() || L.r_k.size() != static_cast<std::size_t>(H * d * d) ||
        L.r_v.size() != L.r_k.size() || L.kept_k.size() != static_cast<std::size_t>(H) ||
        L.kept_v.size() != L.kept_k.size() || L.loss_k.size() != static_cast<std::size_t>(2 * H) ||
        L.loss_v.size() != L.loss_k.size())
      throw Error(StatusCode::invalid_argument, "OptR artifact: layer " + std::to_string(L.layer) +
                                                    " has inconsistent sizes");
    const std::string p = "layers." + std::to_string(L.layer) + ".";
    w.add_f32(p + "mu_k", {H, d}, L.mu_k);
    w.add_f32(p + "nu_v", {H, d}, L.nu_v);
    w.add_f32(p + "r_k", {H, d, d}, L.r_k);
    w.add_f32(p + "r_v", {H, d, d}, L.r_v);
    w.add(p + "kept_k", io::DType::U8, {H}, L.kept_k.data());
    w.add(p + "kept_v", io::DType::U8, {H}, L.kept_v.data());
    w.add(p + "loss_k", io::DType::F64, {H, 2}, L.loss_k.data());
    w.add(p + "loss_v", io::DType::F64, {H, 2}, L.loss_v.data());
    if (!ids.empty()) ids += ',';
    ids += std::to_string(L.layer);
  }
  w.set_metadata("layers", ids);
  return w;
}

inline void write_artifact(const Artifact& a, const std::filesystem::path& path) {
  artifact_writer(a).write(path);
}

// Parses and validates an artifact (any policy). Throws kvq::Error(corrupt_data) with
// the offending tensor or key named.
inline Artifact read_artifact(const io::SafetensorsFile& f) {
  const auto& md = f.metadata();
  if (detail::need(md, "format") != kArtifactFormat)
    detail::bad_artifact("format is '" + md.at("format") + "', expected '" + kArtifactFormat + "'");
  Artifact a;
  a.policy.head_dim = static_cast<int>(detail::parse_int(md, "head_dim"));
  a.policy.key = detail::get_spec(md, "key_");
  a.policy.value = detail::get_spec(md, "value_");
  if (!is_valid_policy(a.policy)) detail::bad_artifact("stored policy is invalid: " + to_string(a.policy));
  for (const auto& [k, v] : md)
    if (k.rfind("info.", 0) == 0) a.info[k.substr(5)] = v;
  const std::string& ids = detail::need(md, "layers");
  std::vector<int> layers;
  std::stringstream ss(ids);
  for (std::string tok; std::getline(ss, tok, ',');) {
    std::map<std::string, std::string> one{{"l", tok}};
    const long long id = detail::parse_int(one, "l");
    if (id < 0 || id > 1'000'000) detail::bad_artifact("layer id out of range");
    layers.push_back(static_cast<int>(id));
  }
  const std::int64_t d = a.policy.head_dim;
  for (int id : layers) {
    const std::string p = "layers." + std::to_string(id) + ".";
    if (!f.contains(p + "mu_k")) detail::bad_artifact("tensor '" + p + "mu_k' is missing");
    const auto& shape = f.tensor(p + "mu_k").shape;
    if (shape.size() != 2 || shape[1] != d || shape[0] < 1 || shape[0] > 4096)
      detail::bad_artifact("'" + p + "mu_k' must be [Hkv, " + std::to_string(d) + "]");
    const std::int64_t H = shape[0];
    ArtifactLayer L;
    L.layer = id;
    L.hkv = static_cast<int>(H);
    L.head_dim = static_cast<int>(d);
    L.mu_k = detail::read_exact<float>(f, p + "mu_k", io::DType::F32, {H, d});
    L.nu_v = detail::read_exact<float>(f, p + "nu_v", io::DType::F32, {H, d});
    L.r_k = detail::read_exact<float>(f, p + "r_k", io::DType::F32, {H, d, d});
    L.r_v = detail::read_exact<float>(f, p + "r_v", io::DType::F32, {H, d, d});
    L.kept_k = detail::read_exact<std::uint8_t>(f, p + "kept_k", io::DType::U8, {H});
    L.kept_v = detail::read_exact<std::uint8_t>(f, p + "kept_v", io::DType::U8, {H});
    L.loss_k = detail::read_exact<double>(f, p + "loss_k", io::DType::F64, {H, 2});
    L.loss_v = detail::read_exact<double>(f, p + "loss_v", io::DType::F64, {H, 2});
    // Non-finite or non-orthogonal rotations would silently corrupt every cached token.
    for (const auto* R : {&L.r_k, &L.r_v})
      for (std::int64_t h = 0; h < H; ++h) {
        Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>> M(
            R->data() + h * d * d, d, d);
        if (!M.allFinite()) detail::bad_artifact("'" + p + "' rotation has non-finite entries");
        const double err = (M.cast<double>().transpose() * M.cast<double>() - MatD::Identity(d, d))
                               .cwiseAbs()
                               .maxCoeff();
        if (err > 1e-4) detail::bad_artifact("'" + p + "' rotation of head " + std::to_string(h) +
                                             " is not orthogonal (max |RᵀR − I| = " + std::to_string(err) + ")");
      }
    for (const auto* m : {&L.mu_k, &L.nu_v})
      for (float x : *m)
        if (!std::isfinite(x)) detail::bad_artifact("'" + p + "' mean has non-finite entries");
    a.layers.push_back(std::move(L));
  }
  return a;
}

inline Artifact read_artifact(const std::filesystem::path& path) {
  return read_artifact(io::SafetensorsFile::open(path));
}

// Throws kvq::Error(invalid_argument) unless the artifact was calibrated for exactly
// `policy` (the one an engine instantiated).
inline void require_policy(const Artifact& a, const Policy& policy) {
  if (!(a.policy == policy))
    throw Error(StatusCode::invalid_argument,
                "OptR artifact was calibrated for policy " + to_string(a.policy) +
                    " but the instantiated policy is " + to_string(policy) +
                    "; recalibrate with the instantiated policy (or instantiate the artifact's)");
}
template <Policy P>
void require_policy(const Artifact& a) {
  require_policy(a, P);
}

// Run-time parameters (DESIGN §3) for layer `layer` under `policy`, ready for
// kvq::RotationParams via LayerParams::view(). Fields the policy does not use stay empty.
inline LayerParams layer_params(const Artifact& a, const Policy& policy, int layer) {
  require_policy(a, policy);
  for (const ArtifactLayer& L : a.layers) {
    if (L.layer != layer) continue;
    LayerParams p;
    if (policy.key.centered) p.key_mean = L.mu_k;
    if (policy.key.rotation == Rotation::dense) p.key_rotation = L.r_k;
    if (policy.value.centered) p.value_mean = L.nu_v;
    if (policy.value.rotation == Rotation::dense) p.value_rotation = L.r_v;
    return p;
  }
  throw Error(StatusCode::out_of_range, "OptR artifact has no layer " + std::to_string(layer));
}
template <Policy P>
LayerParams layer_params(const Artifact& a, int layer) {
  return layer_params(a, P, layer);
}

// Per-head transforms of one stored layer, for measuring errors with calibrated
// rotations (bit_allocation.hpp). Means are zero where the policy does not center.
inline std::vector<HeadTransform> head_transforms(const Artifact& a, int layer) {
  for (const ArtifactLayer& L : a.layers) {
    if (L.layer != layer) continue;
    const int d = L.head_dim;
    std::vector<HeadTransform> out;
    for (int h = 0; h < L.hkv; ++h) {
      HeadTransform t{MatD(d, d), MatD(d, d), VecD(d), VecD(d)};
      for (int i = 0; i < d; ++i) {
        t.mu_k[i] = a.policy.key.centered ? L.mu_k[h * d + i] : 0.0;
        t.nu_v[i] = a.policy.value.centered ? L.nu_v[h * d + i] : 0.0;
        for (int j = 0; j < d; ++j) {
          t.RK(i, j) = L.r_k[(static_cast<std::size_t>(h) * d + i) * d + j];
          t.RV(i, j) = L.r_v[(static_cast<std::size_t>(h) * d + i) * d + j];
        }
      }
      out.push_back(std::move(t));
    }
    return out;
  }
  throw Error(StatusCode::out_of_range, "OptR artifact has no layer " + std::to_string(layer));
}

// Reads the file, checks the policy and returns the parameters of every stored layer
// in file order.
template <Policy P>
std::vector<LayerParams> load_artifact(const std::filesystem::path& path) {
  const Artifact a = read_artifact(path);
  require_policy<P>(a);
  std::vector<LayerParams> out;
  for (const ArtifactLayer& L : a.layers) out.push_back(layer_params<P>(a, L.layer));
  return out;
}

}  // namespace kvq::calib
