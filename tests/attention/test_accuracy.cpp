// Accuracy against full precision (not against the dequantized cache): what each
// policy costs on a fixed synthetic layer whose keys have outlier channels.
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "common/paged_case.hpp"
#include "kvq/attention/decode.hpp"

namespace {

// max-row relative error of quantized attention versus exact fp64 attention over the
// original K, V (one sequence of 512 tokens, GQA 4, 2 query tokens).
template <kvq::Policy P>
double error_vs_full_precision(std::uint32_t seed, float key_offset = 2.f) {
  constexpr int D = P.head_dim;
  auto c = kvq::test::make_paged_case<P>(seed, 16, 2, 8, {512}, {2}, 3, key_offset);
  kvq::throw_if_error(c.append_all(seed));
  std::vector<float> out(c.q.size());
  kvq::throw_if_error(kvq::decode_attention<P>(c.const_cache(), c.table(), c.decode_params(out.data(), nullptr),
                                               c.params.view()));
  std::vector<double> ref(c.q.size());
  const double tau = 1.0 / std::sqrt(double(D));
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 8; ++j) {
      const int h = j / 4;
      kvq::exact_attention_row(c.q.data() + (i * 8 + j) * D, c.k.data() + h * D, c.v.data() + h * D, 2 * D, 512,
                               510 + i, D, tau, ref.data() + (i * 8 + j) * D);
    }
  return kvq::test::max_row_rel_err(out, ref, D);
}

TEST(Accuracy, K8V8StaysCloseToFullPrecision) {
  const double e = error_vs_full_precision<kvq::presets::K8V8>(1);
  std::printf("K8V8 max row relative error vs fp: %.3g\n", e);
  EXPECT_LT(e, 5e-3);
  EXPECT_LT(error_vs_full_precision<kvq::presets::K8V8_HC>(2), 5e-3);
}

TEST(Accuracy, HadamardShrinksTwoBitKeyErrorOnOutlierChannels) {
  // Without a shared key offset, Hadamard alone spreads the outlier channels.
  const double plain = error_vs_full_precision<kvq::presets::K2V4>(3, 0.f);
  const double hadamard = error_vs_full_precision<kvq::presets::K2V4_H>(3, 0.f);
  std::printf("K2V4 error vs fp (no key offset): none %.4f, Hadamard %.4f\n", plain, hadamard);
  EXPECT_LT(hadamard, 0.5 * plain);
  // With a shared offset (+2 on every channel), H concentrates it into one coordinate;
  // key centering removes it first.
  const double h_off = error_vs_full_precision<kvq::presets::K2V4_H>(3);
  const double hc_off = error_vs_full_precision<kvq::presets::K2V4_HC>(3);
  std::printf("K2V4 error vs fp (key offset 2): Hadamard %.4f, Hadamard+centering %.4f\n", h_off, hc_off);
  EXPECT_LT(hc_off, 0.5 * h_off);
}

TEST(Accuracy, MoreBitsForKeysBeatsMoreBitsForValues) {
  // Same budget (K4V2 and K2V4 cost the same bits up to metadata); keys matter more.
  const double k4v2 = error_vs_full_precision<kvq::presets::K4V2_H>(4);
  const double k2v4 = error_vs_full_precision<kvq::presets::K2V4_H>(4);
  std::printf("K4V2_H %.4f vs K2V4_H %.4f\n", k4v2, k2v4);
  EXPECT_LT(k4v2, k2v4);
}

}  // namespace
