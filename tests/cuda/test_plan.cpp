// Host-only tests of the CUDA launch arithmetic and argument validation
// (kvq/cuda/launch/{plan,api}.hpp). Plain C++: they run on machines without a GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <set>
#include <vector>

#include "kvq/cuda/launch/api.hpp"
#include "kvq/cuda/launch/dispatch.hpp"
#include "kvq/cuda/launch/plan.hpp"
#include "kvq/cuda/traits/decode_smem.hpp"
#include "kvq/cuda/traits/geometry.hpp"

namespace {

using namespace kvq;
using namespace kvq::cuda;

TEST(CudaPlan, RowsPerCta) {
  // GQA 8, one query: 8 rows; GQA 1: the smallest option; large runs cap by head_dim.
  EXPECT_EQ(choose_rows_per_cta(128, 8, 1), 8);
  EXPECT_EQ(choose_rows_per_cta(128, 1, 1), 4);
  EXPECT_EQ(choose_rows_per_cta(128, 4, 1), 4);
  EXPECT_EQ(choose_rows_per_cta(128, 4, 3), 16);
  EXPECT_EQ(choose_rows_per_cta(128, 8, 100), 16);
  EXPECT_EQ(choose_rows_per_cta(256, 8, 4), 8);  // D = 256 caps at 8 rows
  EXPECT_EQ(choose_rows_per_cta(64, 16, 2), 16);
  for (int d : {64, 128, 256})
    for (int r : kRowOptions) {
      if (r > max_rows_per_cta(d)) continue;
      const int vd = value_dims_per_lane(d, r);
      EXPECT_LE(r * vd, 64) << d << " " << r;  // accumulator registers per lane
      EXPECT_GE(vd, d / 32);
      EXPECT_EQ(32 % (d / vd), 0);  // value lanes tile the warp
    }
}

TEST(CudaPlan, SplitChunksCoverEveryTokenOnce) {
  for (int len : {0, 1, 31, 32, 33, 100, 1000, 4096, 4097}) {
    for (int s : {1, 2, 3, 7, 8, 64}) {
      std::vector<int> hits(len, 0);
      for (int k = 0; k < s; ++k) {
        const int b = split_begin(len, s, k), e = split_end(len, s, k);
        ASSERT_LE(b, e);
        if (b < e) {
          EXPECT_EQ(b % kWarpTokens, 0);  // splits start on warp tiles
        }
        for (int t = b; t < e; ++t) ++hits[t];
      }
      for (int t = 0; t < len; ++t) ASSERT_EQ(hits[t], 1) << "len " << len << " splits " << s << " token " << t;
    }
  }
}

TEST(CudaPlan, SharedMemoryLayout) {
  const DecodeSmem s{64, 16, 32, 4, 128, 8, 4, decode_warps(116)};
  EXPECT_EQ(s.warps, 4);
  for (std::size_t off : {s.km_off(), s.vc_off(), s.vm_off(), s.stage_bytes(), s.p_off(0), s.q_off(), s.qsum_off(),
                          s.shift_off(), s.limit_off(), s.total()})
    EXPECT_EQ(off % 16, 0u);
  EXPECT_GE(s.km_off(), 64u * 32);
  EXPECT_GE(s.vc_off() - s.km_off(), 16u * 32);
  EXPECT_GE(s.p_off(0), s.staging_bytes());
  EXPECT_GE(s.p_off(0), s.merge_bytes());
  EXPECT_EQ(s.q_off() - s.p_off(0), 4u * 32 * 8 * 4);
  EXPECT_LE(s.total(), 48u * 1024);  // K4V2 at d = 128 needs no opt-in
  // Without the per-warp p buffers (the tensor-core kernel) q' follows the loop's bytes.
  DecodeSmem no_p = s;
  no_p.warp_weights = false;
  EXPECT_EQ(no_p.q_off(), s.p_off(0));
  EXPECT_EQ(s.total() - no_p.total(), 4u * 32 * 8 * 4);
  // Big rows drop to fewer warps so that the double-buffered staging stays ≤ 64 KiB.
  EXPECT_EQ(decode_warps(512), 2);   // fp16 d = 128 baseline
  EXPECT_EQ(decode_warps(1024), 1);  // fp32 d = 128
  EXPECT_EQ(decode_warps(72), 4);    // K2V2 d = 128
}

TEST(CudaPlan, DecodePlanGridAndWorkspace) {
  DecodePlan plan;
  DecodeShape s{/*batch*/ 3, /*hkv*/ 2, /*hq*/ 16, /*total_q*/ 5, /*max_q*/ 3, /*splits*/ 1, 128};
  ASSERT_TRUE(make_decode_plan(s, plan).ok());
  EXPECT_EQ(plan.rows, 16);
  EXPECT_EQ(plan.row_tiles, 2);  // 3 tokens × 8 heads = 24 rows
  EXPECT_EQ(plan.grid.x, 6u);
  EXPECT_EQ(plan.grid.y, 2u);
  EXPECT_EQ(plan.grid.z, 1u);
  EXPECT_EQ(plan.workspace_bytes(), 0u);
  s.num_splits = 4;
  ASSERT_TRUE(make_decode_plan(s, plan).ok());
  // The counters' region comes first and has one size whatever the shape (both kernels
  // keep their partials clear of it, so one workspace serves every call).
  EXPECT_EQ(plan.counter_bytes, kSplitCounterBytes);
  EXPECT_EQ(plan.partial_o_bytes, align_up(4u * 5 * 16 * 128 * 4, 256));
  EXPECT_EQ(plan.partial_lse_bytes, align_up(4u * 5 * 16 * 4, 256));
  EXPECT_EQ(plan.workspace_bytes(), kSplitCounterBytes + plan.partial_o_bytes + plan.partial_lse_bytes);
  EXPECT_EQ(plan.merge_grid.x, (5u * 16 + 3) / 4);
  // A bound on the query run looser than total_q adds no row tiles (and cannot overflow).
  s.max_q_per_seq = 1 << 30;
  ASSERT_TRUE(make_decode_plan(s, plan).ok());
  EXPECT_EQ(plan.row_tiles, 3);  // at most 5 tokens × 8 heads = 40 rows, in tiles of 16
  s.max_q_per_seq = 3;
  s.kernel = static_cast<DecodeKernel>(3);  // e.g. parsed from a config
  EXPECT_EQ(make_decode_plan(s, plan).code(), StatusCode::invalid_argument);
  s.kernel = DecodeKernel::automatic;
  s.batch = 1 << 30;  // batch × row tiles past the grid's 2^31
  EXPECT_EQ(make_decode_plan(s, plan).code(), StatusCode::invalid_argument);
  s.batch = 3;
  s.num_qo_heads = 3;
  EXPECT_EQ(make_decode_plan(s, plan).code(), StatusCode::invalid_argument);
  s.num_qo_heads = 16;
  s.head_dim = 96;
  EXPECT_EQ(make_decode_plan(s, plan).code(), StatusCode::unsupported);
  s.head_dim = 128;
  s.num_splits = 0;
  EXPECT_FALSE(make_decode_plan(s, plan).ok());
}

TEST(CudaPlan, TensorCoreKernelChoice) {
  DecodePlan plan;
  DecodeShape s{/*batch*/ 2, /*hkv*/ 4, /*hq*/ 16, /*total_q*/ 2, /*max_q*/ 1, /*splits*/ 1, 128};
  ASSERT_TRUE(make_decode_plan(s, plan).ok());
  EXPECT_EQ(plan.kernel, DecodeKernel::simt);  // automatic, and the cache type has no tensor-core kernel
  EXPECT_EQ(plan.rows, 4);
  s.tensor_core_ok = true;
  ASSERT_TRUE(make_decode_plan(s, plan).ok());
  EXPECT_EQ(plan.kernel, DecodeKernel::tensor_core);  // automatic picks it where it exists
  s.kernel = DecodeKernel::simt;
  ASSERT_TRUE(make_decode_plan(s, plan).ok());
  EXPECT_EQ(plan.kernel, DecodeKernel::simt);
  s.tensor_core_ok = false;
  s.kernel = DecodeKernel::tensor_core;
  EXPECT_EQ(make_decode_plan(s, plan).code(), StatusCode::unsupported);  // cache type not served
  s.tensor_core_ok = true;
  ASSERT_TRUE(make_decode_plan(s, plan).ok());
  EXPECT_EQ(plan.kernel, DecodeKernel::tensor_core);
  EXPECT_EQ(plan.rows, kMmaRows);
  EXPECT_EQ(plan.row_tiles, 1);
  // A device that runs the kernel from code below compute_80 (the launchers ask): refused
  // when asked for, the CUDA-core kernel under `automatic`, with the same workspace.
  s.tensor_core_runs = false;
  const Status refused = make_decode_plan(s, plan);
  EXPECT_EQ(refused.code(), StatusCode::unsupported);
  EXPECT_NE(refused.message().find("sm_80"), std::string::npos) << refused.message();
  s.kernel = DecodeKernel::automatic;
  s.num_splits = 3;
  ASSERT_TRUE(make_decode_plan(s, plan).ok());
  EXPECT_EQ(plan.kernel, DecodeKernel::simt);
  EXPECT_EQ(plan.rows, 4);
  EXPECT_GT(plan.merge_grid.x, 0u);  // the CUDA-core kernel's splits go through the merge kernel
  const std::size_t simt_workspace = plan.workspace_bytes();
  s.tensor_core_runs = true;
  ASSERT_TRUE(make_decode_plan(s, plan).ok());
  EXPECT_EQ(plan.kernel, DecodeKernel::tensor_core);
  EXPECT_EQ(plan.workspace_bytes(), simt_workspace);
  s.kernel = DecodeKernel::tensor_core;
  s.num_splits = 1;
  s.max_q_per_seq = 5;  // 5 tokens × 4 heads = 20 rows: three n8 tiles
  s.total_q = 10;
  ASSERT_TRUE(make_decode_plan(s, plan).ok());
  EXPECT_EQ(plan.row_tiles, 3);
  EXPECT_EQ(plan.grid.x, 6u);
  // The in-kernel merge has kSplitCounters arrival counters: more tiles with splits are
  // refused, or left to the CUDA-core kernel by `automatic` (suggest_num_splits never
  // splits such grids).
  s.num_splits = 2;
  s.max_q_per_seq = 1, s.total_q = 1 << 16, s.batch = 1 << 16;  // × 4 KV heads
  EXPECT_EQ(make_decode_plan(s, plan).code(), StatusCode::invalid_argument);
  s.kernel = DecodeKernel::automatic;
  ASSERT_TRUE(make_decode_plan(s, plan).ok());
  EXPECT_EQ(plan.kernel, DecodeKernel::simt);
  s.batch = 1 << 30, s.max_q_per_seq = 1 << 30, s.total_q = 1 << 30;  // no overflow on the way
  EXPECT_FALSE(make_decode_plan(s, plan).ok());
  s.kernel = DecodeKernel::tensor_core;
  EXPECT_EQ(make_decode_plan(s, plan).code(), StatusCode::invalid_argument);
  s.batch = 1 << 16, s.max_q_per_seq = 1, s.total_q = 1 << 16;
  s.num_kv_heads = 1, s.num_qo_heads = 4;
  ASSERT_TRUE(make_decode_plan(s, plan).ok());  // exactly kSplitCounters tiles
  EXPECT_EQ(plan.kernel, DecodeKernel::tensor_core);
  EXPECT_EQ(suggest_num_splits(1 << 16, 1, 1, 32768, 132, 256, 16), 1);
  // Which policies the kernel serves.
  static_assert(DecodeArgs<presets::K2V2_HC, half_t, half_t>::kTensorCoreOk);
  static_assert(DecodeArgs<presets::K4V2.with_head_dim(64), float, float>::kTensorCoreOk);
  static_assert(DecodeArgs<presets::K4V2.with_head_dim(256), half_t, half_t>::kTensorCoreOk);
  static_assert(DecodeArgs<presets::K4V2.with_meta(MetaType::bf16), half_t, half_t>::kTensorCoreOk);
  constexpr Policy kSmallValueGroups = [] {  // a lane's eighth of a 2-bit group of 32 is 8 bits
    Policy p = presets::K2V2;
    p.value.group = 32;
    return p;
  }();
  static_assert(!DecodeArgs<kSmallValueGroups, half_t, half_t>::kTensorCoreOk);
  constexpr Policy kSmallKeyGroups = [] {  // a lane's quarter of a 2-bit group of 16 is 8 bits
    Policy p = presets::K2V2;
    p.key.group = 16;
    return p;
  }();
  static_assert(!DecodeArgs<kSmallKeyGroups, half_t, half_t>::kTensorCoreOk);
  static_assert(DenseDecodeArgs<half_t, 64, float, float>::kTensorCoreOk);  // fp16 pages, any query type
  static_assert(DenseDecodeArgs<bfloat16_t, 128, bfloat16_t, bfloat16_t>::kTensorCoreOk);
  static_assert(DenseDecodeArgs<half_t, 256, half_t, half_t>::kTensorCoreOk);
  static_assert(!DenseDecodeArgs<float, 128, float, float>::kTensorCoreOk);
}

TEST(CudaPlan, SuggestSplits) {
  // Few CTAs on a big GPU → split up to ~85% of the best wave efficiency, never below
  // min_tokens_per_split keys each: 8 CTAs × 14 = 112 of 132 SMs (16 splits: 128).
  EXPECT_EQ(suggest_num_splits(1, 8, 1, 4096, 132), 14);
  EXPECT_EQ(suggest_num_splits(1, 8, 1, 1024, 132), 4);  // capped by 256 keys per split
  EXPECT_EQ(suggest_num_splits(64, 8, 1, 32768, 132), 1);  // 512 CTAs fill the waves
  EXPECT_EQ(suggest_num_splits(1, 1, 1, 1 << 20, 132), 113);
  EXPECT_EQ(suggest_num_splits(0, 8, 1, 4096, 132), 1);
  // Two resident CTAs per SM double the wave: 1×32K takes 29 splits (232 of 264 slots),
  // 16×32K two (256 of 264), where one would leave half the wave idle.
  EXPECT_EQ(suggest_num_splits(1, 8, 1, 32768, 132, 256, 2), 29);
  EXPECT_EQ(suggest_num_splits(16, 8, 1, 32768, 132, 256, 2), 2);
  EXPECT_EQ(suggest_num_splits(16, 8, 1, 32768, 132, 256, 1), 1);  // 128 of 132: no split
  // More than a wave: 512 CTAs on 396 slots fill 1.3 waves (65%); 2 splits fill 86%.
  EXPECT_EQ(suggest_num_splits(64, 8, 1, 32768, 132, 256, 3), 2);
  EXPECT_EQ(suggest_num_splits(64, 8, 1, 32768, 132, 256, 4), 1);  // 512 of 528
  EXPECT_EQ(suggest_num_splits(64, 8, 1, 256, 132, 256, 3), 1);    // no keys to split
}

TEST(CudaPlan, RowGrid) {
  EXPECT_EQ(row_grid(1).x, 1u);
  EXPECT_EQ(row_grid(4).x, 1u);
  EXPECT_EQ(row_grid(5).x, 2u);
}

// ---- validation ---------------------------------------------------------------------

constexpr Policy kP = presets::K4V2;
constexpr Policy kPC = presets::K4V2_HC;  // centered keys
constexpr Policy kPR = presets::K4V2_R;   // dense rotations

alignas(256) std::byte g_pool[4096];
std::int32_t g_indptr[3] = {0, 1, 2}, g_indices[2] = {0, 1}, g_last[2] = {3, 5};
std::int32_t g_ints[8] = {};
half_t g_rows[1024];
float g_floats[1024];

template <Policy P>
PagedCacheView<P> cache() {
  return {g_pool, 2, PageLayout<P>{16, 2}};
}
PageTableView table() { return {g_indptr, g_indices, g_last, 2, 16}; }

TEST(CudaValidate, Append) {
  AppendArgs<kP, half_t> a{cache<kP>(), table(), g_rows, g_rows, 2, g_ints, g_ints, {}, nullptr};
  EXPECT_TRUE(validate(a).ok());
  auto b = a;
  b.keys = nullptr;
  EXPECT_EQ(validate(b).code(), StatusCode::invalid_argument);
  b = a;
  b.num_tokens = -1;
  EXPECT_FALSE(validate(b).ok());
  b = a;
  b.num_tokens = 0;
  b.keys = nullptr;  // nothing to do: nothing checked
  EXPECT_TRUE(validate(b).ok());
  b = a;
  b.table.page_size = 32;
  EXPECT_NE(validate(b).message().find("page_size"), std::string::npos);
  b = a;
  b.cache.pool = g_pool + 4;
  EXPECT_NE(validate(b).message().find("aligned"), std::string::npos);
  b = a;
  b.table.indices = nullptr;
  EXPECT_FALSE(validate(b).ok());
  b = a;
  b.positions = nullptr;
  EXPECT_NE(validate(b).message().find("positions"), std::string::npos);
  // A slot_mapping replaces the table, batch indices and positions.
  const std::int64_t slots[2] = {0, 1};
  b.slot_mapping = slots;
  b.batch_indices = nullptr;
  b.table = {};
  EXPECT_TRUE(validate(b).ok());
  // A misaligned int64 load would be a sticky device fault, not a skipped token.
  b.slot_mapping = reinterpret_cast<const std::int64_t*>(reinterpret_cast<const char*>(slots) + 4);
  EXPECT_NE(validate(b).message().find("slot_mapping must be 8-byte aligned"), std::string::npos);
  b.slot_mapping = slots;
  b.keys = nullptr;
  EXPECT_FALSE(validate(b).ok());

  AppendArgs<kPC, half_t> c{cache<kPC>(), table(), g_rows, g_rows, 2, g_ints, g_ints, {}, nullptr};
  EXPECT_NE(validate(c).message().find("key_mean"), std::string::npos);
  c.rotation.key_mean = g_floats;
  EXPECT_TRUE(validate(c).ok());
  AppendArgs<kPR, float> r{cache<kPR>(), table(), g_floats, g_floats, 2, g_ints, g_ints, {g_floats}, nullptr};
  EXPECT_NE(validate(r).message().find("key_rotation"), std::string::npos);
  r.rotation.key_rotation = r.rotation.value_rotation = g_floats;
  EXPECT_TRUE(validate(r).ok());
}

TEST(CudaValidate, DequantizeAndRotate) {
  DequantizeArgs<kP, float> d{cache<kP>(), table(), 2, g_ints, g_ints, g_floats, g_floats, {}, nullptr};
  EXPECT_TRUE(validate(d).ok());
  d.cache.pool = g_pool + 2;  // the kernel's typed metadata loads would fault
  EXPECT_NE(validate(d).message().find("aligned"), std::string::npos);
  d.cache.pool = g_pool;
  d.values = nullptr;
  EXPECT_FALSE(validate(d).ok());

  RotateArgs<kPR, float> r{g_floats, g_floats, 4, 8, 4, RotateOp::query, {}};
  EXPECT_NE(validate(r).message().find("key_rotation"), std::string::npos);
  r.rotation.key_rotation = g_floats;
  EXPECT_TRUE(validate(r).ok());  // a query rotation needs no means and no R_V
  r.op = RotateOp::output;
  EXPECT_NE(validate(r).message().find("value_rotation"), std::string::npos);
  r.op = RotateOp::key;
  EXPECT_NE(validate(r).message().find("key_mean"), std::string::npos);
  r.heads_per_kv_head = 3;  // 8 heads do not split into KV heads of 3
  EXPECT_NE(validate(r).message().find("multiple"), std::string::npos);
  r.heads_per_kv_head = 0;
  EXPECT_FALSE(validate(r).ok());
}

TEST(CudaValidate, Decode) {
  DecodeArgs<kP, half_t, half_t> a;
  a.cache = cache<kP>();
  a.table = table();
  a.params.q = g_rows;
  a.params.out = g_rows;
  a.params.q_indptr = g_ints;
  a.params.num_qo_heads = 8;
  a.total_q = 2;
  a.max_q_per_seq = 1;
  DecodePlan plan;
  EXPECT_TRUE(validate(a, plan).ok()) << validate(a, plan).to_string();
  EXPECT_EQ(plan.kernel, DecodeKernel::tensor_core);  // automatic, and kP has a tensor-core kernel
  EXPECT_EQ(plan.rows, kMmaRows);
  a.kernel = DecodeKernel::simt;
  EXPECT_TRUE(validate(a, plan).ok()) << validate(a, plan).to_string();
  EXPECT_EQ(plan.rows, 4);
  EXPECT_EQ(decode_workspace_bytes(a), 0u);

  auto b = a;
  b.num_splits = 4;
  EXPECT_NE(validate(b, plan).message().find("workspace"), std::string::npos);
  alignas(256) static std::byte ws[1 << 16];
  b.workspace = ws;
  b.workspace_bytes = decode_workspace_bytes(b) - 1;
  EXPECT_NE(validate(b, plan).message().find("required"), std::string::npos);
  b.workspace_bytes = decode_workspace_bytes(b);
  EXPECT_TRUE(validate(b, plan).ok());
  b.workspace = ws + 16;
  EXPECT_NE(validate(b, plan).message().find("256-byte"), std::string::npos);

  b = a;
  b.params.num_qo_heads = 3;
  EXPECT_NE(validate(b, plan).message().find("multiple"), std::string::npos);
  b = a;
  b.params.sm_scale = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(validate(b, plan).ok());
  b = a;
  b.max_q_per_seq = 0;
  EXPECT_FALSE(validate(b, plan).ok());
  b = a;
  b.cache.layout.num_kv_heads = 1 << 22;  // 7.3 GiB pages: the kernels' in-page offsets are 32-bit
  EXPECT_NE(validate(b, plan).message().find("4 GiB"), std::string::npos);
  b = a;
  b.params.out = nullptr;
  EXPECT_FALSE(validate(b, plan).ok());

  // rotated_output with value centering is rejected, as on the host.
  constexpr Policy kVC = [] {
    Policy p = presets::K4V2_H;
    p.value.centered = true;
    return p;
  }();
  DecodeArgs<kVC, half_t, half_t> c;
  c.cache = cache<kVC>();
  c.table = table();
  c.params = a.params;
  c.params.rotated_output = true;
  c.rotation.value_mean = g_floats;
  c.total_q = 2;
  EXPECT_NE(validate(c, plan).message().find("rotated_output"), std::string::npos);
}

TEST(CudaValidate, DenseDecode) {
  DenseDecodeArgs<half_t, 128, half_t, half_t> a;
  a.pool = g_pool;
  a.num_pages = 2;
  a.layout = {16, 2};
  a.table = table();
  a.params.q = g_rows;
  a.params.out = g_rows;
  a.params.q_indptr = g_ints;
  a.params.num_qo_heads = 4;
  a.total_q = 2;
  DecodePlan plan;
  EXPECT_TRUE(validate(a, plan).ok());
  auto b = a;
  b.layout.num_kv_heads = 1 << 20;  // 8 GiB pages
  EXPECT_NE(validate(b, plan).message().find("4 GiB"), std::string::npos);
  a.layout.page_size = 8;
  EXPECT_FALSE(validate(a, plan).ok());
}

// ---- dispatch over an instantiation list ---------------------------------------------

// The shape of what kvq_add_instantiations() generates.
#define TEST_INSTANTIATIONS(X)                                                  \
  X(K4V2_d128_half, ((kvq::presets::K4V2).with_head_dim(128)), kvq::half_t)     \
  X(K2V2_HC_d64_bf16, ((kvq::presets::K2V2_HC).with_head_dim(64)), kvq::bfloat16_t)

TEST(CudaDispatch, PicksTheInstantiatedEntry) {
  int calls = 0;
  Policy seen{};
  DType seen_t = DType::f32;
  auto f = [&]<Policy P, class T>() -> Status {
    ++calls;
    seen = P;
    seen_t = dtype_of<T>();
    return {};
  };
  const Status ok = KVQ_CUDA_DISPATCH(TEST_INSTANTIATIONS, presets::K2V2_HC.with_head_dim(64), DType::bf16, f);
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(seen == presets::K2V2_HC.with_head_dim(64));
  EXPECT_EQ(seen_t, DType::bf16);

  // The lambda's own status is returned.
  const Status s = KVQ_CUDA_DISPATCH(TEST_INSTANTIATIONS, presets::K4V2, DType::f16,
                                     [&]<Policy P, class T>() -> Status { return {StatusCode::cuda_error, "x"}; });
  EXPECT_EQ(s.code(), StatusCode::cuda_error);
}

TEST(CudaDispatch, NamesWhatIsAvailable) {
  auto f = []<Policy P, class T>() -> Status { return {}; };
  const Status wrong_dtype = KVQ_CUDA_DISPATCH(TEST_INSTANTIATIONS, presets::K4V2, DType::bf16, f);
  EXPECT_EQ(wrong_dtype.code(), StatusCode::unsupported);
  EXPECT_NE(wrong_dtype.message().find("available: K4V2_d128_half, K2V2_HC_d64_bf16"), std::string::npos)
      << wrong_dtype.message();
  const Status wrong_dim = KVQ_CUDA_DISPATCH(TEST_INSTANTIATIONS, presets::K4V2.with_head_dim(64), DType::f16, f);
  EXPECT_NE(wrong_dim.message().find("head_dim 64"), std::string::npos) << wrong_dim.message();
  const Status wrong_clip = KVQ_CUDA_DISPATCH(TEST_INSTANTIATIONS, presets::K4V2.with_clip(960, 1000), DType::f16, f);
  EXPECT_NE(wrong_clip.message().find("clip960"), std::string::npos) << wrong_clip.message();
}

}  // namespace
