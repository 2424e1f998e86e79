// kvq/calib/optr/driver.hpp — calibration of one KV head (base rotation, K phase, then V
// phase) and of all layers, OpenMP over every (layer, head) pair.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvq/calib/activations.hpp"
#include "kvq/calib/base_rotation.hpp"
#include "kvq/calib/omp.hpp"
#include "kvq/calib/optr/adam.hpp"
#include "kvq/calib/optr/config.hpp"
#include "kvq/calib/optr/k_phase.hpp"
#include "kvq/calib/optr/v_phase.hpp"
#include "kvq/calib/rope_shift.hpp"
#include "kvq/calib/skew_exp.hpp"
#include "kvq/core/policy.hpp"
#include "kvq/core/status.hpp"

namespace kvq::calib {

// Calibration result of one KV head.
struct HeadResult {
  MatD RK, RV;          // [d, d] deployed rotations (x ↦ x·R)
  MatD RK0, RV0;        // [d, d] base rotations
  VecD mu_k, nu_v;      // [d] key mean (zeros unless centered), value mean (zeros unless centered)
  RotationFit k, v;     // losses, kept flags, traces (R fields duplicate RK/RV)
};

// Base rotation of one head for keys or values.
inline MatD base_rotation(BaseKind kind, int d, const MatD& C) {
  switch (kind) {
    case BaseKind::identity: return MatD::Identity(d, d);
    case BaseKind::hadamard: return hadamard_rotation(d);
    case BaseKind::covariance: return covariance_base(C);
  }
  return MatD::Identity(d, d);
}

// Calibrates one KV head: train on `train`, select on `held`.
inline HeadResult calibrate_head(const HeadData& train, const HeadData& held, const Policy& policy,
                                 const OptRConfig& cfg) {
  const int d = train.head_dim();
  if (d != policy.head_dim)
    throw Error(StatusCode::invalid_argument, "calib: activations have head_dim " + std::to_string(d) +
                                                  " but the policy has " + std::to_string(policy.head_dim));
  HeadResult r;
  // μ_K: the capture's mean over extra tokens when it has one, else the training tokens'.
  r.mu_k = !policy.key.centered        ? VecD(VecD::Zero(d))
           : train.key_mean.size() > 0 ? train.key_mean
                                       : column_means(train.K);
  r.nu_v = policy.value.centered ? column_means(train.V) : VecD(VecD::Zero(d));
  MatD CQ, CV;
  if (cfg.base == BaseKind::covariance) {
    CQ = query_covariance(train.Q);
    CV = value_covariance(train.K, train.V, CQ);
  }
  r.RK0 = base_rotation(cfg.base, d, CQ);
  r.RV0 = base_rotation(cfg.base, d, CV);

  const KPhase ktrain(train, r.mu_k, policy.key, cfg), kheld(held, r.mu_k, policy.key, cfg);
  r.k = optimize_rotation(
      r.RK0, [&](const MatD& R, MatD* g) { return ktrain.loss(R, g); },
      [&](const MatD& R) { return kheld.loss(R); }, cfg);
  r.RK = r.k.R;

  OptRConfig vcfg = cfg;
  if (cfg.v_steps >= 0) vcfg.steps = cfg.v_steps;
  // The training loss only when the V phase takes steps (v_steps 0 needs the held-out
  // base loss alone).
  std::optional<VPhase> vtrain;
  if (vcfg.steps > 0) vtrain.emplace(train, r.nu_v, policy.value, cfg, ktrain, r.RK);
  const VPhase vheld(held, r.nu_v, policy.value, cfg, kheld, r.RK);
  r.v = optimize_rotation(
      r.RV0, [&](const MatD& R, MatD* g) { return vtrain->loss(R, g); },
      [&](const MatD& R) { return vheld.loss(R); }, vcfg);
  r.RV = r.v.R;
  return r;
}

struct LayerResult {
  int layer = 0;
  std::vector<HeadResult> heads;  // [Hkv]
  double seconds = 0;             // wall time of this layer's heads
};

// Number of held-out sequences for n_seq sequences.
inline int heldout_count(int n_seq, const OptRConfig& cfg) {
  if (n_seq < 2)
    throw Error(StatusCode::invalid_argument,
                "calib: at least two sequences are needed (one is held out); split long sequences "
                "with split_sequences()");
  const int h = static_cast<int>(std::lround(n_seq * cfg.heldout_fraction));
  return std::clamp(h, 1, n_seq - 1);
}

// Cuts every sequence into chunks of at most max_len tokens (the last chunk of a
// sequence may be shorter). Keys stay post-RoPE, so a chunk is a valid attention
// problem with relative positions preserved.
inline void split_sequences(LayerActivations& a, int max_len) {
  if (max_len <= 0) throw Error(StatusCode::invalid_argument, "calib: chunk length must be > 0");
  std::vector<std::int64_t> out{0};
  for (int s = 0; s < a.n_seq(); ++s)
    for (std::int64_t t = a.seq_offsets[s]; t < a.seq_offsets[s + 1]; t += max_len)
      out.push_back(std::min<std::int64_t>(t + max_len, a.seq_offsets[s + 1]));
  a.seq_offsets = std::move(out);
}

// Calibrates all layers; OpenMP over every (layer, head) pair. `progress` (may be
// empty) is called once per finished layer, serialized. The first failure of any head
// is rethrown unchanged once all heads have finished (a kvq::Error keeps its code).
inline std::vector<LayerResult> calibrate(const std::vector<LayerActivations>& layers, const Policy& policy,
                                          const OptRConfig& cfg,
                                          const std::function<void(const LayerResult&)>& progress = {}) {
  cfg.validate();
  if (!is_valid_policy(policy)) throw Error(StatusCode::invalid_argument, "calib: invalid policy");
  std::vector<LayerResult> out(layers.size());
  std::vector<std::pair<int, int>> jobs;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    layers[l].validate();
    if (layers[l].head_dim != policy.head_dim)
      throw Error(StatusCode::invalid_argument,
                  "calib: layer " + std::to_string(layers[l].layer) + " has head_dim " +
                      std::to_string(layers[l].head_dim) + " but the policy has " +
                      std::to_string(policy.head_dim));
    (void)heldout_count(layers[l].n_seq(), cfg);  // fail before any work starts
    if (cfg.rope_shift > 0 && !(layers[l].rope.theta > 0))
      throw Error(StatusCode::invalid_argument, "calib: rope_shift needs the capture's RoPE (metadata rope_theta, rope)");
    if (cfg.rope_shift > 0 && layers[l].seq_offsets != layers.front().seq_offsets)
      throw Error(StatusCode::invalid_argument, "calib: rope_shift needs layers that share sequence offsets");
    out[l].layer = layers[l].layer;
    out[l].heads.resize(layers[l].hkv);
    for (int h = 0; h < layers[l].hkv; ++h) jobs.emplace_back(static_cast<int>(l), h);
  }
  // Sequence boundaries are shared by all layers, so one set of offsets moves them alike.
  const std::vector<std::int64_t> shift =
      cfg.rope_shift > 0 ? rope_shift_offsets(layers.front().seq_offsets, cfg.rope_shift) : std::vector<std::int64_t>{};
  std::vector<int> remaining(layers.size());
  std::vector<std::chrono::steady_clock::time_point> started(layers.size(), std::chrono::steady_clock::now());
  for (std::size_t l = 0; l < layers.size(); ++l) remaining[l] = layers[l].hkv;
  std::exception_ptr first_error;  // rethrown as is: its type, StatusCode and message
KVQ_CALIB_OMP(parallel for schedule(dynamic, 1))
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    const auto [l, h] = jobs[i];
    try {
      const LayerActivations& a = layers[l];
      const int nh = heldout_count(a.n_seq(), cfg);
      HeadData train = extract_head(a, h, 0, a.n_seq() - nh);
      HeadData held = extract_head(a, h, a.n_seq() - nh, a.n_seq());
      if (!shift.empty()) {
        // μ_K stays the captured positions' mean (the key mean of the capture, else of the
        // training tokens before the shift): deployment subtracts that one at every position.
        if (train.key_mean.size() == 0) train.key_mean = column_means(train.K);
        const auto n_train = static_cast<std::size_t>(a.n_seq() - nh);
        apply_rope_shift(train, a.rope, std::span(shift).first(n_train));
        apply_rope_shift(held, a.rope, std::span(shift).subspan(n_train));
      }
      HeadResult r = calibrate_head(train, held, policy, cfg);
KVQ_CALIB_OMP(critical(kvq_calib_progress))
      {
        out[l].heads[h] = std::move(r);
        if (--remaining[l] == 0) {
          out[l].seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started[l]).count();
          // No exception may leave an OpenMP critical region: keep the callback's.
          try {
            if (progress) progress(out[l]);
          } catch (...) {
            if (!first_error) first_error = std::current_exception();
          }
        }
      }
    } catch (...) {
KVQ_CALIB_OMP(critical(kvq_calib_progress))
      {
        if (!first_error) first_error = std::current_exception();
      }
    }
  }
  if (first_error) std::rethrow_exception(first_error);
  return out;
}

}  // namespace kvq::calib
