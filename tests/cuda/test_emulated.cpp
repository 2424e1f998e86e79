// The CUDA kernels run on the host SIMT emulator (emulator/simt.hpp), compiled by the
// plain C++ compiler: fused append / dequantize / rotate bit-identical to the CPU
// reference; quantized and full-precision split-KV decode against the CPU reference's fp32
// output within 1e-5 plus one rounding to the output type (compare_decode_rows), NaN rows
// included; merge_states within 1e-6. This exercises the kernels' indexing, warp cooperation, split-KV bookkeeping and
// numerics on every CI machine; the real-GPU tests (test_cuda_kernels) repeat the
// checks on hardware. Shared memory is poisoned before each decode launch.
#include "emulator/simt.hpp"

#include "common/quantizer_rows.hpp"
#include "cuda_test_utils.hpp"
#include "kvq/cuda/kernel/decode.cuh"
#include "kvq/cuda/kernel/decode_mma.cuh"
#include "kvq/cuda/kernel/rows.cuh"

namespace {

using namespace kvq;
using namespace kvq::test;

// Prints the worst errors of the exact checks against the CPU reference (tol 1e-5 unless a
// test says otherwise), beside the device's (test_attention.cu).
[[maybe_unused]] const ::testing::Environment* const kErrorReport =
    ::testing::AddGlobalTestEnvironment(new DecodeErrorReport("emulated exact decodes and merges", 1e-5));
namespace kern = kvq::cuda::kernel;
constexpr auto kTensorCore = cuda::DecodeKernel::tensor_core;

dim3 to_dim3(cuda::Dim3 d) { return dim3(d.x, d.y, d.z); }

template <class Args>
void emu_rows(void (*k)(Args), const Args& a, long long items) {
  if (items == 0) return;
  kvq_emu::launch(to_dim3(cuda::row_grid(items)), dim3(cuda::kRowWarpsPerBlock * 32), [&] { k(a); });
}
// The append kernel with `parts` warps per token·head (append_parts).
template <class Args>
void emu_append(const Args& a, int hkv, int parts) {
  const long long items = cuda::append_items(a.num_tokens, hkv, parts);
  if (items == 0) return;
  kvq_emu::launch(to_dim3(cuda::row_grid(items)), dim3(cuda::kRowWarpsPerBlock * 32),
                  [&] { kern::append_kernel<Args>(a, parts); });
}

// Runs body over the grid with `bytes` of the decode kernels' dynamic shared memory, a
// buffer of exactly that size, NaN-poisoned before every CTA.
template <class F>
void launch_decode(dim3 grid, dim3 block, std::size_t bytes, F&& body) {
  std::vector<uint4> smem((bytes + 15) / 16);
  kern::kvq_decode_smem = smem.data();
  kvq_emu::launch_ctas(grid, block, body, [&] { std::memset(smem.data(), 0xFF, smem.size() * sizeof(uint4)); });
  kern::kvq_decode_smem = nullptr;
}

template <class Pipeline = kern::MmaPipeline<>, class KP>
void emu_decode(const KP& kp, const cuda::DecodePlan& plan, cuda::DecodePrecision precision) {
  using Src = typename KP::source_type;
  auto run = [&]<int R>() {
    using Cfg = kern::DecodeConfig<Src, R>;
    launch_decode(to_dim3(plan.grid), dim3(Cfg::NW * 32), Cfg::smem.total(), [&] { kern::decode_kernel<KP, R>(kp); });
  };
  if constexpr (kern::MmaOps<Src>::kOk) {
    if (plan.kernel == cuda::DecodeKernel::tensor_core) {
      using Cfg = kern::MmaDecodeConfig<Src, Pipeline>;
      launch_decode(to_dim3(plan.grid), dim3(Cfg::NW * 32), Cfg::smem.total(), [&] {
        if (precision == cuda::DecodePrecision::exact)
          kern::decode_mma_kernel<KP, cuda::DecodePrecision::exact, Pipeline>(kp);
        else
          kern::decode_mma_kernel<KP, cuda::DecodePrecision::fast, Pipeline>(kp);
      });
    }
  }
  // The CUDA-core kernel only when the plan chose it (the tensor-core plan has 16 rows,
  // so testing plan.rows alone would run it as well and overwrite the output).
  constexpr int cap = cuda::max_rows_per_cta(Src::D);
  if (plan.kernel != cuda::DecodeKernel::tensor_core) {
    if (plan.rows == 4) run.template operator()<4>();
    if constexpr (cap >= 8)
      if (plan.rows == 8) run.template operator()<8>();
    if constexpr (cap >= 16)
      if (plan.rows == 16) run.template operator()<16>();
  }
  if (kp.num_splits > 1)
    kvq_emu::launch(to_dim3(plan.merge_grid), dim3(plan.merge_block), [&] { kern::split_merge_kernel<KP>(kp); });
}

// The tensor-core kernel merges its splits in the kernel; the last CTA of each tile resets
// its arrival counter (at the start of the workspace), so the workspace is ready for the
// next launch, of any shape.
void expect_counters_reset(const void* workspace, const cuda::DecodePlan& plan) {
  const auto* c = static_cast<const unsigned char*>(workspace);
  EXPECT_TRUE(std::all_of(c, c + plan.counter_bytes, [](unsigned char x) { return x == 0; }))
      << "split arrival counters were not reset";
}

// ---- append, dequantize, rotate: bit-identical -----------------------------------------

template <Policy P, ActivationType T>
void check_rows(int hkv, int page_size, const std::vector<int>& lens, std::uint32_t seed, int parts = 2) {
  constexpr int D = P.head_dim;
  const RaggedTable tab = make_table(lens, page_size, seed);
  const PageLayout<P> layout{page_size, hkv};
  const TokenList tok = all_tokens(tab, seed + 1);
  const int n = tok.size();
  auto kf = outlier_channels(n, hkv, D, seed + 2);
  auto vf = random_normal(std::size_t(n) * hkv * D, seed + 3, 1.5f);
  kf[3] = std::numeric_limits<float>::quiet_NaN();  // a non-finite group
  const auto keys = convert<T>(kf), values = convert<T>(vf);
  Rotations rot;
  make_rotations_host<P>(rot, hkv, seed + 4);

  std::vector<std::byte> ref(layout.page_bytes() * tab.num_pages, std::byte{0xA5}), got = ref;
  ASSERT_TRUE((append_kv<P, T>(PagedCacheView<P>{ref.data(), tab.num_pages, layout}, tab.host(), keys.data(),
                               values.data(), n, tok.batch.data(), tok.pos.data(), rot.host()))
                  .ok());
  unsigned flags = 0;
  cuda::AppendArgs<P, T> a{{got.data(), tab.num_pages, layout}, tab.host(), keys.data(), values.data(), n,
                           tok.batch.data(), tok.pos.data(), rot.host(), &flags};
  ASSERT_TRUE(cuda::validate(a).ok());
  emu_append(a, hkv, parts);
  EXPECT_EQ(flags, 0u);
  const auto diff = std::mismatch(got.begin(), got.end(), ref.begin());
  EXPECT_TRUE(diff.first == got.end()) << "first differing byte " << (diff.first - got.begin()) << " of "
                                       << got.size();

  std::vector<T> dk(std::size_t(n) * hkv * D), dv(dk.size());
  cuda::DequantizeArgs<P, T> d{{got.data(), tab.num_pages, layout}, tab.host(), n, tok.batch.data(), tok.pos.data(),
                               dk.data(), dv.data(), rot.host(), &flags};
  emu_rows(&kern::dequantize_kernel<cuda::DequantizeArgs<P, T>>, d, static_cast<long long>(n) * hkv);
  int mismatches = 0;
  for (int b = 0; b < static_cast<int>(lens.size()); ++b) {
    std::vector<float> hk(std::size_t(lens[b]) * hkv * D + 1), hv(hk.size());
    ASSERT_TRUE(dequantize_sequence<P>(ConstPagedCacheView<P>{ref.data(), tab.num_pages, layout}, tab.host(), b,
                                       rot.host(), hk.data(), hv.data())
                    .ok());
    for (int i = 0; i < n; ++i) {
      if (tok.batch[i] != b) continue;
      for (int e = 0; e < hkv * D; ++e) {
        const std::size_t gi = std::size_t(i) * hkv * D + e, hi = std::size_t(tok.pos[i]) * hkv * D + e;
        mismatches += !same_value(dk[gi], from_float<T>(hk[hi])) + !same_value(dv[gi], from_float<T>(hv[hi]));
      }
    }
  }
  EXPECT_EQ(mismatches, 0);

  // Rotate: the four operations on GQA-grouped rows.
  const int rows = 3, group = 2, heads = hkv * group;
  const auto in = convert<T>(outlier_channels(rows, heads, D, seed + 9));
  for (auto op : {cuda::RotateOp::key, cuda::RotateOp::value, cuda::RotateOp::query, cuda::RotateOp::output}) {
    std::vector<T> out(in.size());
    cuda::RotateArgs<P, T> r{in.data(), out.data(), rows, heads, group, op, rot.host()};
    emu_rows(&kern::rotate_kernel<cuda::RotateArgs<P, T>>, r, static_cast<long long>(rows) * heads);
    int bad = 0;
    float x[D], scratch[D];
    for (int i = 0; i < rows * heads; ++i) {
      const int h = (i % heads) / group;
      for (int e = 0; e < D; ++e) x[e] = to_float(in[std::size_t(i) * D + e]);
      switch (op) {
        case cuda::RotateOp::key: transform_key<P>(x, h, rot.host(), scratch); break;
        case cuda::RotateOp::value: transform_value<P>(x, h, rot.host(), scratch); break;
        case cuda::RotateOp::query: transform_query<P>(x, h, rot.host(), scratch); break;
        case cuda::RotateOp::output: untransform_output<P>(x, h, rot.host(), scratch); break;
      }
      for (int e = 0; e < D; ++e) bad += !same_value(out[std::size_t(i) * D + e], from_float<T>(x[e]));
    }
    EXPECT_EQ(bad, 0) << "rotate op " << int(op);
  }
}

// ---- decode attention --------------------------------------------------------------------

struct Case {
  int hkv, group, page_size;
  std::vector<int> lens, nq;
  int splits;
  bool explicit_offset, rotated;
};

struct QueryRun {
  std::vector<std::int32_t> indptr, offsets;
  int total = 0, max_q = 1;
};
QueryRun queries(const Case& c) {
  QueryRun q;
  q.indptr.push_back(0);
  for (std::size_t b = 0; b < c.nq.size(); ++b) {
    q.indptr.push_back(q.indptr.back() + c.nq[b]);
    q.max_q = std::max(q.max_q, c.nq[b]);
    q.offsets.push_back(b % 2 == 0 ? c.lens[b] - c.nq[b] - 5 : (1 << 30));
  }
  q.total = q.indptr.back();
  return q;
}

// How a decode check runs: the kernel and its precision; `exact` results are compared
// with the CPU reference within tol (plus output rounding), `fast` ones with fp64
// attention in the stored basis within the bound of kernel/decode_mma.cuh.
struct Run {
  cuda::DecodeKernel kernel = cuda::DecodeKernel::simt;
  cuda::DecodePrecision precision = cuda::DecodePrecision::exact;
  double tol = 1e-5;
  NanTokens nan{};
  int* nan_rows = nullptr;        // out: rows the reference has NaN in
  double* bound_ratio = nullptr;  // out (fast): the largest error / bound
  int bad_page = -1;              // ≥ 0: sequence 0's page of that index points outside the pool
  // Device-side table checks (DeviceError), each expecting its flag:
  int bad_table_seq = -1;   // ≥ 0: that sequence's last_page_len is page_size + 1 in the kernel's
                            // table (kBadPageTable): its rows must come out empty (o = 0, lse −∞)
  bool short_indices = false;  // with bad_table_seq, the last non-empty sequence: instead, the
                               // table's num_indices ends one page before that sequence's end
  bool padded_empty = false;  // empty sequences' last_page_len is page_size (batch padding, as
                              // engines fill it): not flagged, nothing read
  bool bad_q_indptr = false;  // the last sequence's q_indptr run ends past total_q (kBadQueryRows):
                              // its rows must stay unwritten
  int max_q_per_seq = 0;      // > 0: passed instead of the longest run; with runs longer than
                              // it (kBadQueryRows), the rows past the grid stay unwritten
  std::vector<uint4>* workspace = nullptr;  // kept across calls as it is (zeroed once by the
                                            // caller), instead of a fresh zeroed one
};

// Quantized decode `a` on the emulator: its workspace zeroed and 256-byte aligned in ws
// (the caller keeps it, to read the merge counters), the plan from validate, and the
// kernel's error flags.
template <class Pipeline = kern::MmaPipeline<>, Policy P, ActivationType T>
void emulate_decode(cuda::DecodeArgs<P, T, T>& a, std::vector<uint4>& ws, cuda::DecodePlan& plan, unsigned& flags,
                    bool keep_workspace = false) {
  const std::size_t words = (cuda::decode_workspace_bytes(a) + 15) / 16 + 16;
  if (keep_workspace) ASSERT_GE(ws.size(), words) << "the kept workspace is too small for this call";
  else ws.assign(words, uint4{0u, 0u, 0u, 0u});
  a.workspace = reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(ws.data()) + 255) & ~std::uintptr_t{255});
  a.workspace_bytes = cuda::decode_workspace_bytes(a);
  const Status st = cuda::validate(a, plan);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const kern::QuantSource<P> src{a.cache.pool, a.cache.num_pages, a.cache.layout};
  flags = 0;
  emu_decode<Pipeline>(kern::make_decode_params(src, a.table, a.params, a.rotation, a.num_splits, plan.row_tiles,
                                                plan.rows, a.total_q, a.workspace, &flags, plan.merge_grid.x == 0),
                       plan, a.precision);
}

// The table without sequence 0's page p: the keys a kernel attends to when that page index
// is bad (skipped). Attention over a set of keys does not depend on their slots, for rows
// that see them all.
RaggedTable without_page(const RaggedTable& t, int p) {
  RaggedTable r = t;
  const int n0 = t.indptr[1] - t.indptr[0];
  r.indices.erase(r.indices.begin() + t.indptr[0] + p);
  for (std::size_t b = 1; b < r.indptr.size(); ++b) --r.indptr[b];
  if (p == n0 - 1) {
    r.lens[0] -= t.last[0];
    r.last[0] = n0 > 1 ? t.page_size : 0;
  } else {
    r.lens[0] -= t.page_size;
  }
  return r;
}

// The table with sequence s emptied (no pages): its rows see no key.
RaggedTable without_sequence(const RaggedTable& t, int s) {
  RaggedTable r = t;
  const int n = t.indptr[s + 1] - t.indptr[s];
  r.indices.erase(r.indices.begin() + t.indptr[s], r.indices.begin() + t.indptr[s + 1]);
  for (std::size_t b = s + 1; b < r.indptr.size(); ++b) r.indptr[b] -= n;
  r.lens[s] = 0, r.last[s] = 0;
  return r;
}

template <Policy P, ActivationType T, class Pipeline = kern::MmaPipeline<>>
void check_decode(const Case& c, std::uint32_t seed, const Run& run = {}) {
  constexpr int D = P.head_dim;
  if (c.rotated && P.value.centered) return;
  const RaggedTable tab = make_table(c.lens, c.page_size, seed);
  const PageLayout<P> layout{c.page_size, c.hkv};
  std::vector<std::byte> pool(layout.page_bytes() * tab.num_pages, std::byte{0});
  const TokenList tok = all_tokens(tab, seed + 1);
  auto keys = convert<T>(outlier_channels(tok.size(), c.hkv, D, seed + 2));
  auto values = convert<T>(random_normal(std::size_t(tok.size()) * c.hkv * D, seed + 3, 1.5f));
  poison_rows(keys, tok, c.hkv, D, run.nan.keys);
  poison_rows(values, tok, c.hkv, D, run.nan.values);
  Rotations rot;
  make_rotations_host<P>(rot, c.hkv, seed + 4);
  ASSERT_TRUE((append_kv<P, T>(PagedCacheView<P>{pool.data(), tab.num_pages, layout}, tab.host(), keys.data(),
                               values.data(), tok.size(), tok.batch.data(), tok.pos.data(), rot.host()))
                  .ok());
  const int hq = c.hkv * c.group;
  const QueryRun qs = queries(c);
  const auto q = convert<T>(random_normal(std::size_t(qs.total) * hq * D, seed + 5, 0.7f));
  std::vector<float> ref(std::size_t(qs.total) * hq * D);
  // Poison: NaN; with NaN keys or values, whose rows must come out NaN, a finite value
  // that an unwritten row would keep.
  const float poison = run.nan.keys.empty() && run.nan.values.empty() ? std::nanf("") : 1.0625f;
  std::vector<T> out(ref.size(), from_float<T>(poison));
  std::vector<float> lse_ref(std::size_t(qs.total) * hq), lse(lse_ref.size(), poison);
  const std::int32_t* off = c.explicit_offset ? qs.offsets.data() : nullptr;
  const DecodeParams<T, float> hp{q.data(), qs.indptr.data(), hq, off, 0.f, c.rotated, ref.data(), lse_ref.data()};
  // With a bad page the reference attends to sequence 0's other pages (its rows see all keys).
  ASSERT_TRUE(run.bad_page < 0 || (c.nq[0] == 1 && !c.explicit_offset));
  const RaggedTable ref_tab = run.bad_page >= 0        ? without_page(tab, run.bad_page)
                             : run.bad_table_seq >= 0 ? without_sequence(tab, run.bad_table_seq)
                                                      : tab;
  ASSERT_TRUE(decode_attention<P>(ConstPagedCacheView<P>{pool.data(), tab.num_pages, layout}, ref_tab.host(), hp,
                                  rot.host())
                  .ok());

  cuda::DecodeArgs<P, T, T> a;
  a.cache = {pool.data(), tab.num_pages, layout};
  RaggedTable kernel_tab = tab;
  if (run.bad_page >= 0) kernel_tab.indices[kernel_tab.indptr[0] + run.bad_page] = tab.num_pages + 7;
  if (run.bad_table_seq >= 0) {
    ASSERT_GT(tab.lens[run.bad_table_seq], 0);
    if (!run.short_indices) kernel_tab.last[run.bad_table_seq] = tab.page_size + 1;
  }
  if (run.padded_empty)
    for (std::size_t b = 0; b < tab.lens.size(); ++b)
      if (tab.lens[b] == 0) kernel_tab.last[b] = tab.page_size;
  a.table = kernel_tab.host();
  if (run.short_indices) {
    ASSERT_GE(run.bad_table_seq, 0);
    ASSERT_EQ(tab.indptr[run.bad_table_seq + 1], tab.indptr.back());  // no pages after it
    a.table.num_indices = tab.indptr.back() - 1;
  }
  std::vector<std::int32_t> kernel_qi = qs.indptr;
  if (run.bad_q_indptr) kernel_qi.back() = qs.total + 3;
  const bool fast = run.precision == cuda::DecodePrecision::fast;
  a.params = {q.data(), kernel_qi.data(), hq, off, 0.f, c.rotated || fast, out.data(), lse.data()};
  a.rotation = rot.host();
  a.total_q = qs.total;
  a.max_q_per_seq = run.max_q_per_seq > 0 ? run.max_q_per_seq : qs.max_q;
  a.num_splits = c.splits;
  a.kernel = run.kernel;
  a.precision = run.precision;
  std::vector<uint4> local_ws;
  std::vector<uint4>& ws = run.workspace ? *run.workspace : local_ws;
  cuda::DecodePlan plan;
  unsigned flags = 0;
  ASSERT_NO_FATAL_FAILURE(emulate_decode<Pipeline>(a, ws, plan, flags, run.workspace != nullptr));
  ASSERT_EQ(plan.kernel == cuda::DecodeKernel::tensor_core, run.kernel == cuda::DecodeKernel::tensor_core);
  expect_counters_reset(a.workspace, plan);
  // Rows a flagged run leaves unwritten keep their NaN poison: the reference says NaN there.
  auto expect_unwritten = [&](int qrow, int head) {
    const std::size_t item = std::size_t(qrow) * hq + head;
    std::fill(ref.begin() + item * D, ref.begin() + (item + 1) * D, std::nanf(""));
    lse_ref[item] = std::nanf("");
  };
  const int batch = static_cast<int>(c.lens.size());
  if (run.bad_q_indptr)
    for (int i = qs.indptr[batch - 1]; i < qs.total; ++i)
      for (int j = 0; j < hq; ++j) expect_unwritten(i, j);
  bool rows_past_grid = false;
  for (int b = 0; b < batch; ++b)
    for (int h = 0; h < c.hkv; ++h)
      for (int r = plan.row_tiles * plan.rows; r < c.nq[b] * c.group; ++r) {
        expect_unwritten(qs.indptr[b] + r / c.group, h * c.group + r % c.group);
        rows_past_grid = true;
      }
  const unsigned expected_flags = (run.bad_page >= 0 ? unsigned(cuda::kBadPage) : 0u) |
                                  (run.bad_table_seq >= 0 ? unsigned(cuda::kBadPageTable) : 0u) |
                                  (run.bad_q_indptr || rows_past_grid ? unsigned(cuda::kBadQueryRows) : 0u);
  EXPECT_EQ(flags, expected_flags);
  const std::string what = run.kernel == cuda::DecodeKernel::tensor_core ? "tensor-core decode" : "quantized decode";
  if (fast) {
    if constexpr (P.value.centered) {
      ADD_FAILURE() << "the fast-mode check compares stored-basis outputs: it needs un-centered values";
    } else {
      int nans = 0;
      const double ratio = check_fast_bound(pool.data(), layout, tab.host(), q, qs.indptr, hq, off, rot.host(), out,
                                            "fast " + what, &nans, {&lse, &lse_ref});
      if (run.bound_ratio) *run.bound_ratio = std::max(*run.bound_ratio, ratio);
      if (run.nan_rows) *run.nan_rows = nans;
    }
    return;
  }
  const int nans = compare_decode_rows(out, lse, ref, lse_ref, D, what, run.tol);
  if (run.nan_rows) *run.nan_rows = nans;
}

template <ActivationType T, int D, class Pipeline = kern::MmaPipeline<>>
void check_dense(const Case& c, std::uint32_t seed, const Run& run = {}) {
  const RaggedTable tab = make_table(c.lens, c.page_size, seed);
  const DensePageLayout<T, D> layout{c.page_size, c.hkv};
  const std::vector<std::byte> pool = random_dense_pool(tab, layout, c.lens, seed + 1);
  const int hq = c.hkv * c.group;
  const QueryRun qs = queries(c);
  const auto q = convert<T>(random_normal(std::size_t(qs.total) * hq * D, seed + 5, 0.7f));
  std::vector<float> ref(std::size_t(qs.total) * hq * D);
  std::vector<T> out(ref.size(), from_float<T>(std::nanf("")));
  std::vector<float> lse_ref(std::size_t(qs.total) * hq), lse(lse_ref.size(), std::nanf(""));
  const std::int32_t* off = c.explicit_offset ? qs.offsets.data() : nullptr;
  const DecodeParams<T, float> hp{q.data(), qs.indptr.data(), hq, off, 0.f, false, ref.data(), lse_ref.data()};
  ASSERT_TRUE((dense_paged_attention<D, T>(pool.data(), tab.num_pages, layout, tab.host(), hp)).ok());

  cuda::DenseDecodeArgs<T, D, T, T> a;
  a.pool = pool.data();
  a.num_pages = tab.num_pages;
  a.layout = layout;
  a.table = tab.host();
  a.params = {q.data(), qs.indptr.data(), hq, off, 0.f, false, out.data(), lse.data()};
  a.total_q = qs.total;
  a.max_q_per_seq = qs.max_q;
  a.num_splits = c.splits;
  a.kernel = run.kernel;
  a.precision = run.precision;
  std::vector<uint4> ws((cuda::decode_workspace_bytes(a) + 15) / 16 + 16);
  a.workspace = reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(ws.data()) + 255) & ~std::uintptr_t{255});
  a.workspace_bytes = cuda::decode_workspace_bytes(a);
  cuda::DecodePlan plan;
  ASSERT_TRUE(cuda::validate(a, plan).ok());
  ASSERT_EQ(plan.kernel == cuda::DecodeKernel::tensor_core, run.kernel == cuda::DecodeKernel::tensor_core);
  const kern::DenseSource<T, D> src{a.pool, a.num_pages, a.layout};
  emu_decode<Pipeline>(kern::make_decode_params(src, a.table, a.params, RotationParams{}, a.num_splits,
                                                plan.row_tiles, plan.rows, a.total_q, a.workspace, nullptr,
                                                plan.merge_grid.x == 0),
                       plan, run.precision);
  expect_counters_reset(a.workspace, plan);
  const std::string what = run.kernel == cuda::DecodeKernel::tensor_core ? "tensor-core dense decode" : "dense decode";
  if (run.precision == cuda::DecodePrecision::fast) {
    const double ratio =
        check_fast_bound(pool.data(), layout, tab.host(), q, qs.indptr, hq, off, out, "fast " + what, {&lse, &lse_ref});
    if (run.bound_ratio) *run.bound_ratio = std::max(*run.bound_ratio, ratio);
    return;
  }
  compare_decode_rows(out, lse, ref, lse_ref, D, what, run.tol);
}

const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {2, 1, 16, {1, 37, 0, 130}, {1, 1, 1, 1}, 1, false, false},
      {2, 4, 16, {1, 37, 0, 130}, {1, 1, 1, 1}, 3, false, false},
      {1, 8, 64, {300, 5}, {1, 1}, 4, false, false},
      {2, 4, 32, {90, 40, 3}, {3, 1, 2}, 1, false, false},
      {1, 8, 16, {100, 33}, {3, 1}, 2, true, false},
      {1, 4, 256, {200}, {2}, 2, false, true},
      {2, 4, 24, {77, 50}, {1, 2}, 9, false, false},  // page size not a power of two, empty splits
      {2, 4, 32, {64, 96}, {2, 3}, 1, false, false},  // whole last tiles that some rows see only in part
      // pages of 16 (two page runs per warp tile): whole tiles, last tiles of 1–16 and of
      // 17–31 tokens, a split boundary inside a sequence
      {2, 4, 16, {250, 57, 16}, {1, 2, 1}, 2, false, false},
  };
  return c;
}

// The emulated mma.sync against the PTX ISA's fragment formulas, written here element by
// element (a_i, b_i, c_i) independently of the kernel's register packing: D = A·B + C.
TEST(CudaEmulated, MmaFollowsThePtxFragmentLayout) {
  std::mt19937 gen(5);
  std::uniform_int_distribution<int> small(-40, 40);
  float A[16][16], B[16][8], C[16][8], Dout[16][8];
  for (auto& r : A)
    for (float& x : r) x = small(gen) / 8.f;  // exact in fp16
  for (auto& r : B)
    for (float& x : r) x = static_cast<float>(small(gen));
  for (auto& r : C)
    for (float& x : r) x = small(gen) / 4.f;
  kvq_emu::launch(dim3(1), dim3(32), [&] {
    const int lane = static_cast<int>(threadIdx.x), group = lane >> 2, tig = lane % 4;
    unsigned a[4] = {}, b[2] = {};
    float c[4];
    for (int i = 0; i < 8; ++i) {
      const int row = (i < 2 || (i >= 4 && i < 6)) ? group : group + 8;
      const int col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
      a[i / 2] |= cuda::warp::half_bits(A[row][col]) << (16 * (i % 2));
    }
    for (int i = 0; i < 4; ++i) {
      const int row = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0);
      b[i / 2] |= cuda::warp::half_bits(B[row][group]) << (16 * (i % 2));
    }
    for (int i = 0; i < 4; ++i) c[i] = C[i < 2 ? group : group + 8][tig * 2 + (i & 1)];
    cuda::warp::mma_16816(c, a, b);
    for (int i = 0; i < 4; ++i) Dout[i < 2 ? group : group + 8][tig * 2 + (i & 1)] = c[i];
  });
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n) {
      double want = C[r][n];
      for (int k = 0; k < 16; ++k) want += double(A[r][k]) * B[k][n];
      EXPECT_EQ(Dout[r][n], static_cast<float>(want)) << r << "," << n;
    }
  // Operand packing: hi + lo carries 22 bits (for |x| ≥ 2^-3, where the low half stays a
  // normal fp16; the kernel scales its operands into that range).
  for (float x : {1.f / 3.f, -12345.678f, 0.2f, 0.f}) {
    unsigned p[2];
    cuda::warp::split_pack2<half_t, 2>(x, -x, p);
    const double got = double(to_float(half_t::from_bits(static_cast<std::uint16_t>(p[0] & 0xffff)))) +
                       to_float(half_t::from_bits(static_cast<std::uint16_t>(p[1] & 0xffff)));
    EXPECT_LE(std::abs(got - x), 2.5e-7 * std::abs(x) + 1e-12) << x;
  }
}

// The tensor-core kernel's exact code unpacking: every fp16 pair of a key run (two codes
// of one token) and of a value run (one code of two tokens) holds the codes its tables
// name times 2^(exp + kCodeExp) (fp16 subnormals), and the tables cover each code of the
// run exactly once.
template <int Bits>
unsigned packed_code(const std::uint8_t* run, int i) {
  return (run[i * Bits / 8] >> (i * Bits % 8)) & ((1u << Bits) - 1u);
}
float pair_half(unsigned reg, int hi) { return to_float(half_t::from_bits(static_cast<std::uint16_t>(hi ? reg >> 16 : reg))); }

template <int Bits, int RunBits>
void check_key_run(std::mt19937& gen) {
  using KR = kern::KeyRun<Bits, RunBits>;
  alignas(16) std::uint8_t run[RunBits / 8];
  for (auto& b : run) b = static_cast<std::uint8_t>(gen());
  unsigned u[KR::kPairs];
  KR::unpack(reinterpret_cast<const std::byte*>(run), u);
  std::vector<int> seen(RunBits / Bits, 0);
  for (int r = 0; r < KR::kPairs; ++r) {
    const float scale = std::ldexp(1.f, KR::exp(r) + kern::kCodeExp);
    EXPECT_EQ(pair_half(u[r], 0), float(packed_code<Bits>(run, KR::lo(r))) * scale) << Bits << "/" << RunBits << " r " << r;
    EXPECT_EQ(pair_half(u[r], 1), float(packed_code<Bits>(run, KR::hi(r))) * scale) << Bits << "/" << RunBits << " r " << r;
    ++seen[KR::lo(r)], ++seen[KR::hi(r)];
  }
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; })) << Bits << "/" << RunBits;
}

template <int Bits, int RunBits>
void check_value_run(std::mt19937& gen) {
  using VR = kern::ValueRun<Bits, RunBits>;
  alignas(16) std::uint8_t a[RunBits / 8], b[RunBits / 8];
  for (auto& x : a) x = static_cast<std::uint8_t>(gen());
  for (auto& x : b) x = static_cast<std::uint8_t>(gen());
  unsigned u[VR::kPairs];
  VR::unpack(reinterpret_cast<const std::byte*>(a), reinterpret_cast<const std::byte*>(b), u);
  std::vector<int> seen(RunBits / Bits, 0);
  for (int r = 0; r < VR::kPairs; ++r) {
    const float scale = std::ldexp(1.f, VR::exp(r) + kern::kCodeExp);
    EXPECT_EQ(pair_half(u[r], 0), float(packed_code<Bits>(a, VR::code(r))) * scale) << Bits << "/" << RunBits << " r " << r;
    EXPECT_EQ(pair_half(u[r], 1), float(packed_code<Bits>(b, VR::code(r))) * scale) << Bits << "/" << RunBits << " r " << r;
    ++seen[VR::code(r)];
  }
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; })) << Bits << "/" << RunBits;
}

TEST(CudaEmulated, CodeUnpackingIsExactAndCoversEveryCode) {
  std::mt19937 gen(11);
  for (int rep = 0; rep < 50; ++rep) {
    check_key_run<2, 16>(gen), check_key_run<4, 16>(gen), check_key_run<2, 32>(gen), check_key_run<4, 32>(gen);
    check_key_run<8, 32>(gen), check_key_run<2, 64>(gen), check_key_run<4, 128>(gen), check_key_run<8, 256>(gen);
    check_value_run<2, 16>(gen), check_value_run<4, 16>(gen), check_value_run<8, 16>(gen), check_value_run<2, 32>(gen);
    check_value_run<4, 64>(gen), check_value_run<8, 128>(gen);
  }
}

// The warp quantizer (a group per segment of lanes) against the scalar quantize_row on
// the adversarial rows of the CPU SIMD test (clip-rank ties, signed zeros, NaN/Inf,
// saturating and subnormal metadata, rounding-boundary values), one warp per row, into
// poisoned outputs.
template <QuantSpec S, int D>
void check_warp_quantizer() {
  using MetaStorage = meta_storage_t<S.meta>;
  constexpr int kBytes = D * S.bits / 8, kMeta = 2 * (D / S.group);
  int boundary_values = 0;
  const auto rows = quantizer_rows<S, D>(boundary_values);
  ASSERT_GT(boundary_values, D / 4) << to_string(S);
  const int n = static_cast<int>(rows.size());
  std::vector<float> in;
  for (const auto& r : rows) in.insert(in.end(), r.begin(), r.end());
  std::vector<std::uint8_t> codes(std::size_t(n) * kBytes, 0xAB);
  std::vector<MetaStorage> meta(std::size_t(n) * kMeta);
  std::memset(meta.data(), 0xAB, meta.size() * sizeof(MetaStorage));
  kvq_emu::launch(dim3(n), dim3(32), [&] {
    const int r = static_cast<int>(blockIdx.x);
    kern::quantize_row_warp<S, D>(in.data() + std::size_t(r) * D, reinterpret_cast<std::byte*>(codes.data() + r * kBytes),
                                  reinterpret_cast<std::byte*>(meta.data() + r * kMeta));
  });
  for (int r = 0; r < n; ++r) {
    std::vector<std::uint8_t> ref(kBytes, 0xCD);
    std::vector<MetaStorage> ref_meta(kMeta);
    std::memset(ref_meta.data(), 0xCD, kMeta * sizeof(MetaStorage));
    quantize_row<S, D>(rows[r].data(), ref.data(), ref_meta.data());
    EXPECT_EQ(std::memcmp(codes.data() + r * kBytes, ref.data(), kBytes), 0) << to_string(S) << " D " << D << " row " << r;
    EXPECT_EQ(std::memcmp(meta.data() + r * kMeta, ref_meta.data(), kMeta * sizeof(MetaStorage)), 0)
        << to_string(S) << " D " << D << " row " << r;
  }
}

TEST(CudaEmulated, WarpQuantizerIsBitIdenticalToTheScalarOne) {
  using enum MetaType;
  // Segments of 8 and 32 lanes at D 128 (4 elements a lane), 2-bit codes shared by two
  // lanes at D 64, 2-, 8- and 32-lane segments at D 256 (8 elements a lane).
  check_warp_quantizer<spec(4, 32), 128>();
  check_warp_quantizer<spec(2, 128), 128>();
  check_warp_quantizer<spec(8, 32, fp32), 64>();
  check_warp_quantizer<spec(2, 16, bf16), 64>();
  check_warp_quantizer<spec(4, 64, fp32), 256>();
  check_warp_quantizer<spec(2, 16), 256>();
  check_warp_quantizer<spec(8, 256, bf16), 256>();
  // Clipping: OptR's key and value ranks, other ranks and metadata, rank 0 (64 rounds).
  check_warp_quantizer<spec(4, 32, fp16, 960), 128>();
  check_warp_quantizer<spec(2, 128, fp16, 920), 128>();
  check_warp_quantizer<spec(2, 16, fp32, 700), 64>();
  check_warp_quantizer<spec(4, 64, bf16, 850), 256>();
  check_warp_quantizer<spec(4, 64, fp16, 1), 64>();
}

// Tokens outside the page table are skipped and reported; the pool stays untouched.
TEST(CudaEmulated, AppendRejectsOutOfRange) {
  constexpr Policy P = presets::K4V2_HC.with_head_dim(64);
  const RaggedTable tab = make_table({5, 20}, 16, 7);
  const PageLayout<P> layout{16, 2};
  std::vector<std::byte> pool(layout.page_bytes() * tab.num_pages, std::byte{0xA5});
  const std::vector<std::int32_t> b = {0, 2, -1, 1}, p = {5, 0, 0, -3};
  const auto rows = convert<half_t>(random_normal(4 * 2 * 64, 8));
  Rotations rot;
  make_rotations_host<P>(rot, 2, 9);
  unsigned flags = 0;
  cuda::AppendArgs<P, half_t> a{{pool.data(), tab.num_pages, layout}, tab.host(), rows.data(), rows.data(), 4,
                                b.data(), p.data(), rot.host(), &flags};
  emu_append(a, 2, 2);
  EXPECT_EQ(flags, unsigned(cuda::kBadPosition | cuda::kBadBatchIndex));
  flags = 0;
  emu_append(a, 2, 1);
  EXPECT_EQ(flags, unsigned(cuda::kBadPosition | cuda::kBadBatchIndex));
  // A table whose last_page_len says more tokens than the sequence's one page holds:
  // position 16 passes the bound of 17 it gives, and page 16 / 16 = 1 of sequence 0 is
  // sequence 1's first page.
  RaggedTable bad = tab;
  bad.last[0] = 17;
  const std::vector<std::int32_t> b0 = {0}, p16 = {16};
  flags = 0;
  cuda::AppendArgs<P, half_t> a0{{pool.data(), tab.num_pages, layout}, bad.host(), rows.data(), rows.data(), 1,
                                 b0.data(), p16.data(), rot.host(), &flags};
  emu_append(a0, 2, 2);
  EXPECT_EQ(flags, unsigned(cuda::kBadPageTable));
  // A table whose num_indices ends before sequence 1's last page: position 19 (its second
  // page) is flagged and not written, although indptr and last_page_len are consistent.
  const std::vector<std::int32_t> b1 = {1}, p19 = {19};
  flags = 0;
  cuda::AppendArgs<P, half_t> a1{{pool.data(), tab.num_pages, layout}, tab.host(), rows.data(), rows.data(), 1,
                                 b1.data(), p19.data(), rot.host(), &flags};
  a1.table.num_indices = tab.indptr.back() - 1;
  emu_append(a1, 2, 2);
  EXPECT_EQ(flags, unsigned(cuda::kBadPageTable));
  EXPECT_TRUE(std::all_of(pool.begin(), pool.end(), [](std::byte x) { return x == std::byte{0xA5}; }));
}

// An append addressed by a slot_mapping (vLLM's convention) writes the bytes of the one
// addressed by (batch index, position); padding tokens (slot −1) write nothing, and a slot
// past the pool is skipped and reported (kBadPage). Both warp splits of the append.
TEST(CudaEmulated, AppendBySlotMappingWritesWhatPositionsWrite) {
  constexpr Policy P = presets::K4V2_HC.with_head_dim(128);
  constexpr int D = P.head_dim, hkv = 2, extra = 3;
  const RaggedTable tab = make_table({1, 37, 0, 70}, 16, 31);
  const PageLayout<P> layout{16, hkv};
  const TokenList tok = all_tokens(tab, 32);
  const int n = tok.size();
  // Rows [extra + n, Hkv, D]: two padding tokens and one past the pool, then the real ones.
  const auto keys = convert<half_t>(outlier_channels(extra + n, hkv, D, 33));
  const auto values = convert<half_t>(random_normal(std::size_t(extra + n) * hkv * D, 34, 1.5f));
  std::vector<std::int64_t> slots = {-1, std::int64_t(tab.num_pages) * tab.page_size + 5, -7};
  for (const std::int64_t s : slot_mapping(tab, tok)) slots.push_back(s);
  Rotations rot;
  make_rotations_host<P>(rot, hkv, 35);
  std::vector<std::byte> ref(layout.page_bytes() * tab.num_pages, std::byte{0xA5});
  const std::size_t skip = std::size_t(extra) * hkv * D;
  ASSERT_TRUE((append_kv<P, half_t>(PagedCacheView<P>{ref.data(), tab.num_pages, layout}, tab.host(),
                                    keys.data() + skip, values.data() + skip, n, tok.batch.data(), tok.pos.data(),
                                    rot.host()))
                  .ok());
  for (const int parts : {1, 2}) {
    std::vector<std::byte> got(ref.size(), std::byte{0xA5});
    unsigned flags = 0;
    cuda::AppendArgs<P, half_t> a;
    a.cache = {got.data(), tab.num_pages, layout};
    a.keys = keys.data(), a.values = values.data();
    a.num_tokens = extra + n;
    a.rotation = rot.host();
    a.error_flags = &flags;
    a.slot_mapping = slots.data();
    ASSERT_TRUE(cuda::validate(a).ok()) << "no table, batch indices or positions are needed";
    emu_append(a, hkv, parts);
    EXPECT_EQ(flags, unsigned(cuda::kBadPage)) << "parts " << parts;
    const auto diff = std::mismatch(got.begin(), got.end(), ref.begin());
    EXPECT_TRUE(diff.first == got.end()) << "parts " << parts << ": first differing byte "
                                         << (diff.first - got.begin()) << " of " << got.size();
  }
}

TEST(CudaEmulated, AppendDequantizeRotate_K4V2_HC_d128_half) {
  check_rows<presets::K4V2_HC.with_head_dim(128), half_t>(2, 16, {1, 37, 0, 70}, 1);
}
TEST(CudaEmulated, AppendDequantizeRotate_K2V2_R_d64_float) {
  check_rows<presets::K2V2_R.with_head_dim(64), float>(2, 32, {50, 3}, 2);
}
// The launcher splits a token·head's key and value rows over two warps below
// kAppendSplitBelow token·heads (the cases above); at and above it one warp does both.
TEST(CudaEmulated, AppendDequantizeRotate_OneWarpPerTokenHead) {
  static_assert(cuda::append_parts(cuda::kAppendSplitBelow, 1) == 1 && cuda::append_parts(100, 8) == 2);
  check_rows<presets::K4V2_HC.with_head_dim(128), half_t>(2, 16, {1, 37, 0, 70}, 1, 1);
  check_rows<presets::K2V2_R.with_head_dim(64), float>(2, 32, {50, 3}, 2, 1);
}
TEST(CudaEmulated, AppendDequantizeRotate_K8V8_H_bf16meta_d256_bf16) {
  constexpr Policy P = [] {
    Policy p = presets::K8V8_H.with_head_dim(256).with_meta(MetaType::bf16);
    p.value.centered = true;
    p.key.sign_seed = 1234;
    return p;
  }();
  check_rows<P, bfloat16_t>(1, 16, {20}, 3);
}

TEST(CudaEmulated, Decode_K4V2_HC_d128_half) {
  std::uint32_t seed = 10;
  for (const auto& c : cases()) check_decode<presets::K4V2_HC.with_head_dim(128), half_t>(c, seed++);
}
TEST(CudaEmulated, Decode_K2V2_R_fp32meta_d64_float) {
  constexpr Policy P = presets::K2V2_R.with_head_dim(64).with_meta(MetaType::fp32);
  std::uint32_t seed = 20;
  for (const auto& c : cases()) check_decode<P, float>(c, seed++);
}
TEST(CudaEmulated, Decode_K8V4_H_d256_bf16) {
  constexpr Policy P = [] {
    Policy p = presets::K8V8_H.with_head_dim(256);
    p.value.bits = 4;
    p.value.group = 64;
    p.value.centered = true;
    return p;
  }();
  std::uint32_t seed = 30;
  for (const auto& c : cases()) check_decode<P, bfloat16_t>(c, seed++);
}
// The tensor-core kernel, exact mode: its split operands keep fp32 accuracy, so it meets
// the same 1e-5 bound. fp16, fp32 and bf16 metadata; head_dim 64, 128, 256; key runs of
// 16 bits (K2, group 32) and whole words; the later policies run the cases with several
// rows, tiles and splits.
TEST(CudaEmulated, DecodeTensorCore_K4V2_HC_d128_half) {
  std::uint32_t seed = 60;
  for (const auto& c : cases())
    check_decode<presets::K4V2_HC.with_head_dim(128), half_t>(c, seed++, {.kernel = kTensorCore});
}
TEST(CudaEmulated, DecodeTensorCore_K2V2_R_fp32meta_d64_float) {
  constexpr Policy P = presets::K2V2_R.with_head_dim(64).with_meta(MetaType::fp32);
  std::uint32_t seed = 70;
  for (std::size_t i = 3; i < cases().size(); ++i) check_decode<P, float>(cases()[i], seed++, {.kernel = kTensorCore});
}
TEST(CudaEmulated, DecodeTensorCore_K8V4_H_bf16meta_d64_bf16) {
  constexpr Policy P = [] {
    Policy p = presets::K8V8_H.with_head_dim(64).with_meta(MetaType::bf16);
    p.value.bits = 4;
    p.value.group = 32;
    p.value.centered = true;
    return p;
  }();
  std::uint32_t seed = 80;
  for (std::size_t i = 3; i < cases().size(); ++i)
    check_decode<P, bfloat16_t>(cases()[i], seed++, {.kernel = kTensorCore});
}
TEST(CudaEmulated, DecodeTensorCore_K2V4_HC_d256_half) {
  constexpr Policy P = presets::K2V4_HC.with_head_dim(256);
  std::uint32_t seed = 85;
  for (std::size_t i = 4; i < cases().size(); ++i) check_decode<P, half_t>(cases()[i], seed++, {.kernel = kTensorCore});
}
// A NaN logit (a key group stored as NaN) poisons exactly the rows that see it, as on the
// CPU: output and LSE NaN, also when it is the only visible logit of its tile and split
// (sequence 0; fmaxf would drop it and report an empty row) and when the other split of
// the row is empty. A NaN value group reaches the rows that give it weight, not the row
// that cannot see it. Both kernels, with and without split-KV.
TEST(CudaEmulated, NaNLogitsAndValueGroupsPoisonTheRowsThatSeeThem) {
  // Causal: the last query token of a sequence sees every token, the one before it all
  // but the last; tokens 39 of sequence 1 and 49 of sequence 3 are seen by one of two.
  NanTokens nan;
  nan.keys = {{0, 0}, {1, 39}};
  nan.values = {{3, 49}};
  constexpr Policy P = presets::K4V2_HC.with_head_dim(128);
  using enum cuda::DecodeKernel;
  using enum cuda::DecodePrecision;
  for (const int splits : {1, 2})
    for (const auto& [kernel, precision] : {std::pair{simt, exact}, {tensor_core, exact}, {tensor_core, fast}})
      for (const int page : {16, 24, 64}) {  // staging by two page runs per tile, per token, one page
        const Case c{1, 4, page, {1, 40, 70, 50}, {1, 2, 1, 2}, splits, false, false};
        int nan_rows = 0;
        check_decode<P, half_t>(c, 95, {.kernel = kernel, .precision = precision, .nan = nan, .nan_rows = &nan_rows});
        EXPECT_EQ(nan_rows, 4 * 3) << "splits " << splits << ", page " << page;  // 4 query heads × (seq 0,
                                                                                 // seq 1's second, seq 3's second)
      }
}
// Logits below −FLT_MAX are −∞ in the CPU reference, so their tokens take no weight. The
// tensor-core kernel keeps its logits scaled by 2^-24 (the codes are subnormals), so such a
// logit is finite there until the softmax scales it back: a row whose first tile has only
// such logits and whose later tiles are finite must still match the reference (warp 0
// streams tokens 0–31 first; q = 1e36 on fp32 keys of −50 gives ≈ −5.8e38).
TEST(CudaEmulated, LogitsBelowFloatRangeTakeNoWeight) {
  constexpr Policy P = presets::K2V2_R.with_head_dim(64).with_meta(MetaType::fp32);
  constexpr int D = P.head_dim;
  using enum cuda::DecodeKernel;
  using enum cuda::DecodePrecision;
  const Case c{1, 1, 32, {200}, {1}, 1, false, false};
  const RaggedTable tab = make_table(c.lens, c.page_size, 1);
  const PageLayout<P> layout{c.page_size, c.hkv};
  std::vector<std::byte> pool(layout.page_bytes() * tab.num_pages, std::byte{0});
  const TokenList tok = all_tokens(tab, 2);
  auto kf = random_normal(std::size_t(tok.size()) * D, 3, 1.f);
  for (int i = 0; i < tok.size(); ++i)
    if (tok.pos[i] < 32) std::fill_n(kf.begin() + std::size_t(i) * D, D, -50.f);
  const auto values = random_normal(std::size_t(tok.size()) * D, 4, 1.5f);
  Rotations rot;
  make_rotations_host<P>(rot, c.hkv, 5);
  ASSERT_TRUE((append_kv<P, float>(PagedCacheView<P>{pool.data(), tab.num_pages, layout}, tab.host(), kf.data(),
                                   values.data(), tok.size(), tok.batch.data(), tok.pos.data(), rot.host()))
                  .ok());
  const QueryRun qs = queries(c);
  const std::vector<float> q(D, 1e36f);
  std::vector<float> ref(D), lse_ref(1);
  const DecodeParams<float, float> hp{q.data(), qs.indptr.data(), 1, nullptr, 0.f, false, ref.data(), lse_ref.data()};
  ASSERT_TRUE(decode_attention<P>(ConstPagedCacheView<P>{pool.data(), tab.num_pages, layout}, tab.host(), hp, rot.host()).ok());
  ASSERT_TRUE(std::isfinite(lse_ref[0]));
  for (const auto& [kernel, precision] : {std::pair{simt, exact}, {tensor_core, exact}, {tensor_core, fast}}) {
    std::vector<float> out(D, std::nanf("")), lse(1, std::nanf(""));
    cuda::DecodeArgs<P, float, float> a;
    a.cache = {pool.data(), tab.num_pages, layout};
    a.table = tab.host();
    a.params = {q.data(), qs.indptr.data(), 1, nullptr, 0.f, false, out.data(), lse.data()};
    a.rotation = rot.host();
    a.total_q = qs.total;
    a.max_q_per_seq = qs.max_q;
    a.num_splits = 1;
    a.kernel = kernel;
    a.precision = precision;
    std::vector<uint4> ws;
    cuda::DecodePlan plan;
    unsigned flags = 0;
    ASSERT_NO_FATAL_FAILURE(emulate_decode(a, ws, plan, flags));
    EXPECT_EQ(flags, 0u);
    const std::string what = std::string(kernel == simt ? "CUDA-core" : "tensor-core") + (precision == fast ? " fast" : "");
    EXPECT_LE(row_error(out.data(), ref.data(), D), 1e-3) << what;
    EXPECT_NEAR(lse[0], lse_ref[0], 1e-3 * std::abs(lse_ref[0])) << what;
  }
}
// A page index outside the pool is skipped (its tokens take no part, as if the page were
// not in the table) and flagged, by both kernels and every staging path: pages of 64 (one
// page per warp tile), of 16 (two per tile: the first or the second page of a whole tile
// bad, the first of a last tile of 26 tokens, the only page of a 1-token sequence) and of
// 24 (per token).
TEST(CudaEmulated, BadPageIndexIsSkippedAndFlagged) {
  constexpr Policy P = presets::K4V2_HC.with_head_dim(128);
  const std::pair<std::size_t, int> bad[] = {{2, 0}, {8, 0}, {8, 5}, {8, 14}, {0, 0}, {6, 1}};
  for (const auto kernel : {cuda::DecodeKernel::simt, cuda::DecodeKernel::tensor_core})
    for (const auto& [i, page] : bad)
      check_decode<P, half_t>(cases()[i], 140 + static_cast<std::uint32_t>(i), {.kernel = kernel, .bad_page = page});
}
// Tables in device memory are checked where the kernels read them, and what they flag
// is defined: a last_page_len past the page size makes the sequence empty (its rows see
// no key: o = 0, lse −∞), a q_indptr run past total_q leaves that sequence's rows
// unwritten (q and out are never read or written outside their rows), and rows past
// the grid that max_q_per_seq sized are not computed; every other row is the
// reference's. An empty sequence padded with last_page_len = page_size is not flagged.
// Both kernels, with and without splits.
TEST(CudaEmulated, BadTablesAndQueryRunsAreFlagged) {
  constexpr Policy P = presets::K4V2_HC.with_head_dim(128);
  const Case c{2, 4, 16, {40, 77, 0, 129}, {1, 2, 1, 3}, 1, false, false};
  Case split = c;
  split.splits = 3;
  for (const auto kernel : {cuda::DecodeKernel::simt, cuda::DecodeKernel::tensor_core}) {
    check_decode<P, half_t>(c, 150, {.kernel = kernel, .bad_table_seq = 1});
    check_decode<P, half_t>(split, 151, {.kernel = kernel, .bad_table_seq = 3});
    check_decode<P, half_t>(split, 157, {.kernel = kernel, .bad_table_seq = 3, .short_indices = true});
    check_decode<P, half_t>(c, 152, {.kernel = kernel, .bad_q_indptr = true});
    check_decode<P, half_t>(c, 153, {.kernel = kernel, .max_q_per_seq = 1});  // runs of 2 and 3 tokens
    check_decode<P, half_t>(split, 155, {.kernel = kernel, .padded_empty = true});  // sequence 2: no flag
    // With splits, either merge (in the kernel, or the CUDA-core kernel's own launch)
    // leaves the rows the grid skipped unwritten too.
    check_decode<P, half_t>(split, 154, {.kernel = kernel, .bad_q_indptr = true});
    check_decode<P, half_t>(split, 156, {.kernel = kernel, .max_q_per_seq = 2});  // the run of 3 tokens
  }
}
// One workspace, zeroed once, serves decode calls of every shape and of both kernels, as
// an engine's does from step to step: the tensor-core kernel's arrival counters keep
// their place at the start of the workspace while the partials' size follows total_q·Hq·S.
// (When the counters followed the partials, the second call below found them among the
// first call's partial floats and never merged its splits.)
TEST(CudaEmulated, OneWorkspaceServesDecodesOfEveryShape) {
  constexpr Policy P = presets::K4V2_HC.with_head_dim(128);
  std::vector<uint4> ws((std::size_t(4) << 20) / 16, uint4{0u, 0u, 0u, 0u});  // 4 MiB, zeroed once
  const Case big{2, 4, 16, {300, 129, 37, 250, 64}, {3, 3, 3, 3, 3}, 8, false, false};
  const Case small{2, 4, 16, {100, 40}, {1, 1}, 3, false, false};
  const Case other{2, 4, 16, {70, 33, 200}, {2, 1, 1}, 5, false, false};
  using enum cuda::DecodeKernel;
  check_decode<P, half_t>(big, 160, {.kernel = tensor_core, .workspace = &ws});
  check_decode<P, half_t>(small, 161, {.kernel = tensor_core, .workspace = &ws});
  check_decode<P, half_t>(big, 162, {.kernel = simt, .workspace = &ws});
  check_decode<P, half_t>(other, 163, {.kernel = tensor_core, .workspace = &ws});
  check_decode<P, half_t>(small, 164, {.kernel = tensor_core, .workspace = &ws});
}
// DecodePrecision::fast (one fp16 operand per product) stays within the bound stated in
// kernel/decode_mma.cuh against fp64 attention over the dequantized cache: quantized
// pages (fp16 and fp32 outputs, d 128 and 64, one to several rows, tiles and splits) and
// fp16 pages. The largest error/bound ratio is printed: a bound loose by orders of
// magnitude would show there.
TEST(CudaEmulated, DecodeTensorCoreFastWithinItsStatedBound) {
  constexpr auto kFast = cuda::DecodePrecision::fast;
  double ratio[4] = {};
  std::uint32_t seed = 110;
  for (const auto& c : cases())
    check_decode<presets::K4V2_HC.with_head_dim(128), half_t>(c, seed++,
                                                              {.kernel = kTensorCore, .precision = kFast, .bound_ratio = &ratio[0]});
  for (std::size_t i = 3; i < cases().size(); ++i)
    check_decode<presets::K2V2_R.with_head_dim(64), float>(cases()[i], seed++,
                                                           {.kernel = kTensorCore, .precision = kFast, .bound_ratio = &ratio[1]});
  for (std::size_t i = 3; i < cases().size(); ++i)
    check_dense<half_t, 64>(cases()[i], seed++, {.kernel = kTensorCore, .precision = kFast, .bound_ratio = &ratio[2]});
  for (std::size_t i = 4; i < cases().size(); ++i)
    check_dense<bfloat16_t, 128>(cases()[i], seed++, {.kernel = kTensorCore, .precision = kFast, .bound_ratio = &ratio[3]});
  std::printf("fast tensor-core decode, largest error / stated bound: K4V2_HC half %.3g, K2V2_R float %.3g, "
              "fp16 pages %.3g, bf16 pages %.3g\n", ratio[0], ratio[1], ratio[2], ratio[3]);
  for (double r : ratio) EXPECT_GT(r, 0.0);  // the bound was evaluated on rows with rounding error
}
// The tensor-core kernel with pipelines other than the default (kern::MmaPipeline, for the
// benchmark sweeps of cuda::tuning): 1, 2 and 4 warps, 2 to 4 stages, quantized and fp16
// pages, both precisions, against the same references.
TEST(CudaEmulated, DecodeTensorCorePipelines) {
  constexpr auto kFast = cuda::DecodePrecision::fast;
  constexpr Policy P = presets::K4V2_HC.with_head_dim(128);
  std::uint32_t seed = 150;
  auto each = [&]<class Pipeline>() {
    for (std::size_t i = 3; i < cases().size(); ++i) {
      check_decode<P, half_t, Pipeline>(cases()[i], seed++, {.kernel = kTensorCore});
      check_dense<half_t, 128, Pipeline>(cases()[i], seed++, {.kernel = kTensorCore});
      check_dense<half_t, 128, Pipeline>(cases()[i], seed++, {.kernel = kTensorCore, .precision = kFast});
    }
  };
  each.template operator()<kern::MmaPipeline<1, 4>>();
  each.template operator()<kern::MmaPipeline<2, 3>>();
  each.template operator()<kern::MmaPipeline<4, 2>>();
}
TEST(CudaEmulated, DenseDecode_half_d128) {
  std::uint32_t seed = 40;
  for (const auto& c : cases()) check_dense<half_t, 128>(c, seed++);
}
TEST(CudaEmulated, DenseDecode_float_d64) {
  std::uint32_t seed = 50;
  for (const auto& c : cases()) check_dense<float, 64>(c, seed++);
}

TEST(CudaEmulated, DenseDecodeTensorCore_half_d64) {
  std::uint32_t seed = 90;
  for (std::size_t i = 3; i < cases().size(); ++i)
    check_dense<half_t, 64>(cases()[i], seed++, {.kernel = kTensorCore});
}
TEST(CudaEmulated, DenseDecodeTensorCore_bf16_d128) {  // bf16 operands, exact = hi + mid + lo
  std::uint32_t seed = 95;
  for (std::size_t i = 3; i < cases().size(); ++i)
    check_dense<bfloat16_t, 128>(cases()[i], seed++, {.kernel = kTensorCore});
}
TEST(CudaEmulated, DenseDecodeTensorCore_half_d256) {
  std::uint32_t seed = 98;
  for (std::size_t i = 4; i < cases().size(); ++i)
    check_dense<half_t, 256>(cases()[i], seed++, {.kernel = kTensorCore});
}
TEST(CudaEmulated, MergeStates) {
  constexpr int rows = 9, D = 64;
  auto o1 = random_normal(rows * D, 1), o2 = random_normal(rows * D, 2), l1 = random_normal(rows, 3, 3.f), l2 = random_normal(rows, 4, 3.f);
  l1[0] = l2[1] = l1[2] = l2[2] = -std::numeric_limits<float>::infinity();
  std::vector<float> ref(rows * D), lref(rows), out(rows * D), lout(rows);
  merge_states(o1.data(), l1.data(), o2.data(), l2.data(), rows, D, ref.data(), lref.data());
  const float *p1 = o1.data(), *p2 = o2.data(), *q1 = l1.data(), *q2 = l2.data();
  float *po = out.data(), *pl = lout.data();
  kvq_emu::launch(to_dim3(cuda::row_grid(rows)), dim3(128),
                  [&] { kern::merge_states_kernel<float>(p1, q1, p2, q2, rows, D, po, pl); });
  for (int i = 0; i < rows * D; ++i) EXPECT_NEAR(out[i], ref[i], 1e-6f * (1 + std::abs(ref[i])));
  for (int r = 0; r < rows; ++r) EXPECT_EQ(lout[r], lref[r]);
}

}  // namespace
