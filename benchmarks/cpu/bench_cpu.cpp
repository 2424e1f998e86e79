// CPU benchmarks (DESIGN §9): quantized decode attention versus an fp16 paged cache
// attention of the same engineering (same online-softmax driver, same GQA sharing),
// the packed bytes versus a measured read bandwidth, quantize-append versus a plain
// copy of the same tokens, and the FWHT.
//
// Counters: GB/s of cache bytes read (packed codes + metadata, or fp16 rows), tokens/s
// (token·KV-head pairs per second), and for the roofline benchmark the read bandwidth.
//
// Decode benchmarks take {tokens, state}. Warm (state 0) reads the same cache every
// iteration, so a cache that fits the last-level cache (a 2-bit cache of 32K tokens is
// 5–8 MB) is served from it. Cold (state 1) gives each iteration the next of enough
// copies of the cache (cold_bytes() in all) that every read comes from DRAM, as one layer's
// cache does in a model's decode step; compare cold runs with BM_ReadBandwidth, which reads
// as many bytes. State 2 is cold on transparent huge pages (fewer TLB misses).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvq/kvq.hpp"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace {

constexpr int kHeadDim = 128, kKvHeads = 2, kQoHeads = 8, kPage = 16;  // GQA 4

std::vector<float> normal(std::size_t n, std::uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d;
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// The bytes a cold decode cycles through, and the roofline reads: ≥ 256 MiB and ≥ twice
// the largest cache Google Benchmark reports. A fixed 64 MiB was beyond the Zen 4's 32 MiB
// L3, but a 2-core VM of a Xeon host that reports a 480 MiB L3 (2026-12-07) read it at
// 18–22 GB/s against 10–12 GB/s over 256 MiB–2 GiB: partly from the L3, while the cold
// decodes read from DRAM.
std::size_t cold_bytes() {
  std::size_t largest_cache = 0;
  for (const auto& c : benchmark::CPUInfo::Get().caches) largest_cache = std::max(largest_cache, std::size_t(c.size));
  return std::max(std::size_t(256) << 20, 2 * largest_cache);
}

// Copies of a cache pool, each 2 MiB-aligned as an engine's pool would be (a vector's
// buffer starts 16 bytes past a page boundary, so every 4 KB region of a page straddles
// two OS pages: cold fp16 pages ran ~10% slower): one when warm (kWarm), cold_bytes() in
// all when cold; with kColdHugePages each copy also asks for transparent huge pages
// (madvise(MADV_HUGEPAGE), Linux). next() hands them out in turn.
enum CacheState : int { kWarm = 0, kCold = 1, kColdHugePages = 2 };
class PoolCopies {
 public:
  static constexpr std::size_t kHugePage = std::size_t(2) << 20;
  PoolCopies() = default;
  PoolCopies(const std::vector<std::byte>& pool, int state) {
    const std::size_t bytes = std::max<std::size_t>((pool.size() + kHugePage - 1) / kHugePage * kHugePage, kHugePage);
    const std::size_t count = state == kWarm ? 1 : std::max<std::size_t>(2, (cold_bytes() + bytes - 1) / bytes);
    for (std::size_t i = 0; i < count; ++i) {
      copies_.emplace_back(static_cast<std::byte*>(std::aligned_alloc(kHugePage, bytes)));
      if (!copies_.back()) throw std::bad_alloc();
#if defined(__linux__)
      if (state == kColdHugePages) madvise(copies_.back().get(), bytes, MADV_HUGEPAGE);
#endif
      std::memcpy(copies_.back().get(), pool.data(), pool.size());
    }
  }
  std::byte* next() {
    std::byte* p = copies_[index_].get();
    index_ = (index_ + 1) % copies_.size();
    return p;
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::vector<std::unique_ptr<std::byte, Free>> copies_;
  std::size_t index_ = 0;
};

struct Table {
  std::vector<std::int32_t> indptr, indices, last;
  explicit Table(int tokens) {
    const int pages = (tokens + kPage - 1) / kPage;
    indptr = {0, pages};
    indices.resize(pages);
    std::iota(indices.begin(), indices.end(), 0);
    last = {tokens - (pages - 1) * kPage};
  }
  kvq::PageTableView view() const { return {indptr.data(), indices.data(), last.data(), 1, kPage, int(indices.size())}; }
  int pages() const { return indptr[1]; }
};

// A decode query of qo_heads heads at d D, its outputs, and the one-sequence query table.
template <int D>
struct DecodeQuery {
  std::vector<float> q, out, lse;
  int qo_heads;
  std::int32_t q_indptr[2] = {0, 1};
  explicit DecodeQuery(int heads) : q(normal(std::size_t(heads) * D, 3)), out(q.size()), lse(heads), qo_heads(heads) {}
  kvq::DecodeParams<float, float> params() { return {q.data(), q_indptr, qo_heads, nullptr, 0.f, false, out.data(), lse.data()}; }
};

// A quantized cache of `tokens` random tokens (one sequence, kKvHeads KV heads), in one
// copy or, cold, in many (PoolCopies, CacheState), and a decode query of qo_heads heads
// (GQA 4 by default).
template <kvq::Policy P>
struct QuantizedDecodeCase {
  static constexpr int D = P.head_dim;
  Table t;
  kvq::PageLayout<P> layout{kPage, kKvHeads};
  std::vector<std::byte> pool;
  kvq::LayerParams params;
  DecodeQuery<D> query;
  PoolCopies copies;
  QuantizedDecodeCase(int tokens, int state, int qo_heads = kQoHeads)
      : t(tokens), pool(layout.page_bytes() * t.pages()), query(qo_heads) {
    if (P.key.centered) params.key_mean.assign(kKvHeads * D, 0.1f);
    const auto k = normal(std::size_t(tokens) * kKvHeads * D, 1), v = normal(k.size(), 2);
    std::vector<std::int32_t> bi(tokens, 0), pos(tokens);
    std::iota(pos.begin(), pos.end(), 0);
    kvq::throw_if_error(kvq::append_kv<P>(kvq::PagedCacheView<P>{pool.data(), t.pages(), layout}, t.view(), k.data(),
                                          v.data(), tokens, bi.data(), pos.data(), params.view()));
    copies = PoolCopies(pool, state);
  }
  kvq::ConstPagedCacheView<P> next_cache() { return {copies.next(), t.pages(), layout}; }
  kvq::DecodeParams<float, float> decode_params() { return query.params(); }
};

// The same for an fp16 paged cache (the baseline).
template <int D>
struct Fp16DecodeCase {
  Table t;
  kvq::DensePageLayout<kvq::half_t, D> layout{kPage, kKvHeads};
  std::vector<std::byte> pool;
  DecodeQuery<D> query;
  PoolCopies copies;
  Fp16DecodeCase(int tokens, int state, int qo_heads = kQoHeads)
      : t(tokens), pool(layout.page_bytes() * t.pages()), query(qo_heads) {
    const auto k = normal(std::size_t(tokens) * kKvHeads * D, 1), v = normal(k.size(), 2);
    for (int tok = 0; tok < tokens; ++tok)
      for (int h = 0; h < kKvHeads; ++h)
        for (int d = 0; d < D; ++d) {
          std::byte* page = pool.data() + layout.page_bytes() * (tok / kPage);
          layout.key_row(page, h, tok % kPage)[d] = kvq::half_t(k[(std::size_t(tok) * kKvHeads + h) * D + d]);
          layout.value_row(page, h, tok % kPage)[d] = kvq::half_t(v[(std::size_t(tok) * kKvHeads + h) * D + d]);
        }
    copies = PoolCopies(pool, state);
  }
  void decode() {
    kvq::throw_if_error(kvq::dense_paged_attention<D>(copies.next(), t.pages(), layout, t.view(), query.params()));
  }
};

template <kvq::Policy P>
void set_decode_counters(benchmark::State& state, int tokens) {
  const double bytes = double(tokens) * kKvHeads * kvq::PageLayout<P>::kBytesPerTokenHead;
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tok*head/s"] = benchmark::Counter(double(tokens) * kKvHeads, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bytes/tok*head"] = double(kvq::PageLayout<P>::kBytesPerTokenHead);
}

// Quantized decode; Scoring picks fp32 key tiles (the reference) or int8-query integer
// dots, Values fp32 value tiles (the reference) or int8 weights on the value codes. Both
// int8: the fastest mode.
template <kvq::Policy P, kvq::KeyScoring Scoring = kvq::KeyScoring::fp32_tiles,
          kvq::ValueAccumulation Values = kvq::ValueAccumulation::fp32_tiles>
void BM_DecodeQuantized(benchmark::State& state) {
  const int tokens = int(state.range(0));
  QuantizedDecodeCase<P> c(tokens, int(state.range(1)));
  const auto p = c.decode_params();
  for (auto _ : state) {
    kvq::throw_if_error(kvq::decode_attention<P>(c.next_cache(), c.t.view(), p, c.params.view(), {Scoring, Values}));
    benchmark::DoNotOptimize(c.query.out.data());
  }
  set_decode_counters<P>(state, tokens);
}

#if defined(_OPENMP)
// The same decode split over the KV chunks of the one sequence, on range(1) OpenMP
// threads (kvq::decode_attention_split, 4096-token chunks: about 3 µs per chunk is overhead); cold.
template <kvq::Policy P, kvq::KeyScoring Scoring, kvq::ValueAccumulation Values>
void BM_DecodeQuantizedThreads(benchmark::State& state) {
  const int tokens = int(state.range(0)), threads = int(state.range(1));
  QuantizedDecodeCase<P> c(tokens, kCold);
  const auto p = c.decode_params();
  const kvq::SplitKvConfig split{4096};
  const std::size_t bytes = kvq::split_decode_workspace_bytes<P>(c.t.view(), p, kKvHeads, split);
  std::vector<std::byte> storage(bytes + 64);
  auto* aligned = reinterpret_cast<std::byte*>((reinterpret_cast<std::uintptr_t>(storage.data()) + 63) / 64 * 64);
  const kvq::cpu::OpenMPExecutor executor{threads};
  for (auto _ : state) {
    kvq::throw_if_error(kvq::decode_attention_split<P>(c.next_cache(), c.t.view(), p, c.params.view(), {Scoring, Values}, split,
                                                       {aligned, bytes}, executor));
    benchmark::DoNotOptimize(c.query.out.data());
  }
  set_decode_counters<P>(state, tokens);
  state.counters["threads"] = threads;
}
#endif

// The baseline: the same decode over an fp16 paged cache.
void set_fp16_counters(benchmark::State& state, int tokens, int d) {
  const double bytes = double(tokens) * kKvHeads * d * 2 * sizeof(kvq::half_t);
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["tok*head/s"] = benchmark::Counter(double(tokens) * kKvHeads, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["bytes/tok*head"] = double(d * 2 * sizeof(kvq::half_t));
}
void BM_DecodeFp16(benchmark::State& state) {
  const int tokens = int(state.range(0));
  Fp16DecodeCase<kHeadDim> c(tokens, int(state.range(1)));
  for (auto _ : state) {
    c.decode();
    benchmark::DoNotOptimize(c.query.out.data());
  }
  set_fp16_counters(state, tokens, kHeadDim);
}

// Other shapes: {tokens, GQA} at d = P.head_dim (D), warm. The fastest mode against fp16
// pages of the same shape, so that the ratio is read per (d, GQA): the per-token work
// that does not scale with d (softmax, weights, metadata) weighs most at d 64.
template <kvq::Policy P>
void BM_DecodeShape(benchmark::State& state) {
  const int tokens = int(state.range(0));
  QuantizedDecodeCase<P> c(tokens, kWarm, kKvHeads * int(state.range(1)));
  const auto p = c.decode_params();
  for (auto _ : state) {
    kvq::throw_if_error(kvq::decode_attention<P>(c.next_cache(), c.t.view(), p, c.params.view(),
                                                 {kvq::KeyScoring::int8_query, kvq::ValueAccumulation::int8_weights}));
    benchmark::DoNotOptimize(c.query.out.data());
  }
  set_decode_counters<P>(state, tokens);
}
template <int D>
void BM_DecodeShapeFp16(benchmark::State& state) {
  const int tokens = int(state.range(0));
  Fp16DecodeCase<D> c(tokens, kWarm, kKvHeads * int(state.range(1)));
  for (auto _ : state) {
    c.decode();
    benchmark::DoNotOptimize(c.query.out.data());
  }
  set_fp16_counters(state, tokens, D);
}

// Memory roofline: one pass reading a buffer of cold_bytes() (sum of 64-bit words).
void BM_ReadBandwidth(benchmark::State& state) {
  const std::size_t bytes = cold_bytes();
  std::vector<std::uint64_t> buf(bytes / 8, 1);
  for (auto _ : state) {
    std::uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (std::size_t i = 0; i + 4 <= buf.size(); i += 4) s0 += buf[i], s1 += buf[i + 1], s2 += buf[i + 2], s3 += buf[i + 3];
    benchmark::DoNotOptimize(s0 + s1 + s2 + s3);
  }
  state.counters["GB/s"] = benchmark::Counter(double(bytes) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["MiB"] = double(bytes >> 20);
}

// range(1) > 0: the task-split append on that many OpenMP threads, one task each.
template <kvq::Policy P>
void BM_AppendQuantized(benchmark::State& state) {
  constexpr int D = P.head_dim;  // 128, except for the d-64 and d-256 appends at the end
  const int tokens = int(state.range(0)), threads = int(state.range(1));
  Table t(tokens);
  const kvq::PageLayout<P> layout{kPage, kKvHeads};
  std::vector<std::byte> pool(layout.page_bytes() * t.pages());
  const auto k = normal(std::size_t(tokens) * kKvHeads * D, 1), v = normal(k.size(), 2);
  std::vector<kvq::half_t> kh(k.size()), vh(v.size());
  for (std::size_t i = 0; i < k.size(); ++i) kh[i] = kvq::half_t(k[i]), vh[i] = kvq::half_t(v[i]);
  kvq::LayerParams params;
  if (P.key.centered) params.key_mean.assign(kKvHeads * D, 0.1f);
  std::vector<float> identity(std::size_t(kKvHeads) * D * D, 0.f);
  for (int h = 0; h < kKvHeads; ++h)
    for (int i = 0; i < D; ++i) identity[(std::size_t(h) * D + i) * D + i] = 1.f;
  if (P.key.rotation == kvq::Rotation::dense) params.key_rotation = identity;  // costs a full d×d product
  if (P.value.rotation == kvq::Rotation::dense) params.value_rotation = identity;
  std::vector<std::int32_t> bi(tokens, 0), pos(tokens);
  std::iota(pos.begin(), pos.end(), 0);
  const kvq::PagedCacheView<P> cache{pool.data(), t.pages(), layout};
  for (auto _ : state) {
    if (threads == 0) {
      kvq::throw_if_error(kvq::append_kv<P>(cache, t.view(), kh.data(), vh.data(), tokens, bi.data(), pos.data(), params.view()));
    } else {
#if defined(_OPENMP)
      kvq::throw_if_error(kvq::append_kv<P>(cache, t.view(), kh.data(), vh.data(), tokens, bi.data(), pos.data(),
                                            params.view(), threads, kvq::cpu::OpenMPExecutor{threads}));
#else
      state.SkipWithError("built without OpenMP");
      break;
#endif
    }
    benchmark::DoNotOptimize(pool.data());
  }
  if (threads > 0) state.counters["threads"] = threads;
  state.counters["tok*head/s"] = benchmark::Counter(double(tokens) * kKvHeads, benchmark::Counter::kIsIterationInvariantRate);
}

// Baseline for append: copying the same fp16 rows into fp16 pages.
void BM_AppendFp16Copy(benchmark::State& state) {
  const int tokens = int(state.range(0));
  Table t(tokens);
  const kvq::DensePageLayout<kvq::half_t, kHeadDim> layout{kPage, kKvHeads};
  std::vector<std::byte> pool(layout.page_bytes() * t.pages());
  std::vector<kvq::half_t> kh(std::size_t(tokens) * kKvHeads * kHeadDim), vh(kh.size());
  for (auto _ : state) {
    for (int tok = 0; tok < tokens; ++tok)
      for (int h = 0; h < kKvHeads; ++h) {
        std::byte* page = pool.data() + layout.page_bytes() * t.indices[tok / kPage];
        const std::size_t row = (std::size_t(tok) * kKvHeads + h) * kHeadDim;
        std::memcpy(layout.key_row(page, h, tok % kPage), kh.data() + row, kHeadDim * sizeof(kvq::half_t));
        std::memcpy(layout.value_row(page, h, tok % kPage), vh.data() + row, kHeadDim * sizeof(kvq::half_t));
      }
    benchmark::DoNotOptimize(pool.data());
  }
  state.counters["tok*head/s"] = benchmark::Counter(double(tokens) * kKvHeads, benchmark::Counter::kIsIterationInvariantRate);
}

// The FWHT of the Hadamard presets' append: the scalar reference (range 0) and the
// vector path (range 1), the same bits.
template <int D>
void BM_Fwht(benchmark::State& state) {
  const bool vector_path = state.range(0) != 0;
  auto x = normal(D, 5);
  for (auto _ : state) {
    if (vector_path) kvq::cpu::hadamard_forward_fast<D>(x.data(), 0);
    else kvq::hadamard_forward<D>(x.data());
    benchmark::DoNotOptimize(x.data());
  }
  state.counters["rows/s"] = benchmark::Counter(1, benchmark::Counter::kIsIterationInvariantRate);
}

// x ↦ x·R of the learned-rotation presets' append: the scalar reference (range 0) and
// the vector path for 1 or 4 rows per pass over R (range 1, 4), the same bits.
template <int D>
void BM_RotateDense(benchmark::State& state) {
  const int rows = int(state.range(0));
  const auto r = normal(std::size_t(D) * D, 6);
  auto x = normal(std::size_t(D) * (rows > 0 ? rows : 1), 7);
  std::vector<float> scratch(D);
  float* row_ptrs[4];
  for (int q = 0; q < rows; ++q) row_ptrs[q] = x.data() + std::size_t(q) * D;
  for (auto _ : state) {
    if (rows > 0) {
      kvq::cpu::rotate_dense_rows_fast<D>(rows, row_ptrs, r.data());
    } else {
      kvq::rotate_dense<D>(x.data(), r.data(), scratch.data());
      std::copy(scratch.begin(), scratch.end(), x.begin());
    }
    benchmark::DoNotOptimize(x.data());
  }
  state.counters["rows/s"] = benchmark::Counter(rows > 0 ? rows : 1, benchmark::Counter::kIsIterationInvariantRate);
}

// {tokens, CacheState}
#define KVQ_CONTEXTS                                                                                          \
  ->Args({1024, kWarm})->Args({4096, kWarm})->Args({16384, kWarm})->Args({32768, kWarm})->Args({32768, kCold}) \
      ->Args({32768, kColdHugePages})                                                                         \
      ->Unit(benchmark::kMicrosecond)
BENCHMARK(BM_DecodeFp16) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K8V8>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K4V4>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K4V2>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K2V4>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K2V2>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K4V2_HC>) KVQ_CONTEXTS;
constexpr auto kInt8 = kvq::KeyScoring::int8_query;
constexpr auto kFp32Keys = kvq::KeyScoring::fp32_tiles;
constexpr auto kInt8Values = kvq::ValueAccumulation::int8_weights;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K4V4, kInt8>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K4V2, kInt8>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K2V4, kInt8>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K2V2, kInt8>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K4V2_HC, kInt8>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K4V2, kFp32Keys, kInt8Values>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K4V4, kInt8, kInt8Values>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K4V2, kInt8, kInt8Values>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K2V2, kInt8, kInt8Values>) KVQ_CONTEXTS;
BENCHMARK(BM_DecodeQuantized<kvq::presets::K4V2_HC, kInt8, kInt8Values>) KVQ_CONTEXTS;
// {tokens, GQA}, warm
#define KVQ_SHAPES ->Args({4096, 1})->Args({4096, 4})->Args({4096, 8})->Unit(benchmark::kMicrosecond)
BENCHMARK(BM_DecodeShapeFp16<64>) KVQ_SHAPES;
BENCHMARK(BM_DecodeShape<kvq::presets::K4V2.with_head_dim(64)>) KVQ_SHAPES;
BENCHMARK(BM_DecodeShape<kvq::presets::K2V2.with_head_dim(64)>) KVQ_SHAPES;
BENCHMARK(BM_DecodeShapeFp16<128>) KVQ_SHAPES;
BENCHMARK(BM_DecodeShape<kvq::presets::K4V2>) KVQ_SHAPES;
BENCHMARK(BM_DecodeShape<kvq::presets::K2V2>) KVQ_SHAPES;
BENCHMARK(BM_DecodeShapeFp16<256>) KVQ_SHAPES;
BENCHMARK(BM_DecodeShape<kvq::presets::K4V2.with_head_dim(256)>) KVQ_SHAPES;
BENCHMARK(BM_DecodeShape<kvq::presets::K2V2.with_head_dim(256)>) KVQ_SHAPES;
#if defined(_OPENMP)
BENCHMARK(BM_DecodeQuantizedThreads<kvq::presets::K4V2, kInt8, kInt8Values>)->Args({32768, 1})->Args({32768, 2})->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_DecodeQuantizedThreads<kvq::presets::K2V2, kInt8, kInt8Values>)->Args({32768, 1})->Args({32768, 2})->UseRealTime()->Unit(benchmark::kMicrosecond);
#endif
BENCHMARK(BM_ReadBandwidth)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AppendFp16Copy)->Arg(4096)->Unit(benchmark::kMicrosecond);
#define KVQ_APPEND_ARGS ->Args({4096, 0})->Args({4096, 1})->Args({4096, 2})->UseRealTime()->Unit(benchmark::kMicrosecond)
BENCHMARK(BM_AppendQuantized<kvq::presets::K4V2>) KVQ_APPEND_ARGS;
BENCHMARK(BM_AppendQuantized<kvq::presets::K2V2_HC>) KVQ_APPEND_ARGS;
BENCHMARK(BM_AppendQuantized<kvq::presets::K4V2_R.with_clip(1000, 1000)>)->Args({4096, 0})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AppendQuantized<kvq::presets::K4V2_R>)->Args({4096, 0})->Unit(benchmark::kMicrosecond);  // values clipped
BENCHMARK(BM_AppendQuantized<kvq::presets::K2V2_R>)->Args({4096, 0})->Unit(benchmark::kMicrosecond);  // keys and values clipped
BENCHMARK(BM_AppendQuantized<kvq::presets::K4V2_HC.with_clip(960, 920)>)->Args({4096, 0})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AppendQuantized<kvq::presets::K4V2_HC>)->Args({4096, 0})->Unit(benchmark::kMicrosecond);  // values clipped
BENCHMARK(BM_AppendQuantized<kvq::presets::K4V2_HC.with_clip(1000, 1000)>)->Args({4096, 0})->Unit(benchmark::kMicrosecond);  // K4V2_HC until 2026-12-05
BENCHMARK(BM_AppendQuantized<kvq::presets::K2V2_HC.with_head_dim(64)>)->Args({4096, 0})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_AppendQuantized<kvq::presets::K2V2_HC.with_head_dim(256)>)->Args({4096, 0})->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Fwht<64>)->Arg(0)->Arg(1);
BENCHMARK(BM_Fwht<128>)->Arg(0)->Arg(1);
BENCHMARK(BM_Fwht<256>)->Arg(0)->Arg(1);
BENCHMARK(BM_RotateDense<64>)->Arg(0)->Arg(1)->Arg(4);
BENCHMARK(BM_RotateDense<128>)->Arg(0)->Arg(1)->Arg(4);
BENCHMARK(BM_RotateDense<256>)->Arg(0)->Arg(1)->Arg(4);

}  // namespace

int main(int argc, char** argv) {
  benchmark::AddCustomContext("kvq_cpu_isa", kvq::cpu::isa_name());
  benchmark::AddCustomContext("kvq_cpu_float_lanes", std::to_string(kvq::cpu::kNativeFloatLanes));
  benchmark::AddCustomContext("kvq_cpu_logit_lanes", std::to_string(kvq::cpu::kLogitFloatLanes));
  benchmark::AddCustomContext("kvq_cpu_fwht_bits", std::to_string(KVQ_CPU_FWHT_BITS));
  benchmark::AddCustomContext("kvq_cpu_prefetch_locality", std::to_string(KVQ_CPU_PREFETCH_LOCALITY));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
