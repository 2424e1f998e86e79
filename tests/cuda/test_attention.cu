// GPU decode attention (quantized and full precision) and merge_states versus the CPU
// reference's fp32 output: every output row within 1e-3 relative plus one rounding to the
// output type, LSE within 1e-3, rows that see no key exactly o = 0 and lse = −∞, rows
// that see a NaN logit NaN (compare_decode_rows), and every output element written
// (outputs start poisoned with NaN). The tensor-core kernel runs both precisions: `exact`
// against that reference, `fast` against fp64 attention in the stored basis within the
// bound of kernel/decode_mma.cuh (check_fast_bound). Covers GQA 1/4/8, page sizes
// 16–256, ragged and empty sequences, several causal query tokens, explicit causal
// offsets, split counts 1–8 and the rotated-basis output; each policy through both the
// CUDA-core and (where it applies) the tensor-core kernel. CudaMma checks the tensor
// cores' handling of the subnormal code operands that the tensor-core kernel relies on.
#include <limits>

#include "cuda_test_utils.hpp"
#include "kvq/cuda/launch/launch.cuh"  // detail::kernel_ptx_version
#include "kvq_cuda_tests_kvq_instantiations.hpp"

namespace {

using namespace kvq;
using namespace kvq::test;

// fp32 results of the GPU and the CPU may differ by this much (relative row error and
// LSE), on top of one rounding of the GPU's output to its type (compare_decode_rows).
// The emulator meets 1e-5 with the same kernels; the device's exp2f/log2f and FMA
// contraction may differ more.
constexpr double kDeviceTolerance = 1e-3;
// Prints the worst errors measured against that tolerance, to size it from them.
[[maybe_unused]] const ::testing::Environment* const kErrorReport =
    ::testing::AddGlobalTestEnvironment(new DecodeErrorReport("device exact decodes and merges", kDeviceTolerance));

struct DecodeCase {
  int hkv, group, page_size;
  std::vector<int> lens, nq;
  int splits;
  bool explicit_offset;
  bool rotated;
};

const std::vector<DecodeCase>& cases() {
  static const std::vector<DecodeCase> c = {
      {2, 1, 16, {1, 37, 0, 300, 129}, {1, 1, 1, 1, 1}, 1, false, false},
      {2, 4, 16, {1, 37, 0, 300, 129}, {1, 1, 1, 1, 1}, 3, false, false},
      {1, 8, 64, {1000, 5, 64}, {1, 1, 1}, 8, false, false},
      {2, 4, 32, {200, 77, 3}, {3, 1, 2}, 1, false, false},
      {2, 8, 16, {200, 77, 40}, {5, 1, 3}, 4, true, false},
      {3, 1, 16, {33, 2049}, {1, 1}, 5, false, false},
      {1, 4, 256, {700, 256}, {1, 2}, 2, false, true},
      {2, 4, 128, {0, 0}, {1, 1}, 2, false, false},
      {2, 4, 24, {77, 50}, {1, 2}, 9, false, false},  // page size not a power of two, empty splits
      {2, 4, 32, {64, 96}, {2, 3}, 1, false, false},  // whole last tiles that some rows see only in part
      // pages of 16 (two page runs per warp tile): whole tiles, last tiles of 1–16 and of
      // 17–31 tokens, a split boundary inside a sequence
      {2, 4, 16, {250, 57, 16}, {1, 2, 1}, 2, false, false},
  };
  return c;
}

// Causal offsets that mask some rows entirely and leave others unmasked.
std::vector<std::int32_t> offsets_for(const DecodeCase& c) {
  std::vector<std::int32_t> off;
  for (std::size_t b = 0; b < c.lens.size(); ++b)
    off.push_back(b % 2 == 0 ? c.lens[b] - c.nq[b] - 5 : (1 << 30));
  return off;
}

struct Queries {
  std::vector<std::int32_t> indptr;
  int total = 0, max_q = 1;
};
Queries queries_for(const DecodeCase& c) {
  Queries q;
  q.indptr.push_back(0);
  for (int n : c.nq) {
    q.indptr.push_back(q.indptr.back() + n);
    q.max_q = std::max(q.max_q, n);
  }
  q.total = q.indptr.back();
  return q;
}

// shared_ws: a workspace kept across calls as it is (zeroed once by the caller), instead
// of a fresh zeroed one.
template <Policy P, ActivationType T>
void check_decode(const DecodeCase& c, std::uint32_t seed, cuda::DecodeKernel kernel = cuda::DecodeKernel::simt,
                  const NanTokens& nan = {}, int* nan_rows = nullptr,
                  cuda::DecodePrecision precision = cuda::DecodePrecision::exact,
                  DeviceBuffer<std::byte>* shared_ws = nullptr) {
  constexpr int D = P.head_dim;
  if (c.rotated && P.value.centered) return;
  const RaggedTable tab = make_table(c.lens, c.page_size, seed);
  const PageLayout<P> layout{c.page_size, c.hkv};
  std::vector<std::byte> pool(layout.page_bytes() * tab.num_pages, std::byte{0});
  const TokenList tok = all_tokens(tab, seed + 1);
  const int n = tok.size();
  auto keys = convert<T>(outlier_channels(n, c.hkv, D, seed + 2));
  auto values = convert<T>(random_normal(std::size_t(n) * c.hkv * D, seed + 3, 1.5f));
  poison_rows(keys, tok, c.hkv, D, nan.keys);
  poison_rows(values, tok, c.hkv, D, nan.values);
  Rotations rot;
  make_rotations<P>(rot, c.hkv, seed + 4);
  KVQ_EXPECT_OK((append_kv<P, T>(PagedCacheView<P>{pool.data(), tab.num_pages, layout}, tab.host(), keys.data(),
                                 values.data(), n, tok.batch.data(), tok.pos.data(), rot.host())));

  const int hq = c.hkv * c.group;
  const Queries qs = queries_for(c);
  const auto q = convert<T>(random_normal(std::size_t(qs.total) * hq * D, seed + 5, 0.7f));
  const auto off = offsets_for(c);
  std::vector<float> out_ref(std::size_t(qs.total) * hq * D);
  std::vector<float> lse_ref(std::size_t(qs.total) * hq);
  const DecodeParams<T, float> hp{q.data(), qs.indptr.data(), hq, c.explicit_offset ? off.data() : nullptr, 0.f,
                                  c.rotated, out_ref.data(), lse_ref.data()};
  KVQ_EXPECT_OK((decode_attention<P>(ConstPagedCacheView<P>{pool.data(), tab.num_pages, layout}, tab.host(), hp,
                                     rot.host())));

  DeviceBuffer<std::byte> dpool(pool);
  DeviceTable dt(tab);
  DeviceBuffer<T> dq(q), dout(out_ref.size());
  DeviceBuffer<std::int32_t> dqi(qs.indptr), doff(off);
  DeviceBuffer<float> dlse(lse_ref.size());
  // Poison: NaN in every dtype; with NaN keys or values, whose rows must come out NaN, a
  // finite pattern (0x3C: 1.06 in fp16, 0.73 in bf16, 0.012 in fp32) that an unwritten
  // row would keep.
  const unsigned char poison = nan.keys.empty() && nan.values.empty() ? 0xFF : 0x3C;
  dout.fill_bytes(poison);
  dlse.fill_bytes(poison);
  cuda::DecodeArgs<P, T, T> a;
  a.cache = {dpool.get(), tab.num_pages, layout};
  a.table = dt.view();
  const bool fast = precision == cuda::DecodePrecision::fast;  // checked in the stored basis
  a.params = {dq.get(), dqi.get(), hq, c.explicit_offset ? doff.get() : nullptr, 0.f, c.rotated || fast, dout.get(), dlse.get()};
  a.rotation = rot.device();
  a.total_q = qs.total;
  a.max_q_per_seq = qs.max_q;
  a.num_splits = c.splits;
  a.kernel = kernel;
  a.precision = precision;
  DeviceBuffer<std::byte> local_ws(shared_ws ? 0 : cuda::decode_workspace_bytes(a));
  DeviceBuffer<std::byte>& ws = shared_ws ? *shared_ws : local_ws;
  ASSERT_GE(ws.size(), cuda::decode_workspace_bytes(a));
  a.workspace = ws.size() ? ws.get() : nullptr;
  a.workspace_bytes = ws.size();
  DeviceBuffer<unsigned> flags(std::vector<unsigned>{0u});  // every page index is valid
  a.error_flags = flags.get();
  // Twice into the same workspace, re-poisoning the output in between: the second launch
  // is only right if the first left the split arrival counters at zero.
  KVQ_EXPECT_OK(cuda::decode_attention(a, nullptr));
  dout.fill_bytes(poison);
  dlse.fill_bytes(poison);
  KVQ_EXPECT_OK(cuda::decode_attention(a, nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(flags.download()[0], 0u);
  if (fast) {
    if constexpr (!P.value.centered) {
      const std::vector<float> lse = dlse.download();
      check_fast_bound(pool.data(), layout, tab.host(), q, qs.indptr, hq, c.explicit_offset ? off.data() : nullptr,
                       rot.host(), dout.download(), "fast tensor-core, splits " + std::to_string(c.splits), nan_rows,
                       {&lse, &lse_ref, kDeviceTolerance});
    }
    return;
  }
  const int nans = compare_decode_rows(dout.download(), dlse.download(), out_ref, lse_ref, D,
                                       std::string(kernel == cuda::DecodeKernel::tensor_core ? "tensor-core " : "") +
                                           "hkv " + std::to_string(c.hkv) + " g " + std::to_string(c.group) + " P " +
                                           std::to_string(c.page_size) + " splits " + std::to_string(c.splits),
                                       kDeviceTolerance);
  if (nan_rows) *nan_rows = nans;
}

// Pipeline (kernel::MmaPipeline) launches the tensor-core kernel through cuda::tuning
// with those warps and stages instead of the default.
template <ActivationType T, int D, class Pipeline = void>
void check_dense_decode(const DecodeCase& c, std::uint32_t seed,
                        cuda::DecodeKernel kernel = cuda::DecodeKernel::simt,
                        cuda::DecodePrecision precision = cuda::DecodePrecision::exact) {
  const RaggedTable tab = make_table(c.lens, c.page_size, seed);
  const DensePageLayout<T, D> layout{c.page_size, c.hkv};
  const std::vector<std::byte> pool = random_dense_pool(tab, layout, c.lens, seed + 1);
  const int hq = c.hkv * c.group;
  const Queries qs = queries_for(c);
  const auto q = convert<T>(random_normal(std::size_t(qs.total) * hq * D, seed + 5, 0.7f));
  const auto off = offsets_for(c);
  std::vector<float> out_ref(std::size_t(qs.total) * hq * D);
  std::vector<float> lse_ref(std::size_t(qs.total) * hq);
  const DecodeParams<T, float> hp{q.data(), qs.indptr.data(), hq, c.explicit_offset ? off.data() : nullptr, 0.f,
                                  false, out_ref.data(), lse_ref.data()};
  KVQ_EXPECT_OK((dense_paged_attention<D, T>(pool.data(), tab.num_pages, layout, tab.host(), hp)));

  DeviceBuffer<std::byte> dpool(pool);
  DeviceTable dt(tab);
  DeviceBuffer<T> dq(q), dout(out_ref.size());
  DeviceBuffer<std::int32_t> dqi(qs.indptr), doff(off);
  DeviceBuffer<float> dlse(lse_ref.size());
  cuda::DenseDecodeArgs<T, D, T, T> a;
  a.pool = dpool.get();
  a.num_pages = tab.num_pages;
  a.layout = layout;
  a.table = dt.view();
  a.params = {dq.get(), dqi.get(), hq, c.explicit_offset ? doff.get() : nullptr, 0.f, false, dout.get(), dlse.get()};
  a.total_q = qs.total;
  a.max_q_per_seq = qs.max_q;
  a.num_splits = c.splits;
  a.kernel = kernel;
  a.precision = precision;
  DeviceBuffer<std::byte> ws(cuda::decode_workspace_bytes(a));
  a.workspace = ws.get();
  a.workspace_bytes = ws.size();
  // Twice into the same workspace, re-poisoning the output in between, as check_decode.
  for (int launch = 0; launch < 2; ++launch) {
    dout.fill_bytes(0xFF);
    dlse.fill_bytes(0xFF);
    if constexpr (std::is_void_v<Pipeline>) {
      KVQ_EXPECT_OK(cuda::dense_decode_attention(a, nullptr));
    } else if (precision == cuda::DecodePrecision::fast) {
      KVQ_EXPECT_OK((cuda::tuning::decode_attention<Pipeline, cuda::DecodePrecision::fast>(a, nullptr)));
    } else {
      KVQ_EXPECT_OK((cuda::tuning::decode_attention<Pipeline, cuda::DecodePrecision::exact>(a, nullptr)));
    }
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (precision == cuda::DecodePrecision::fast) {
    const std::vector<float> lse = dlse.download();
    check_fast_bound(pool.data(), layout, tab.host(), q, qs.indptr, hq, c.explicit_offset ? off.data() : nullptr,
                     dout.download(), "fast tensor-core dense, splits " + std::to_string(c.splits),
                     {&lse, &lse_ref, kDeviceTolerance});
    return;
  }
  compare_decode_rows(dout.download(), dlse.download(), out_ref, lse_ref, D,
                      kernel == cuda::DecodeKernel::tensor_core ? "tensor-core dense" : "dense", kDeviceTolerance);
}

template <ActivationType T, int D>
void check_merge(std::uint32_t seed) {
  const int rows = 37;
  auto o1 = convert<T>(random_normal(std::size_t(rows) * D, seed)), o2 = convert<T>(random_normal(std::size_t(rows) * D, seed + 1));
  auto l1 = random_normal(rows, seed + 2, 3.f), l2 = random_normal(rows, seed + 3, 3.f);
  const float ninf = -std::numeric_limits<float>::infinity();
  l1[0] = ninf;
  l2[1] = ninf;
  l1[2] = l2[2] = ninf;  // both empty: o = 0, lse = −∞
  for (int d = 0; d < D; ++d) o1[d] = o2[D + d] = from_float<T>(0.f), o1[2 * D + d] = o2[2 * D + d] = from_float<T>(0.f);
  std::vector<float> f1(rows * D), f2(rows * D), fo(rows * D), lo(rows);
  for (int i = 0; i < rows * D; ++i) f1[i] = to_float(o1[i]), f2[i] = to_float(o2[i]);
  merge_states(f1.data(), l1.data(), f2.data(), l2.data(), rows, D, fo.data(), lo.data());

  DeviceBuffer<T> d1(o1), d2(o2), dout(o1.size());
  DeviceBuffer<float> dl1(l1), dl2(l2), dlo(rows);
  // Into a NaN-poisoned buffer, then in place into o1, as engines do when folding a window
  // into the running state (rows 1 and 2 of o1 already hold the merged values there).
  dout.fill_bytes(0xFF);
  dlo.fill_bytes(0xFF);
  KVQ_EXPECT_OK(cuda::merge_states<T>(d1.get(), dl1.get(), d2.get(), dl2.get(), rows, D, dout.get(), dlo.get(), nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  compare_decode_rows(dout.download(), dlo.download(), fo, lo, D, "merge", kDeviceTolerance);
  dlo.fill_bytes(0xFF);
  KVQ_EXPECT_OK(cuda::merge_states<T>(d1.get(), dl1.get(), d2.get(), dl2.get(), rows, D, d1.get(), dlo.get(), nullptr));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  compare_decode_rows(d1.download(), dlo.download(), fo, lo, D, "merge in place", kDeviceTolerance);
}

bool tensor_cores_present() {
  cudaDeviceProp prop{};
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major >= 8;
}

#define KVQ_DECODE_TESTS(ID, POLICY, T)                                                              \
  TEST(CudaDecode, ID) {                                                                             \
    KVQ_REQUIRE_CUDA_DEVICE();                                                                       \
    std::uint32_t seed = 100;                                                                        \
    for (const auto& c : cases()) check_decode<POLICY, T>(c, seed++, cuda::DecodeKernel::simt);      \
  }                                                                                                  \
  TEST(CudaDecodeTensorCore, ID) {                                                                   \
    KVQ_REQUIRE_CUDA_DEVICE();                                                                       \
    if (!tensor_cores_present()) GTEST_SKIP() << "device below sm_80";                               \
    if constexpr (!cuda::DecodeArgs<POLICY, T, T>::kTensorCoreOk) {                                  \
      GTEST_SKIP() << "no tensor-core kernel for this policy (kTensorCoreDecode: groups too small)";  \
    } else {                                                                                         \
      std::uint32_t seed = 100;                                                                      \
      for (const auto& c : cases()) check_decode<POLICY, T>(c, seed++, cuda::DecodeKernel::tensor_core); \
      seed = 100;                                                                                    \
      if constexpr (!POLICY.value.centered)                                                          \
        for (const auto& c : cases())                                                                \
          check_decode<POLICY, T>(c, seed++, cuda::DecodeKernel::tensor_core, {}, nullptr,           \
                                  cuda::DecodePrecision::fast);                                      \
    }                                                                                                \
  }
KVQ_INSTANTIATIONS(KVQ_DECODE_TESTS)

#define KVQ_DENSE_TESTS(ID, D, T)                                        \
  TEST(CudaDenseDecode, ID) {                                            \
    KVQ_REQUIRE_CUDA_DEVICE();                                           \
    std::uint32_t seed = 200;                                            \
    for (const auto& c : cases()) check_dense_decode<T, D>(c, seed++);   \
  }                                                                      \
  TEST(CudaDenseDecodeTensorCore, ID) {                                  \
    KVQ_REQUIRE_CUDA_DEVICE();                                           \
    if (!tensor_cores_present()) GTEST_SKIP() << "device below sm_80";   \
    if constexpr (!cuda::DenseDecodeArgs<T, D, T, T>::kTensorCoreOk) {   \
      GTEST_SKIP() << "no tensor-core kernel for this cache type";      \
    } else {                                                             \
      std::uint32_t seed = 200;                                          \
      for (const auto& c : cases())                                      \
        check_dense_decode<T, D>(c, seed++, cuda::DecodeKernel::tensor_core); \
      seed = 200;                                                        \
      for (const auto& c : cases())                                      \
        check_dense_decode<T, D>(c, seed++, cuda::DecodeKernel::tensor_core, \
                                 cuda::DecodePrecision::fast);           \
    }                                                                    \
  }                                                                      \
  TEST(CudaMergeStates, ID) {                                            \
    KVQ_REQUIRE_CUDA_DEVICE();                                           \
    check_merge<T, D>(300);                                              \
  }
KVQ_DENSE_INSTANTIATIONS(KVQ_DENSE_TESTS)

// The pipelines bench_cuda_decode sweeps for the 16-bit pages (BM_DecodePipeFP16TC), so
// that one that measures faster can become the default with its device check in place:
// one warp with 4 stages and two with 3, both precisions (check_dense_decode instantiates
// both), against the CPU as the default pipeline is.
TEST(CudaDenseDecodeTensorCore, OtherPipelines_half_d128) {
  KVQ_REQUIRE_CUDA_DEVICE();
  if (!tensor_cores_present()) GTEST_SKIP() << "device below sm_80";
  constexpr auto kTensorCore = cuda::DecodeKernel::tensor_core;
  std::uint32_t seed = 250;
  for (const auto& c : cases()) {
    for (const auto precision : {cuda::DecodePrecision::exact, cuda::DecodePrecision::fast}) {
      check_dense_decode<half_t, 128, cuda::kernel::MmaPipeline<1, 4>>(c, seed, kTensorCore, precision);
      check_dense_decode<half_t, 128, cuda::kernel::MmaPipeline<2, 3>>(c, seed, kTensorCore, precision);
    }
    ++seed;
  }
}

// A NaN logit poisons the rows that see it (also as the only visible logit of its tile
// and split), a NaN value group the rows that weight it: as on the CPU, both kernels.
TEST(CudaDecode, NaNLogitsAndValueGroupsPoisonTheRowsThatSeeThem) {
  KVQ_REQUIRE_CUDA_DEVICE();
  NanTokens nan;
  nan.keys = {{0, 0}, {1, 39}};
  nan.values = {{3, 49}};
  constexpr Policy P = presets::K2V2_HC.with_head_dim(128);
  using enum cuda::DecodeKernel;
  using enum cuda::DecodePrecision;
  for (const int splits : {1, 2})
    for (const auto& [kernel, precision] : {std::pair{simt, exact}, {tensor_core, exact}, {tensor_core, fast}})
      for (const int page : {16, 24, 64}) {  // staging by two page runs per tile, per token, one page
        if (kernel == tensor_core && !tensor_cores_present()) continue;
        const DecodeCase c{1, 4, page, {1, 40, 70, 50}, {1, 2, 1, 2}, splits, false, false};
        int nan_rows = 0;
        check_decode<P, half_t>(c, 95, kernel, nan, &nan_rows, precision);
        EXPECT_EQ(nan_rows, 4 * 3) << "splits " << splits << ", page " << page;
      }
}

// One workspace, zeroed once, serves decode calls of every shape and both kernels, as an
// engine's does from step to step (the emulator's OneWorkspaceServesDecodesOfEveryShape).
TEST(CudaDecode, OneWorkspaceServesDecodesOfEveryShape) {
  KVQ_REQUIRE_CUDA_DEVICE();
  constexpr Policy P = presets::K4V2_HC.with_head_dim(128);
  DeviceBuffer<std::byte> ws(std::size_t(4) << 20);  // zero-filled
  const DecodeCase big{2, 4, 16, {300, 129, 37, 250, 64}, {3, 3, 3, 3, 3}, 8, false, false};
  const DecodeCase small{2, 4, 16, {100, 40}, {1, 1}, 3, false, false};
  const DecodeCase other{2, 4, 16, {70, 33, 200}, {2, 1, 1}, 5, false, false};
  using enum cuda::DecodeKernel;
  const auto tc = tensor_cores_present() ? tensor_core : simt;
  const auto exact = cuda::DecodePrecision::exact;
  check_decode<P, half_t>(big, 160, tc, {}, nullptr, exact, &ws);
  check_decode<P, half_t>(small, 161, tc, {}, nullptr, exact, &ws);
  check_decode<P, half_t>(big, 162, simt, {}, nullptr, exact, &ws);
  check_decode<P, half_t>(other, 163, tc, {}, nullptr, exact, &ws);
  check_decode<P, half_t>(small, 164, tc, {}, nullptr, exact, &ws);
}

// Programmatic dependent launch and CUDA graphs: a prefill append, then decode steps that
// each append one new row per sequence (at its last position, new values every step) and
// decode, all on one stream. With launch_with_pdl every launch may begin before the previous one has
// finished; the outputs must be the bytes of the same launches made one after another
// (a decode that read its pages before the append that writes them would see the
// poisoned pool or the previous step's row). Both decode kernels, with their splits
// merged by a second launch (CUDA-core) and in the kernel (tensor-core); each step's
// output then goes through merge_states (with itself) in a third dependent launch.
// Launches::graph and graph_pdl capture one decode step (append, decode, merge) into a
// CUDA graph, as engines do, under the strictest capture mode (global: a launcher that
// allocated, synchronized or copied synchronously would fail the capture), and replay it
// for every step: the step's new rows are copied into the captured input buffer and the
// captured outputs out to the step's slot, on the same stream.
enum class Launches { serial, pdl, graph, graph_pdl };

template <Policy P, ActivationType T>
std::vector<T> append_decode_chain(cuda::DecodeKernel kernel, Launches launches, int steps, unsigned& flags_out) {
  const bool pdl = launches == Launches::pdl || launches == Launches::graph_pdl;
  const bool graph = launches == Launches::graph || launches == Launches::graph_pdl;
  constexpr int D = P.head_dim;
  constexpr int hkv = 2, group = 4, hq = hkv * group;
  const std::vector<int> lens = {700, 1, 333, 1024};
  const int batch = static_cast<int>(lens.size());
  const RaggedTable tab = make_table(lens, 64, 17);
  const PageLayout<P> layout{64, hkv};
  const TokenList tok = all_tokens(tab, 18);
  const int n = tok.size();
  Rotations rot;
  make_rotations<P>(rot, hkv, 19);
  DeviceBuffer<std::byte> pool(layout.page_bytes() * tab.num_pages);
  pool.fill_bytes(0xFF);  // NaN metadata and scales until the prefill writes them
  DeviceTable dt(tab);
  DeviceBuffer<T> dk(convert<T>(random_normal(std::size_t(n) * hkv * D, 20, 1.f)));
  DeviceBuffer<T> dv(convert<T>(random_normal(std::size_t(n) * hkv * D, 21, 1.f)));
  DeviceBuffer<std::int32_t> db(tok.batch), dp(tok.pos);
  // Step s appends rows s of step_k / step_v at position len − 1 of every sequence.
  std::vector<std::int32_t> sb, sp;
  for (int b = 0; b < batch; ++b) sb.push_back(b), sp.push_back(lens[b] - 1);
  DeviceBuffer<std::int32_t> dsb(sb), dsp(sp);
  DeviceBuffer<T> step_k(convert<T>(random_normal(std::size_t(steps) * batch * hkv * D, 22, 1.f)));
  DeviceBuffer<T> step_v(convert<T>(random_normal(std::size_t(steps) * batch * hkv * D, 23, 1.f)));
  std::vector<std::int32_t> qi(batch + 1);
  std::iota(qi.begin(), qi.end(), 0);
  DeviceBuffer<std::int32_t> dqi(qi);
  DeviceBuffer<T> dq(convert<T>(random_normal(std::size_t(batch) * hq * D, 24, 0.7f)));
  const std::size_t step_rows = std::size_t(batch) * hq;
  DeviceBuffer<T> out(std::size_t(steps + 1) * step_rows * D), merged(out.size());
  DeviceBuffer<float> lse((steps + 1) * step_rows), merged_lse(lse.size());
  out.fill_bytes(0xFF);
  merged.fill_bytes(0xFF);
  DeviceBuffer<unsigned> flags(std::vector<unsigned>{0u});

  cuda::AppendArgs<P, T> ap;
  ap.cache = {pool.get(), tab.num_pages, layout};
  ap.table = dt.view();
  ap.keys = dk.get(), ap.values = dv.get();
  ap.num_tokens = n;
  ap.batch_indices = db.get(), ap.positions = dp.get();
  ap.rotation = rot.device();
  ap.error_flags = flags.get();
  cuda::DecodeArgs<P, T, T> dc;
  dc.cache = {pool.get(), tab.num_pages, layout};
  dc.table = dt.view();
  dc.params = {dq.get(), dqi.get(), hq, nullptr, 0.f, false, out.get(), lse.get()};
  dc.rotation = rot.device();
  dc.total_q = batch;
  dc.num_splits = 4;
  dc.kernel = kernel;
  dc.error_flags = flags.get();
  DeviceBuffer<std::byte> ws(cuda::decode_workspace_bytes(dc));
  dc.workspace = ws.get();
  dc.workspace_bytes = ws.size();

  const std::size_t step_elems = std::size_t(batch) * hkv * D;
  DeviceBuffer<T> cur_k(step_elems), cur_v(step_elems);  // the captured step's inputs
  DeviceBuffer<T> g_out(step_rows * D), g_merged(step_rows * D);  // and outputs
  DeviceBuffer<float> g_lse(step_rows), g_merged_lse(step_rows);
  // The buffers above were zeroed and filled on the legacy stream, which a non-blocking
  // stream does not wait for.
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cudaStream_t stream;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto launch_step = [&](T* o, float* l, T* m, float* ml) {
    EXPECT_TRUE(cuda::append_kv(ap, stream, pdl).ok());
    dc.params.out = o, dc.params.lse = l;
    EXPECT_TRUE(cuda::decode_attention(dc, stream, pdl).ok());
    EXPECT_TRUE(cuda::merge_states<T>(o, l, o, l, static_cast<int>(step_rows), D, m, ml, stream, pdl).ok());
  };
  cudaGraphExec_t exec = nullptr;
  for (int s = 0; s <= steps; ++s) {
    T* o = out.get() + s * step_rows * D;
    float* l = lse.get() + s * step_rows;
    T* m = merged.get() + s * step_rows * D;
    float* ml = merged_lse.get() + s * step_rows;
    if (s == 0) {  // the prefill
      launch_step(o, l, m, ml);
      ap.num_tokens = batch;  // from here on one decode step: the sequences' new rows
      ap.batch_indices = dsb.get(), ap.positions = dsp.get();
      continue;
    }
    const T* new_k = step_k.get() + (s - 1) * step_elems;
    const T* new_v = step_v.get() + (s - 1) * step_elems;
    if (!graph) {
      ap.keys = new_k, ap.values = new_v;
      launch_step(o, l, m, ml);
      continue;
    }
    if (!exec) {
      ap.keys = cur_k.get(), ap.values = cur_v.get();
      cudaGraph_t g = nullptr;
      EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
      launch_step(g_out.get(), g_lse.get(), g_merged.get(), g_merged_lse.get());
      EXPECT_EQ(cudaStreamEndCapture(stream, &g), cudaSuccess);
      if (g && pdl) {
        // Captured PDL launches become programmatic edges (else graph_pdl would only
        // repeat the plain graph): the step's kernels are compiled for sm_90 and hold
        // the wait, so on a Hopper or newer device at least one edge must be.
#if CUDART_VERSION >= 12030  // edge data: cudaGraphGetEdges_v2 in 12.3–12.9, cudaGraphGetEdges from 13.0
        std::size_t edges = 64;  // capacity in, count out (a step has a handful)
        std::vector<cudaGraphNode_t> from(edges), to(edges);
        std::vector<cudaGraphEdgeData> data(edges);
#if CUDART_VERSION >= 13000
        EXPECT_EQ(cudaGraphGetEdges(g, from.data(), to.data(), data.data(), &edges), cudaSuccess);
#else
        EXPECT_EQ(cudaGraphGetEdges_v2(g, from.data(), to.data(), data.data(), &edges), cudaSuccess);
#endif
        int programmatic = 0;
        for (std::size_t e = 0; e < edges && e < data.size(); ++e)
          programmatic += data[e].type == cudaGraphDependencyTypeProgrammatic;
        cudaDeviceProp prop{};
        EXPECT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
        if (prop.major >= 9) EXPECT_GE(programmatic, 1) << "of " << edges << " edges in the captured step";
#endif
      }
      if (!g || cudaGraphInstantiate(&exec, g, 0) != cudaSuccess || !exec) {
        ADD_FAILURE() << "the decode step could not be captured into a CUDA graph";
        if (g) cudaGraphDestroy(g);
        cudaStreamDestroy(stream);
        return {};
      }
      EXPECT_EQ(cudaGraphDestroy(g), cudaSuccess);
    }
    const auto d2d = [&](void* dst, const void* src, std::size_t bytes) {
      EXPECT_EQ(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream), cudaSuccess);
    };
    d2d(cur_k.get(), new_k, step_elems * sizeof(T));
    d2d(cur_v.get(), new_v, step_elems * sizeof(T));
    EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    d2d(o, g_out.get(), step_rows * D * sizeof(T));
    d2d(l, g_lse.get(), step_rows * sizeof(float));
    d2d(m, g_merged.get(), step_rows * D * sizeof(T));
    d2d(ml, g_merged_lse.get(), step_rows * sizeof(float));
  }
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  if (exec) EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  flags_out = flags.download()[0];
  std::vector<T> both = out.download();
  const std::vector<T> m = merged.download();
  both.insert(both.end(), m.begin(), m.end());
  return both;  // the decode outputs of every step, then their merges
}

TEST(CudaDependentLaunch, AppendDecodeChainMatchesSerialLaunches) {
  KVQ_REQUIRE_CUDA_DEVICE();
  constexpr Policy P = presets::K4V2.with_head_dim(128);
  constexpr int steps = 6;
  for (const auto kernel : {cuda::DecodeKernel::simt, cuda::DecodeKernel::tensor_core}) {
    if (kernel == cuda::DecodeKernel::tensor_core && !tensor_cores_present()) continue;
    unsigned serial_flags = 1;
    const auto serial = append_decode_chain<P, half_t>(kernel, Launches::serial, steps, serial_flags);
    EXPECT_EQ(serial_flags, 0u);
    const std::size_t per_step = serial.size() / (2 * (steps + 1));
    for (std::size_t i = 0; i < serial.size(); ++i)
      ASSERT_TRUE(std::isfinite(to_float(serial[i]))) << "serial launches, element " << i;
    for (const auto launches : {Launches::pdl, Launches::graph, Launches::graph_pdl}) {
      const char* name = launches == Launches::pdl     ? "PDL"
                         : launches == Launches::graph ? "CUDA graph"
                                                       : "CUDA graph with PDL";
      unsigned flags = 1;
      const auto other = append_decode_chain<P, half_t>(kernel, launches, steps, flags);
      EXPECT_EQ(flags, 0u) << name;
      ASSERT_EQ(serial.size(), other.size()) << name;
      for (std::size_t i = 0; i < serial.size(); ++i)
        ASSERT_EQ(bits_of(serial[i]), bits_of(other[i]))
            << name << ", " << (kernel == cuda::DecodeKernel::simt ? "CUDA-core" : "tensor-core") << " kernel, "
            << (i < serial.size() / 2 ? "decode" : "merge") << " of step " << i / per_step % (steps + 1)
            << ", element " << i % per_step;
    }
    // Every step decoded its own new rows.
    for (int s = 1; s <= steps; ++s)
      EXPECT_FALSE(std::equal(serial.begin() + (s - 1) * per_step, serial.begin() + s * per_step,
                              serial.begin() + s * per_step,
                              [](half_t a, half_t b) { return bits_of(a) == bits_of(b); }))
          << "step " << s;
  }
}

__global__ void grid_dependency_probe(int* x) {
  kvq::cuda::kernel::wait_for_prior_grids();
  *x = 1;
}
__global__ void grid_dependency_probe_2(int* x) { *x = 2; }

// The launchers use PDL only for kernels whose code holds the wait: this binary's kernels
// are compiled for sm_90 (KVQ_TEST_CUDA_ARCHITECTURES), so on a Hopper or newer device
// they must be found to hold it (else `launch_with_pdl` would silently do nothing), and
// the answer must not change when it comes from the table the second time. The check is
// on the compile target (ptxVersion), not on the code: probe 2, which has no wait, passes
// it too, which is why every kvq kernel waits before its first global access.
TEST(CudaDependentLaunch, KernelsCompiledForSm90HoldTheWait) {
  KVQ_REQUIRE_CUDA_DEVICE();
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  if (prop.major < 9) GTEST_SKIP() << "programmatic dependent launch needs compute capability 9+";
  for (int round = 0; round < 2; ++round)
    for (const void* k : {reinterpret_cast<const void*>(&grid_dependency_probe),
                          reinterpret_cast<const void*>(&grid_dependency_probe_2)}) {
      int version = 0;
      ASSERT_TRUE(cuda::detail::kernel_ptx_version(k, version).ok());
      EXPECT_GE(version, 90) << "round " << round;
    }
}

// One mma.sync m16n8k16 per lane's fragments (layouts in kvq/cuda/warp/mma.cuh).
__global__ void mma_probe(const unsigned* a, const unsigned* b, float* c) {
  const int lane = threadIdx.x;
  const unsigned ra[4] = {a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3]};
  const unsigned rb[2] = {b[2 * lane], b[2 * lane + 1]};
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  kvq::cuda::warp::mma_16816<half_t>(acc, ra, rb);
  for (int i = 0; i < 4; ++i) c[4 * lane + i] = acc[i];
}

// The tensor-core decode unpacks codes as fp16 subnormals, c·2^(e−24) (code_pair in
// kernel/decode_mma.cuh): the tensor cores must take them as they are. A holds such
// patterns (every code width, every position in the mantissa), B integers of both signs
// below 2^10, so each sum is a multiple of 2^-24 below 1 that fp32 holds exactly,
// whatever order the tensor core adds in. Tensor cores that flushed subnormal operands
// would give 0 here, and every quantized `fast` and `exact` decode would be wrong.
TEST(CudaMma, SubnormalHalfOperandsMultiplyExactly) {
  KVQ_REQUIRE_CUDA_DEVICE();
  if (!tensor_cores_present()) GTEST_SKIP() << "device below sm_80";
  std::mt19937 rng(2026);
  std::uint16_t A[16][16], B[16][8];
  for (int m = 0; m < 16; ++m)
    for (int k = 0; k < 16; ++k) {
      const int bits = 1 << (rng() % 4), shift = int(rng() % (11 - bits));  // width 1–8, inside the 10 mantissa bits
      A[m][k] = static_cast<std::uint16_t>((rng() & ((1u << bits) - 1)) << shift);
    }
  for (int k = 0; k < 16; ++k)
    for (int n = 0; n < 8; ++n) B[k][n] = static_cast<std::uint16_t>(bits_of(half_t(float(int(rng() % 2047) - 1023))));
  std::vector<unsigned> a(128), b(64);
  auto pair = [](std::uint16_t lo, std::uint16_t hi) { return unsigned(lo) | unsigned(hi) << 16; };
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    a[4 * lane] = pair(A[g][2 * t], A[g][2 * t + 1]);
    a[4 * lane + 1] = pair(A[g + 8][2 * t], A[g + 8][2 * t + 1]);
    a[4 * lane + 2] = pair(A[g][2 * t + 8], A[g][2 * t + 9]);
    a[4 * lane + 3] = pair(A[g + 8][2 * t + 8], A[g + 8][2 * t + 9]);
    b[2 * lane] = pair(B[2 * t][g], B[2 * t + 1][g]);
    b[2 * lane + 1] = pair(B[2 * t + 8][g], B[2 * t + 9][g]);
  }
  DeviceBuffer<unsigned> da(a), db(b);
  DeviceBuffer<float> dc(128);
  mma_probe<<<1, 32>>>(da.get(), db.get(), dc.get());
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> c = dc.download();
  int nonzero = 0;
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      const int row = lane / 4 + 8 * (i / 2), col = 2 * (lane % 4) + i % 2;
      double want = 0;
      for (int k = 0; k < 16; ++k) want += double(A[row][k]) * 0x1p-24 * double(to_float(half_t::from_bits(B[k][col])));
      nonzero += want != 0;
      EXPECT_EQ(double(c[4 * lane + i]), want) << "C(" << row << ", " << col << ")";
    }
  EXPECT_GT(nonzero, 100);  // the case is not vacuous
}

TEST(CudaDevice, ReportsWhetherADeviceExists) {
  const int n = cuda::device_count();
  if (n == 0) GTEST_SKIP() << "no CUDA device found";
  cudaDeviceProp prop{};
  ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
  std::printf("kvq: CUDA device 0: %s, sm_%d%d, %d SMs\n", prop.name, prop.major, prop.minor, prop.multiProcessorCount);
}

}  // namespace
