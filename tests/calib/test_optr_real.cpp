// OptR on real SmolLM2-135M activations (tests/data/smollm2, layers 2, 15, 28; two
// sequences of 448 tokens: one trains, one is held out). Skipped when the fixture is
// absent.
#include <gtest/gtest.h>

#include <filesystem>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kvq/cache/host_cache.hpp"
#include "kvq/calib/activation_file.hpp"
#include "kvq/calib/artifact.hpp"
#include "kvq/calib/bit_allocation.hpp"
#include "kvq/calib/optr.hpp"

using namespace kvq::calib;

namespace {

const char* kFixture = KVQ_TEST_DATA_DIR "/smollm2/activations_l2_15_28.safetensors";
constexpr kvq::Policy kP = kvq::presets::K2V2_R.with_head_dim(64);

// Per-head held-out ratios best/base (K phase, V phase) and deployed/base (end to end),
// averaged over heads: quantities with room to spare, unlike counts of heads that
// improved, which flip with the last bit of a loss when a head barely moves.
struct Outcome {
  int heads = 0, k_lower = 0, v_lower = 0, e2e_lower = 0;
  double k_ratio = 0, v_ratio = 0, e2e_ratio = 0;
};

Outcome run(const OptRConfig& cfg) {
  const auto layers = read_activations(kFixture);
  const auto res = calibrate(layers, kP, cfg);
  Outcome o;
  for (std::size_t l = 0; l < res.size(); ++l) {
    const auto& a = layers[l];
    for (int h = 0; h < a.hkv; ++h) {
      const HeadResult& r = res[l].heads[h];
      ++o.heads;
      o.k_lower += r.k.best_loss < r.k.base_loss;
      o.v_lower += r.v.best_loss < r.v.base_loss;
      // Never worse: what is deployed is at least as good as the base on held-out data.
      EXPECT_LE(r.k.best_loss, r.k.base_loss);
      EXPECT_LE(r.v.best_loss, r.v.base_loss);
      if (r.k.kept) {
        EXPECT_LT(r.k.best_loss, r.k.base_loss * (1 - cfg.margin));
      }
      if (r.v.kept) {
        EXPECT_LT(r.v.best_loss, r.v.base_loss * (1 - cfg.margin));
      }
      EXPECT_LT(orthogonality_error(r.RK), 1e-5);
      EXPECT_LT(orthogonality_error(r.RV), 1e-5);
      // Independent end-to-end check on the held-out sequence: post-W_O attention error
      // with both K and V quantized, deployed rotations vs base rotations.
      const int n = a.n_seq(), nh = heldout_count(n, cfg);
      const HeadData held = extract_head(a, h, n - nh, n);
      const double e_opt = head_output_error(held, kP, {r.RK, r.RV, r.mu_k, r.nu_v}, cfg);
      const double e_base = head_output_error(held, kP, {r.RK0, r.RV0, r.mu_k, r.nu_v}, cfg);
      std::printf("layer %2d head %d: K %.4e -> %.4e%s  V %.4e -> %.4e%s  e2e %.4e -> %.4e (%+.1f%%)\n", a.layer,
                  h, r.k.base_loss, r.k.best_loss, r.k.kept ? "*" : " ", r.v.base_loss, r.v.best_loss,
                  r.v.kept ? "*" : " ", e_base, e_opt, 100.0 * (e_opt / e_base - 1));
      o.e2e_lower += e_opt < e_base;
      o.k_ratio += r.k.best_loss / r.k.base_loss;
      o.v_ratio += r.v.best_loss / r.v.base_loss;
      o.e2e_ratio += e_opt / e_base;
    }
  }
  o.k_ratio /= o.heads;
  o.v_ratio /= o.heads;
  o.e2e_ratio /= o.heads;
  std::printf("lowered: K %d/%d  V %d/%d  end-to-end %d/%d; mean ratio to base: K %.3f  V %.3f  end-to-end %.3f\n",
              o.k_lower, o.heads, o.v_lower, o.heads, o.e2e_lower, o.heads, o.k_ratio, o.v_ratio, o.e2e_ratio);
  return o;
}

TEST(OptRReal, LowersHeldOutLossesOnSmolLM2) {
  if (!std::filesystem::exists(kFixture)) GTEST_SKIP() << "fixture missing: " << kFixture;
  const OptRConfig cfg;  // DESIGN §6.3 defaults
  const Outcome o = run(cfg);
  // Measured (2026-12-01), default lr 0.005, fixed-order arithmetic (the same bits in
  // every build, OptRIsa.*): K 0.663, V 0.636, end to end 0.493 (K 9/9, V 7/9 heads
  // lowered). With Eigen's products the numbers moved with the ISA flags (identity
  // estimator: K 0.775 / V 0.810 plain, 0.764 / 0.833 with -march=native). The head counts are
  // diagnostics (DESIGN §6.3): two V heads of nine find no rotation better than the base
  // on the one held-out sequence and keep it, and whether a third does depends on the
  // last bits of its loss, i.e. on compiler flags.
  EXPECT_LT(o.k_ratio, 0.80);
  EXPECT_LT(o.v_ratio, 0.80);
  EXPECT_LT(o.e2e_ratio, 0.65);
}

// DESIGN §6.3: the artifact is a function of the inputs and options alone, whatever the
// number of threads the heads are spread over.
TEST(OptRReal, ArtifactDoesNotDependOnTheThreadCount) {
  if (!std::filesystem::exists(kFixture)) GTEST_SKIP() << "fixture missing: " << kFixture;
#ifndef _OPENMP
  GTEST_SKIP() << "built without OpenMP: calibration runs on one thread";
#else
  const auto layers = read_activations(kFixture, {2, 28});
  OptRConfig cfg;
  cfg.steps = 20;
  auto artifact = [&](int threads) {
    const int before = omp_get_max_threads();
    omp_set_num_threads(threads);
    const Artifact a = make_artifact(calibrate(layers, kP, cfg), kP, cfg, "test");
    omp_set_num_threads(before);
    return a;
  };
  const Artifact one = artifact(1), two = artifact(2), three = artifact(3);
  ASSERT_EQ(one.layers.size(), 2u);
  EXPECT_TRUE(one.layers == two.layers) << "1 vs 2 threads";
  EXPECT_TRUE(one.layers == three.layers) << "1 vs 3 threads";
  // Bit-identical files, not only equal parsed values.
  EXPECT_EQ(artifact_writer(one).to_bytes(), artifact_writer(two).to_bytes());
#endif
}

}  // namespace

// The artifact drives the deployed host cache: the same held-out sequence, decoded token
// by token through a kvq::HostKVCache<K2V2_R> with the artifact's μ_K, R_K, R_V (sink 64,
// recent 256, flush 1, so each query sees exactly the tokens the calibration's windows
// quantize for it), gives a lower post-W_O error at the calibration's query positions with
// the OptR rotations than with the base rotations, and the calibration's fp64 error model
// predicts the deployed error.
TEST(OptRReal, ArtifactDrivesTheHostCache) {
  if (!std::filesystem::exists(kFixture)) GTEST_SKIP() << "fixture missing: " << kFixture;
  auto layers = read_activations(kFixture, {15});
  const LayerActivations& a = layers[0];
  OptRConfig cfg;
  const Artifact learned = make_artifact(calibrate(layers, kP, cfg), kP, cfg, "test");
  cfg.steps = 0;
  const Artifact base = make_artifact(calibrate(layers, kP, cfg), kP, cfg, "test");
  const int d = a.head_dim, hq = a.hq, hkv = a.hkv, g = a.group_size();
  const int ns = a.n_seq(), t0 = static_cast<int>(a.seq_offsets[ns - 1]);
  ASSERT_EQ(cfg.qblock, 1) << "the default windows model token-by-token decode";
  int nq = 0, m = 0;
  const detail::SeqWin w = detail::make_windows(extract_head(a, 0, ns - 1, ns), cfg, &nq, &m).at(0);
  auto deployed_error = [&](const Artifact& art) {
    kvq::HostCacheOptions o;
    o.num_kv_heads = hkv;
    o.num_qo_heads = hq;
    o.sink_tokens = cfg.prefix;
    o.recent_tokens = cfg.recent;
    o.flush_block = 1;
    o.max_query_tokens = 1;
    kvq::HostKVCache<kP> cache(o, layer_params<kP>(art, a.layer));
    std::vector<float> out(static_cast<std::size_t>(nq) * hq * d);
    const std::size_t row = static_cast<std::size_t>(hkv) * d;
    for (int i = 0; i < nq; ++i) {  // decode up to query position i, then attend it
      const int p = w.query_pos(i), n = p + 1 - cache.size();
      cache.append(a.k.data() + (t0 + cache.size()) * row, a.v.data() + (t0 + cache.size()) * row, n);
      cache.attend(a.q.data() + static_cast<std::size_t>(t0 + p) * hq * d, 1, out.data() + std::size_t(i) * hq * d);
    }
    // Exact reference in fp64 and the post-W_O error, averaged like the calibration's.
    double err = 0;
    for (int h = 0; h < hkv; ++h) {
      const HeadData hd = extract_head(a, h, ns - 1, ns);
      for (int j = 0; j < g; ++j)
        for (int i = 0; i < nq; ++i) {
          const int n = w.visible(i);
          Eigen::RowVectorXd z = (1.0 / std::sqrt(double(d))) * hd.Q[j].row(n - 1) * hd.K.topRows(n).transpose();
          z.array() -= z.maxCoeff();
          z = z.array().exp().matrix();
          const Eigen::RowVectorXd ref = (z / z.sum()) * hd.V.topRows(n);
          Eigen::RowVectorXd got(d);
          for (int c = 0; c < d; ++c) got[c] = out[(static_cast<std::size_t>(i) * hq + h * g + j) * d + c];
          err += ((got - ref) * hd.W[j].transpose()).squaredNorm() / a.hidden;
        }
    }
    return err / (double(nq) * hq);
  };
  auto predicted_error = [&](const Artifact& art) {
    const auto t = head_transforms(art, a.layer);
    return layer_output_error(a, kP, cfg, &t, ns - 1, ns);
  };
  const double dep_learned = deployed_error(learned), dep_base = deployed_error(base);
  const double pred_learned = predicted_error(learned), pred_base = predicted_error(base);
  std::printf("layer 15 held-out post-W_O error through HostKVCache: base %.4e, OptR %.4e (model: %.4e, %.4e)\n",
              dep_base, dep_learned, pred_base, pred_learned);
  EXPECT_LT(dep_learned, dep_base);
  // Measured agreement is ~1e-5 relative (fp32 attention vs fp64 model).
  EXPECT_NEAR(dep_learned, pred_learned, 0.01 * pred_learned);
  EXPECT_NEAR(dep_base, pred_base, 0.01 * pred_base);
}
