#include <gtest/gtest.h>

#include "kvq/calib/activation_file.hpp"
#include "synthetic.hpp"

using namespace kvq::calib;

namespace {

std::vector<LayerActivations> two_layers() {
  return {synth::synthetic_layer(2, 3, 16, 2, 3, 64, 24, 1), synth::synthetic_layer(5, 3, 16, 2, 3, 64, 24, 2)};
}

LayerActivations reread_one(kvq::io::SafetensorsWriter& w, int layer) {
  return read_activations(kvq::io::SafetensorsFile::from_bytes(w.to_bytes()), {layer}).at(0);
}

// Every tensor of both layers comes back: as written (F32), or each value rounded once to
// the storage type (F16 and BF16, the committed fixture's F16 among them).
TEST(ActivationFile, RoundTrip) {
  const auto ls = two_layers();
  for (const auto stored : {kvq::io::DType::F32, kvq::io::DType::F16, kvq::io::DType::BF16}) {
    auto rounded = [&](const std::vector<float>& x) {
      std::vector<float> r(x);
      for (float& v : r)
        v = stored == kvq::io::DType::F16    ? float(kvq::half_t(v))
            : stored == kvq::io::DType::BF16 ? float(kvq::bfloat16_t(v))
                                             : v;
      return r;
    };
    auto w = activations_writer(ls, stored);
    const auto back = read_activations(kvq::io::SafetensorsFile::from_bytes(w.to_bytes()));
    ASSERT_EQ(back.size(), 2u);
    EXPECT_EQ(back[1].layer, 5);
    EXPECT_EQ(back[1].hq, 6);
    EXPECT_EQ(back[1].hkv, 2);
    EXPECT_EQ(back[1].hidden, 24);
    for (int l = 0; l < 2; ++l) {
      EXPECT_EQ(back[l].head_dim, ls[l].head_dim);
      EXPECT_EQ(back[l].q, rounded(ls[l].q)) << l;
      EXPECT_EQ(back[l].k, rounded(ls[l].k)) << l;
      EXPECT_EQ(back[l].v, rounded(ls[l].v)) << l;
      EXPECT_EQ(back[l].w_o, rounded(ls[l].w_o)) << l;
      EXPECT_EQ(back[l].seq_offsets, ls[l].seq_offsets) << l;
    }
    EXPECT_NE(ls[0].k, ls[0].v);  // a swap of k and v would show
  }
}

// The optional key mean (capture --mean-seqs) round-trips with its token count, reaches the
// per-head view, and becomes the calibration's μ_K.
TEST(ActivationFile, KeyMeanRoundTripsAndCentersKeys) {
  auto ls = two_layers();
  EXPECT_TRUE(read_activations(kvq::io::SafetensorsFile::from_bytes(activations_writer(ls).to_bytes()))[0]
                  .key_mean.empty());
  for (auto& l : ls) {
    l.key_mean.resize(static_cast<std::size_t>(l.hkv) * l.head_dim);
    for (std::size_t i = 0; i < l.key_mean.size(); ++i) l.key_mean[i] = 0.25f * static_cast<float>(i % 7) - 0.5f;
    l.key_mean_tokens = 4096;
  }
  const auto back = read_activations(kvq::io::SafetensorsFile::from_bytes(activations_writer(ls).to_bytes()));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[1].key_mean, ls[1].key_mean);
  EXPECT_EQ(back[1].key_mean_tokens, 4096);
  const HeadData hd = extract_head(back[1], 1, 0, 2);
  ASSERT_EQ(hd.key_mean.size(), 64);
  EXPECT_EQ(hd.key_mean[3], static_cast<double>(ls[1].key_mean[64 + 3]));
  // Misshapen: [Hkv, d − 1].
  kvq::io::SafetensorsWriter w = activations_writer({two_layers()[0]});
  std::vector<float> bad(2 * 63, 0.f);
  w.add_f32("layers.2.k_mean", {2, 63}, bad);
  w.set_metadata("key_mean_tokens", "16");
  EXPECT_THROW(reread_one(w, 2), kvq::Error);
  // A count that is not a positive integer.
  kvq::io::SafetensorsWriter w2 = activations_writer({ls[0]});
  w2.set_metadata("key_mean_tokens", "12x");
  EXPECT_THROW(reread_one(w2, 2), kvq::Error);
}

// The RoPE description (rope_shift.hpp) round-trips through the metadata; a file without
// it reads as unknown (θ = 0), and a malformed one is rejected.
TEST(ActivationFile, RopeMetadataRoundTrips) {
  auto ls = two_layers();
  EXPECT_EQ(read_activations(kvq::io::SafetensorsFile::from_bytes(activations_writer(ls).to_bytes()))[0].rope.theta, 0.0);
  for (auto& l : ls) l.rope = {100000.0, RopePairs::half, 8192};
  const auto back = read_activations(kvq::io::SafetensorsFile::from_bytes(activations_writer(ls).to_bytes()));
  EXPECT_EQ(back[1].rope.theta, 100000.0);
  EXPECT_EQ(back[1].rope.pairs, RopePairs::half);
  EXPECT_EQ(back[1].rope.context, 8192);
  kvq::io::SafetensorsWriter w = activations_writer({ls[0]});
  w.set_metadata("rope", "interleaved");
  EXPECT_THROW(reread_one(w, 2), kvq::Error);
  kvq::io::SafetensorsWriter w2 = activations_writer({ls[0]});
  w2.set_metadata("rope_theta", "-1");
  EXPECT_THROW(reread_one(w2, 2), kvq::Error);
  kvq::io::SafetensorsWriter w3 = activations_writer({ls[0]});
  w3.set_metadata("context_length", "0");
  EXPECT_THROW(reread_one(w3, 2), kvq::Error);
}

TEST(ActivationFile, MissingOrMisshapenTensorsAreRejected) {
  auto ls = two_layers();
  {
    auto w = activations_writer(ls);
    EXPECT_THROW(reread_one(w, 3), kvq::Error);  // no such layer
  }
  {
    kvq::io::SafetensorsWriter w;
    const auto& a = ls[0];
    w.add_f32("layers.2.q", {a.n_tokens, a.hq, 64}, a.q);
    w.add_f32("layers.2.k", {a.n_tokens, a.hkv, 64}, a.k);
    w.add_f32("layers.2.v", {a.n_tokens, a.hkv, 64}, a.v);
    std::vector<float> wo(24 * 5 * 64);
    w.add_f32("layers.2.w_o", {24, 5 * 64}, wo);  // wrong width
    w.add("seq_offsets", kvq::io::DType::I64, {4}, a.seq_offsets.data());
    EXPECT_THROW(reread_one(w, 2), kvq::Error);
  }
  {
    kvq::io::SafetensorsWriter w;
    const auto& a = ls[0];
    w.add_f32("layers.2.q", {a.n_tokens, a.hq, 64}, a.q);
    w.add_f32("layers.2.k", {a.n_tokens, a.hkv, 64}, a.k);
    w.add_f32("layers.2.v", {a.n_tokens, a.hkv, 64}, a.v);
    w.add_f32("layers.2.w_o", {24, a.hq * 64}, a.w_o);
    const std::int64_t bad[3] = {0, 30, 20};  // decreasing, does not end at L
    w.add("seq_offsets", kvq::io::DType::I64, {3}, bad);
    EXPECT_THROW(reread_one(w, 2), kvq::Error);
  }
  ls[0].q[7] = std::numeric_limits<float>::infinity();
  auto w = activations_writer(ls);
  EXPECT_THROW(reread_one(w, 2), kvq::Error);
}

}  // namespace
