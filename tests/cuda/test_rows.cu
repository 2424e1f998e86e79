// GPU fused quantize-append (addressed by position or by slot_mapping), dequantize and
// rotate versus the CPU reference: codes and metadata bit-identical, nothing written
// outside the addressed slots, dequantized and rotated rows bit-identical. Runs for every
// instantiated (policy, head_dim, dtype).
#include "cuda_test_utils.hpp"
#include "kvq_cuda_tests_kvq_instantiations.hpp"

namespace {

using namespace kvq;
using namespace kvq::test;

constexpr int kPoisonByte = 0xA5;

// Describes the first differing byte of two pools (page, head, region, offset).
template <Policy P>
std::string where(const PageLayout<P>& L, std::size_t off) {
  const std::size_t page = off / L.page_bytes(), in = off % L.page_bytes();
  const std::size_t head = in / L.head_bytes(), r = in % L.head_bytes();
  const char* region = r < L.key_meta_offset(0)     ? "K codes"
                       : r < L.value_codes_offset(0) ? "K meta"
                       : r < L.value_meta_offset(0)  ? "V codes"
                                                     : "V meta";
  return "page " + std::to_string(page) + " head " + std::to_string(head) + " " + region + " byte " +
         std::to_string(off);
}

template <Policy P, ActivationType T>
void check_append(int hkv, int page_size, const std::vector<int>& lens, std::uint32_t seed) {
  constexpr int D = P.head_dim;
  const RaggedTable tab = make_table(lens, page_size, seed);
  const PageLayout<P> layout{page_size, hkv};
  const std::size_t pool_bytes = layout.page_bytes() * tab.num_pages;
  const TokenList tok = all_tokens(tab, seed + 1);
  const int n = tok.size();
  auto kf = outlier_channels(n, hkv, D, seed + 2);
  auto vf = random_normal(std::size_t(n) * hkv * D, seed + 3, 1.5f);
  if (n > 3) {  // non-finite groups: s = NaN, codes 0 on both sides
    kf[std::size_t(1) * hkv * D + 3] = std::numeric_limits<float>::quiet_NaN();
    vf[std::size_t(2) * hkv * D + 5] = std::numeric_limits<float>::infinity();
  }
  const auto keys = convert<T>(kf), values = convert<T>(vf);
  Rotations rot;
  make_rotations<P>(rot, hkv, seed + 4);

  // CPU reference into a poisoned host pool.
  std::vector<std::byte> ref(pool_bytes, std::byte{kPoisonByte});
  KVQ_EXPECT_OK((append_kv<P, T>(PagedCacheView<P>{ref.data(), tab.num_pages, layout}, tab.host(), keys.data(),
                                 values.data(), n, tok.batch.data(), tok.pos.data(), rot.host())));

  // GPU: prefill (first half of the tokens, addressed by batch index and position) then
  // "decode" (the rest, addressed by a slot_mapping), poisoned pool.
  DeviceBuffer<std::byte> pool(pool_bytes);
  pool.fill_bytes(kPoisonByte);
  DeviceTable dt(tab);
  DeviceBuffer<T> dk(keys), dv(values);
  DeviceBuffer<std::int32_t> db(tok.batch), dp(tok.pos);
  DeviceBuffer<std::int64_t> dslots(slot_mapping(tab, tok));
  DeviceBuffer<unsigned> flags(std::vector<unsigned>{0u});
  const int n1 = n / 2;
  for (auto [first, count] : {std::pair{0, n1}, std::pair{n1, n - n1}}) {
    cuda::AppendArgs<P, T> a;
    a.cache = {pool.get(), tab.num_pages, layout};
    a.keys = dk.get() + std::size_t(first) * hkv * D;
    a.values = dv.get() + std::size_t(first) * hkv * D;
    a.num_tokens = count;
    if (first == 0) {
      a.table = dt.view();
      a.batch_indices = db.get() + first;
      a.positions = dp.get() + first;
    } else {
      a.slot_mapping = dslots.get() + first;
    }
    a.rotation = rot.device();
    a.error_flags = flags.get();
    KVQ_EXPECT_OK(cuda::append_kv(a, nullptr));
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(flags.download()[0], 0u);
  const auto got = pool.download();
  const auto diff = std::mismatch(got.begin(), got.end(), ref.begin());
  EXPECT_TRUE(diff.first == got.end()) << "first difference at " << where(layout, diff.first - got.begin());

  // Dequantize every token on the GPU: bit-identical to dequantize_sequence.
  DeviceBuffer<T> ok(std::size_t(n) * hkv * D), ov(std::size_t(n) * hkv * D);
  ok.fill_bytes(0xFF);  // NaN: an element the kernel does not write cannot match
  ov.fill_bytes(0xFF);
  cuda::DequantizeArgs<P, T> d;
  d.cache = {pool.get(), tab.num_pages, layout};
  d.table = dt.view();
  d.num_tokens = n;
  d.batch_indices = db.get();
  d.positions = dp.get();
  d.keys = ok.get();
  d.values = ov.get();
  d.rotation = rot.device();
  KVQ_EXPECT_OK(cuda::dequantize_kv(d, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto gk = ok.download(), gv = ov.download();
  const ConstPagedCacheView<P> host_view{ref.data(), tab.num_pages, layout};
  int mismatches = 0;
  for (int b = 0; b < static_cast<int>(lens.size()); ++b) {
    std::vector<float> hk(std::size_t(lens[b]) * hkv * D + 1), hv(hk.size());
    KVQ_EXPECT_OK(dequantize_sequence<P>(host_view, tab.host(), b, rot.host(), hk.data(), hv.data()));
    for (int i = 0; i < n; ++i) {
      if (tok.batch[i] != b) continue;
      for (int e = 0; e < hkv * D; ++e) {
        const std::size_t gi = std::size_t(i) * hkv * D + e, hi = std::size_t(tok.pos[i]) * hkv * D + e;
        mismatches += !same_value(gk[gi], from_float<T>(hk[hi]));
        mismatches += !same_value(gv[gi], from_float<T>(hv[hi]));
      }
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// Tokens outside the table are skipped and reported; the pool stays untouched.
template <Policy P, ActivationType T>
void check_append_rejects(std::uint32_t seed) {
  constexpr int D = P.head_dim;
  const RaggedTable tab = make_table({5, 20}, 16, seed);
  const PageLayout<P> layout{16, 2};
  const std::size_t pool_bytes = layout.page_bytes() * tab.num_pages;
  DeviceBuffer<std::byte> pool(pool_bytes);
  pool.fill_bytes(kPoisonByte);
  DeviceTable dt(tab);
  const std::vector<std::int32_t> b = {0, 2, -1, 1}, p = {5, 0, 0, -3};  // past end, bad b, bad b, negative
  DeviceBuffer<std::int32_t> db(b), dp(p);
  DeviceBuffer<T> rows(convert<T>(random_normal(4 * 2 * D, seed)));
  DeviceBuffer<unsigned> flags(std::vector<unsigned>{0u});
  Rotations rot;
  make_rotations<P>(rot, 2, seed);
  cuda::AppendArgs<P, T> a;
  a.cache = {pool.get(), tab.num_pages, layout};
  a.table = dt.view();
  a.keys = a.values = rows.get();
  a.num_tokens = 4;
  a.batch_indices = db.get();
  a.positions = dp.get();
  a.rotation = rot.device();
  a.error_flags = flags.get();
  KVQ_EXPECT_OK(cuda::append_kv(a, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(flags.download()[0], unsigned(cuda::kBadPosition | cuda::kBadBatchIndex));
  const auto got = pool.download();
  EXPECT_TRUE(std::all_of(got.begin(), got.end(), [](std::byte x) { return x == std::byte{kPoisonByte}; }));
}

template <Policy P, ActivationType T>
void check_rotate(int hkv, int group, std::uint32_t seed) {
  constexpr int D = P.head_dim;
  const int rows = 7, heads = hkv * group;
  const auto in = convert<T>(outlier_channels(rows, heads, D, seed));
  Rotations rot;
  make_rotations<P>(rot, hkv, seed + 1);
  DeviceBuffer<T> din(in), dout(in.size());
  for (auto op : {cuda::RotateOp::key, cuda::RotateOp::value, cuda::RotateOp::query, cuda::RotateOp::output}) {
    dout.fill_bytes(0xFF);
    cuda::RotateArgs<P, T> a{din.get(), dout.get(), rows, heads, group, op, rot.device()};
    KVQ_EXPECT_OK(cuda::rotate_rows(a, nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got = dout.download();
    int mismatches = 0;
    float x[D], scratch[D];
    for (int r = 0; r < rows * heads; ++r) {
      const int h = (r % heads) / group;
      for (int i = 0; i < D; ++i) x[i] = to_float(in[std::size_t(r) * D + i]);
      const RotationParams hp = rot.host();
      switch (op) {
        case cuda::RotateOp::key: transform_key<P>(x, h, hp, scratch); break;
        case cuda::RotateOp::value: transform_value<P>(x, h, hp, scratch); break;
        case cuda::RotateOp::query: transform_query<P>(x, h, hp, scratch); break;
        case cuda::RotateOp::output: untransform_output<P>(x, h, hp, scratch); break;
      }
      for (int i = 0; i < D; ++i) mismatches += !same_value(got[std::size_t(r) * D + i], from_float<T>(x[i]));
    }
    EXPECT_EQ(mismatches, 0) << "op " << int(op);
  }
}

#define KVQ_ROW_TESTS(ID, POLICY, T)                                                        \
  TEST(CudaAppend, ID) {                                                                    \
    KVQ_REQUIRE_CUDA_DEVICE();                                                              \
    check_append<POLICY, T>(2, 16, {1, 37, 0, 300, 129}, 11);                               \
    check_append<POLICY, T>(3, 64, {64, 65, 1000}, 12);                                     \
    check_append<POLICY, T>(1, 256, {513, 2}, 13);                                          \
    /* ≥ kAppendSplitBelow token·heads per call: one warp per token·head */                 \
    check_append<POLICY, T>(4, 64, {2100, 50}, 14);                                         \
  }                                                                                         \
  TEST(CudaAppend, ID##_rejects_out_of_range) {                                             \
    KVQ_REQUIRE_CUDA_DEVICE();                                                              \
    check_append_rejects<POLICY, T>(21);                                                    \
  }                                                                                         \
  TEST(CudaRotate, ID) {                                                                    \
    KVQ_REQUIRE_CUDA_DEVICE();                                                              \
    check_rotate<POLICY, T>(2, 4, 31);                                                      \
  }
KVQ_INSTANTIATIONS(KVQ_ROW_TESTS)
static_assert(cuda::append_parts(2150 / 2, 4) == 1 && cuda::append_parts(1129 / 2, 3) == 2,
              "CudaAppend covers both append paths");

}  // namespace
