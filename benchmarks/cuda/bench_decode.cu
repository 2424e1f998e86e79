// CUDA decode-attention and append benchmarks (Google Benchmark, CUDA-event manual
// timing). Reports the physical quantities of DESIGN §9 side by side in one run:
//   BM_Copy           device-to-device copy: the bandwidth roofline (GB/s = read+write)
//   BM_Decode<P>      quantized split-KV decode, CUDA-core kernel: GB/s on PACKED bytes
//                     read, FMA/s
//   BM_DecodeTC<P>    the same through the tensor-core kernel (kernel/decode_mma.cuh),
//                     DecodePrecision::fast; BM_DecodeTCExact: DecodePrecision::exact;
//                     BM_DecodeTCSplits: 1 × 32K and 8 × 8K at other split counts;
//                     BM_DecodeTCPage: pages of 16 (vLLM's default: two page runs per
//                     warp tile) at the target shapes
//   BM_DecodeFP16<K>  the full-precision baseline of the same design on an fp16 cache
//                     (16-bit pages: the bytes of a BF16 cache), both kernels
//   BM_DecodeBF16<K>  the same on a bf16 cache with bf16 queries and outputs, both kernels
//   BM_DecodeFP16TCPage  fp16 pages of 16 through the tensor-core kernel
//   BM_DecodePipeFP16TC/wWsS  fp16 pages through the tensor-core kernel with W warps per
//                     CTA and S pipeline stages (cuda::tuning): the pipeline sweep
//   BM_Append<P>      fused quantize-append of one decode step (batch tokens) and of a
//                     prefill chunk, addressed by position or slot_mapping (slots:1);
//                     tokens/s, device time from a replayed CUDA graph
//   BM_Step<P>        one decode step as an engine runs it: append the batch's new rows,
//                     then decode (tensor-core kernel), back to back on one stream, with
//                     and without programmatic dependent launch (pdl:1), the append by
//                     position or by slot_mapping (slots:1); append_% is
//                     step_us over decode_us, minus one, both timed alike in the same run
// Shapes: Llama-3-8B-like layer, Hkv = 8, Hq = 32 (GQA 4), head_dim 128, page 64 (the
// *Page runs: 16);
// batch × context from 1×4K to 64×32K. Caches hold random codes and metadata (or random
// fp16/bf16 rows), one random page repeated over the pool; queries are random.
#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kvq/cuda/config.cuh"
#include "kvq/cuda/launch/api.hpp"
#include "bench_cuda_decode_kvq_instantiations.hpp"
#include "kvq/cuda/instantiate.cuh"

// The bf16-page baseline (the generated list above instantiates fp16 rows only).
KVQ_CUDA_INSTANTIATE_DENSE(128, kvq::bfloat16_t)

namespace {

using namespace kvq;
using kvq::cuda::Stream;

constexpr int kHkv = 8, kGroup = 4, kHq = kHkv * kGroup, kD = 128, kPage = 64;
using T = half_t;  // queries, outputs and appended rows of the quantized benchmarks

#define BENCH_CUDA(expr)                                                               \
  do {                                                                                 \
    const cudaError_t e_ = (expr);                                                     \
    if (e_ != cudaSuccess) {                                                           \
      state.SkipWithError((std::string(#expr) + ": " + cudaGetErrorString(e_)).c_str()); \
      return;                                                                          \
    }                                                                                  \
  } while (0)

int num_sms() {
  int dev = 0, n = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
  return n;
}

// Owns device memory for one benchmark shape.
struct Dev {
  std::vector<void*> ptrs;
  ~Dev() {
    for (void* p : ptrs) cudaFree(p);
  }
  template <class U>
  U* alloc(std::size_t n) {
    void* p = nullptr;
    if (cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(U)) != cudaSuccess) return nullptr;
    ptrs.push_back(p);
    return static_cast<U*>(p);
  }
};

// A batch of equal-length sequences with contiguous pages of `page` tokens (device arrays).
struct Table {
  PageTableView view{};
  int num_pages = 0;
  bool init(Dev& dev, int batch, int ctx, int page) {
    const int pages = (ctx + page - 1) / page;
    num_pages = batch * pages;
    std::vector<std::int32_t> indptr(batch + 1), indices(num_pages), last(batch, ctx - (pages - 1) * page);
    for (int b = 0; b <= batch; ++b) indptr[b] = b * pages;
    std::iota(indices.begin(), indices.end(), 0);
    auto* d_indptr = dev.alloc<std::int32_t>(indptr.size());
    auto* d_indices = dev.alloc<std::int32_t>(indices.size());
    auto* d_last = dev.alloc<std::int32_t>(last.size());
    if (!d_indptr || !d_indices || !d_last) return false;
    cudaMemcpy(d_indptr, indptr.data(), indptr.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(d_indices, indices.data(), indices.size() * 4, cudaMemcpyHostToDevice);
    cudaMemcpy(d_last, last.data(), last.size() * 4, cudaMemcpyHostToDevice);
    view = {d_indptr, d_indices, d_last, batch, page, num_pages};
    return true;
  }
};

// Times `issue()`, which enqueues `ops` operations on `stream`, with CUDA events; the
// iteration time is per operation.
template <class F>
void time_events(benchmark::State& state, cudaStream_t stream, F&& issue, int ops) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 2; ++i) issue();  // warm-up
  for (auto _ : state) {
    cudaEventRecord(start, stream);
    issue();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0.f;
    cudaEventElapsedTime(&ms, start, stop);
    state.SetIterationTime(ms / 1e3 / ops);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) state.SkipWithError(cudaGetErrorString(e));
}

// Times `launch()` on the default stream; one iteration = `reps` launches.
template <class F>
void time_loop(benchmark::State& state, F&& launch, int reps = 5) {
  time_events(state, nullptr, [&] { for (int r = 0; r < reps; ++r) launch(); }, reps);
}

// `reps` calls of launch(stream) captured once into a CUDA graph on a stream of its own;
// false when the capture fails.
struct CapturedGraph {
  cudaStream_t stream = nullptr;
  cudaGraphExec_t exec = nullptr;
  template <class F>
  CapturedGraph(F&& launch, int reps) {
    if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
      stream = nullptr;
      return;
    }
    cudaGraph_t graph;
    if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) return;
    for (int r = 0; r < reps; ++r) launch(stream);
    if (cudaStreamEndCapture(stream, &graph) != cudaSuccess) return;
    if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) exec = nullptr;
    cudaGraphDestroy(graph);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  ~CapturedGraph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (stream) cudaStreamDestroy(stream);
  }
  explicit operator bool() const { return exec != nullptr; }
  void replay() const { cudaGraphLaunch(exec, stream); }
};

// Times `launch(stream)` replayed from a CUDA graph of `reps` launches: the device time of
// a small kernel without the host's launch cost (an engine captures its decode step in a
// graph; host-launched, a 64-token append measures the launch rate, not the kernel).
template <class F>
void time_graph(benchmark::State& state, F&& launch, int reps = 20) {
  const CapturedGraph g(launch, reps);
  if (!g) {
    const std::string why = cudaGetErrorString(cudaGetLastError());
    return state.SkipWithError(("CUDA graph capture failed: " + why).c_str());
  }
  time_events(state, g.stream, [&] { g.replay(); }, reps);
}

// Device time per launch of `launch(stream)` without the host's cost, as time_graph
// measures it, for a benchmark that times host launches: the best of 5 replays after one
// warm-up (µs; NaN when the capture fails). The decode benchmarks report it beside their
// host-launched time, which is what the torch peer measures.
template <class F>
double graph_us(F&& launch, int reps = 20) {
  double best = NAN;
  if (const CapturedGraph g(launch, reps); g) {
    cudaEvent_t start, stop;
    cudaEventCreate(&start);
    cudaEventCreate(&stop);
    g.replay();
    for (int i = 0; i < 5; ++i) {
      cudaEventRecord(start, g.stream);
      g.replay();
      cudaEventRecord(stop, g.stream);
      cudaEventSynchronize(stop);
      float ms = 0.f;
      if (cudaEventElapsedTime(&ms, start, stop) == cudaSuccess && !(ms * 1e3 / reps >= best)) best = ms * 1e3 / reps;
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  cudaGetLastError();  // a failed capture is reported as NaN, not carried into the next benchmark
  return best;
}

void BM_Copy(benchmark::State& state) {
  const std::size_t bytes = std::size_t(state.range(0)) << 20;
  Dev dev;
  auto* a = dev.alloc<std::byte>(bytes);
  auto* b = dev.alloc<std::byte>(bytes);
  if (!a || !b) return state.SkipWithError("cudaMalloc failed");
  BENCH_CUDA(cudaMemset(a, 1, bytes));
  time_loop(state, [&] { cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice); });
  state.counters["GB/s"] = benchmark::Counter(2.0 * bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["read_GB/s"] = benchmark::Counter(1.0 * bytes / 1e9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Copy)->Arg(1024)->Arg(4096)->UseManualTime()->Unit(benchmark::kMicrosecond);

// Fills `num_pages` device pages with copies of one random page (doubling device copies).
bool fill_pool(std::byte* pool, const std::vector<std::byte>& page, int num_pages) {
  const std::size_t n = page.size();
  if (cudaMemcpy(pool, page.data(), n, cudaMemcpyHostToDevice) != cudaSuccess) return false;
  for (long long done = 1; done < num_pages;) {
    const long long c = std::min<long long>(done, num_pages - done);
    if (cudaMemcpy(pool + done * n, pool, c * n, cudaMemcpyDeviceToDevice) != cudaSuccess) return false;
    done += c;
  }
  return true;
}

// One page of a quantized cache: random codes, scales in [0.02, 0.2), minima in [−2, −0.5).
template <Policy P>
std::vector<std::byte> random_page(const PageLayout<P>& layout) {
  std::vector<std::byte> page(layout.page_bytes());
  std::mt19937 rng(11);
  for (auto& b : page) b = std::byte(rng() & 0xff);
  std::uniform_real_distribution<float> scale(0.02f, 0.2f), lo(-2.f, -0.5f);
  auto meta = [&]<QuantSpec S>(std::byte* bytes) {
    auto* m = reinterpret_cast<meta_storage_t<S.meta>*>(bytes);
    for (int g = 0; g < P.head_dim / S.group; ++g)
      m[2 * g] = MetaTraits<S.meta>::encode(scale(rng)), m[2 * g + 1] = MetaTraits<S.meta>::encode(lo(rng));
  };
  for (int h = 0; h < layout.num_kv_heads; ++h)
    for (int slot = 0; slot < layout.page_size; ++slot) {
      meta.template operator()<P.key>(layout.key_meta_bytes(page.data(), h, slot));
      meta.template operator()<P.value>(layout.value_meta_bytes(page.data(), h, slot));
    }
  return page;
}

// One page of a 16-bit cache: keys and values N(0, 1).
template <ActivationType PT>
std::vector<std::byte> random_page(const DensePageLayout<PT, kD>& layout) {
  std::vector<std::byte> page(layout.page_bytes());
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (int h = 0; h < layout.num_kv_heads; ++h)
    for (int slot = 0; slot < layout.page_size; ++slot) {
      PT* k = layout.key_row(page.data(), h, slot);
      PT* v = layout.value_row(page.data(), h, slot);
      for (int d = 0; d < kD; ++d) k[d] = PT(normal(rng)), v[d] = PT(normal(rng));
    }
  return page;
}

// `batch` sequences of `ctx` tokens over tab.num_pages copies of one random page of
// `layout` (nullptr when allocation or fill fails).
template <class Layout>
std::byte* random_cache(Dev& dev, Table& tab, int batch, int ctx, const Layout& layout) {
  if (!tab.init(dev, batch, ctx, layout.page_size)) return nullptr;
  auto* pool = dev.alloc<std::byte>(layout.page_bytes() * tab.num_pages);
  return pool && fill_pool(pool, random_page(layout), tab.num_pages) ? pool : nullptr;
}

// Queries, outputs (of the arguments' activation type) and split workspace of one decode step.
// ctas: resident CTAs per SM of the kernel the call launches (0: ask decode_ctas_per_sm);
// splits: the split count (0: suggest_num_splits for that occupancy).
template <class Args>
bool setup_decode(Dev& dev, Args& a, int batch, int ctx, int ctas = 0, int splits = 0) {
  using QT = std::remove_cvref_t<decltype(*a.params.q)>;
  std::vector<std::int32_t> qi(batch + 1);
  for (int b = 0; b <= batch; ++b) qi[b] = b;
  auto* d_qi = dev.alloc<std::int32_t>(qi.size());
  auto* q = dev.alloc<QT>(std::size_t(batch) * kHq * kD);
  auto* out = dev.alloc<QT>(std::size_t(batch) * kHq * kD);
  auto* lse = dev.alloc<float>(std::size_t(batch) * kHq);
  if (!d_qi || !q || !out || !lse) return false;
  cudaMemcpy(d_qi, qi.data(), qi.size() * 4, cudaMemcpyHostToDevice);
  std::vector<QT> host_q(std::size_t(batch) * kHq * kD);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (auto& x : host_q) x = QT(normal(rng));
  if (cudaMemcpy(q, host_q.data(), host_q.size() * sizeof(QT), cudaMemcpyHostToDevice) != cudaSuccess) return false;
  a.params = {q, d_qi, kHq, nullptr, 0.f, false, out, lse};
  a.total_q = batch;
  a.max_q_per_seq = 1;
  cuda::DecodePlan plan;
  cuda::DecodeShape s = a.shape();
  s.num_splits = 1;
  if (!cuda::make_decode_plan(s, plan).ok()) return false;
  if (ctas <= 0 && !cuda::decode_ctas_per_sm(a, ctas).ok()) return false;
  a.num_splits = splits > 0 ? splits : cuda::suggest_num_splits(batch, kHkv, plan.row_tiles, ctx, num_sms(), 256, ctas);
  a.workspace_bytes = cuda::decode_workspace_bytes(a);
  a.workspace = a.workspace_bytes ? dev.alloc<std::byte>(a.workspace_bytes) : nullptr;
  if (a.workspace && cudaMemset(a.workspace, 0, a.workspace_bytes) != cudaSuccess) return false;  // zero once
  // The legacy-stream copies and memset above must land before a non-blocking stream
  // (BM_Step, graph replays) reads what they wrote.
  return (!a.workspace_bytes || a.workspace) && cudaDeviceSynchronize() == cudaSuccess;
}

void set_decode_counters(benchmark::State& state, int batch, int ctx, std::size_t bytes_per_token_head, int splits) {
  const double token_heads = double(batch) * ctx * kHkv;
  state.counters["GB/s"] =
      benchmark::Counter(token_heads * bytes_per_token_head / 1e9, benchmark::Counter::kIsIterationInvariantRate);
  // q·k plus p·v multiply-adds of all query heads.
  state.counters["TFMA/s"] =
      benchmark::Counter(token_heads * kGroup * 2.0 * kD / 1e12, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["splits"] = splits;
  state.counters["MB"] = token_heads * bytes_per_token_head / 1e6;
}

// Quantized decode through the CUDA-core or the tensor-core kernel (same plan otherwise),
// the latter in either precision; splits > 0 sets the split count.
template <Policy P, cuda::DecodeKernel K, cuda::DecodePrecision Prec>
void run_decode(benchmark::State& state, int splits, int page = kPage) {
  const int batch = state.range(0), ctx = state.range(1);
  Dev dev;
  const PageLayout<P> layout{page, kHkv};
  Table tab;
  std::byte* pool = random_cache(dev, tab, batch, ctx, layout);
  if (!pool) return state.SkipWithError("cache allocation or fill failed");
  cuda::DecodeArgs<P, T, T> a;
  a.cache = {pool, tab.num_pages, layout};
  a.table = tab.view;
  a.kernel = K;
  a.precision = Prec;
  if (!setup_decode(dev, a, batch, ctx, 0, splits)) return state.SkipWithError("setup failed");
  Status st;
  time_loop(state, [&] { (void)(st = cuda::decode_attention(a, nullptr)); });
  if (!st.ok()) return state.SkipWithError(st.to_string().c_str());
  set_decode_counters(state, batch, ctx, PageLayout<P>::kBytesPerTokenHead, a.num_splits);
  state.counters["graph_us"] = graph_us([&](cudaStream_t s) { (void)cuda::decode_attention(a, s); });
}
template <Policy P, cuda::DecodeKernel K, cuda::DecodePrecision Prec = cuda::DecodePrecision::fast>
void BM_Decode(benchmark::State& state) {
  run_decode<P, K, Prec>(state, 0);
}
// The tensor-core kernel at the split count range(2) (0: the suggested one): the small
// batches' sweep, where a CTA streams few tiles and the split count trades the pipeline's
// fill and the merge against parallelism.
template <Policy P>
void BM_DecodeTCSplits(benchmark::State& state) {
  run_decode<P, cuda::DecodeKernel::tensor_core, cuda::DecodePrecision::fast>(state, static_cast<int>(state.range(2)));
}
// The tensor-core kernel over pages of range(2) tokens: 16 (vLLM's default) stages each
// warp tile as two page runs, where pages of 64 (BM_DecodeTC) take one.
template <Policy P>
void BM_DecodeTCPage(benchmark::State& state) {
  run_decode<P, cuda::DecodeKernel::tensor_core, cuda::DecodePrecision::fast>(state, 0, static_cast<int>(state.range(2)));
}

// 16-bit pages of type PT, with PT queries and outputs. A Pipeline (kernel::MmaPipeline)
// runs the tensor-core kernel with other warps and stages through cuda::tuning, its splits
// from that kernel's occupancy: the sweep from which MmaDecodeConfig's default for 16-bit
// pages is chosen (today 2 warps × 2 stages: one 16 KiB tile in flight per warp, 3 CTAs per
// SM).
template <ActivationType PT, cuda::DecodeKernel K, class Pipeline = void>
void run_decode16(benchmark::State& state, int page) {
  constexpr bool kTuned = !std::is_void_v<Pipeline>;
  const int batch = state.range(0), ctx = state.range(1);
  Dev dev;
  const DensePageLayout<PT, kD> layout{page, kHkv};
  Table tab;
  std::byte* pool = random_cache(dev, tab, batch, ctx, layout);
  if (!pool) return state.SkipWithError("cache allocation or fill failed");
  cuda::DenseDecodeArgs<PT, kD, PT, PT> a;
  a.pool = pool;
  a.num_pages = tab.num_pages;
  a.layout = layout;
  a.table = tab.view;
  a.kernel = K;
  auto decode = [&](cudaStream_t s) {
    if constexpr (kTuned) return cuda::tuning::decode_attention<Pipeline, cuda::DecodePrecision::fast>(a, s);
    else return cuda::dense_decode_attention(a, s);
  };
  Status st;
  int ctas = 0;  // setup_decode asks the default kernel's occupancy
  if constexpr (kTuned) {
    const Status occupancy = cuda::tuning::decode_ctas_per_sm<Pipeline, cuda::DecodePrecision::fast>(a, ctas);
    if (!occupancy.ok() || ctas < 1) return state.SkipWithError(("occupancy: " + occupancy.to_string()).c_str());
    state.counters["ctas_per_sm"] = ctas;
  }
  if (!setup_decode(dev, a, batch, ctx, ctas)) return state.SkipWithError("setup failed");
  time_loop(state, [&] { (void)(st = decode(nullptr)); });
  if (!st.ok()) return state.SkipWithError(st.to_string().c_str());
  set_decode_counters(state, batch, ctx, 2 * kD * sizeof(PT), a.num_splits);
  state.counters["graph_us"] = graph_us([&](cudaStream_t s) { (void)decode(s); });
}
template <ActivationType PT, cuda::DecodeKernel K, class Pipeline = void>
void BM_Decode16(benchmark::State& state) {
  run_decode16<PT, K, Pipeline>(state, kPage);
}
// The tensor-core kernel over 16-bit pages of range(2) tokens (as BM_DecodeTCPage).
template <ActivationType PT>
void BM_Decode16TCPage(benchmark::State& state) {
  run_decode16<PT, cuda::DecodeKernel::tensor_core>(state, static_cast<int>(state.range(2)));
}

// The append of one new row for each of the table's sequences, at `position`, into
// `pool`: random N(0, 1) rows (constant ones would make every group constant: one clip
// round, codes 0). With `slots` the rows are addressed by a slot_mapping instead of batch
// indices and positions (Table: sequence b owns pages b·pages …).
template <Policy P>
bool setup_append(Dev& dev, cuda::AppendArgs<P, T>& a, std::byte* pool, const Table& tab, int position,
                  bool slots = false) {
  const int batch = tab.view.batch_size;
  auto* rows = dev.alloc<T>(std::size_t(batch) * kHkv * kD);
  auto* bi = dev.alloc<std::int32_t>(batch);
  auto* pos = dev.alloc<std::int32_t>(batch);
  auto* slot = dev.alloc<std::int64_t>(batch);
  if (!pool || !rows || !bi || !pos || !slot) return false;
  std::vector<std::int32_t> b(batch), p(batch, position);
  std::iota(b.begin(), b.end(), 0);
  std::vector<std::int64_t> host_slots(batch);
  const std::int64_t pages = tab.num_pages / batch;
  for (int i = 0; i < batch; ++i) host_slots[i] = (i * pages + position / kPage) * kPage + position % kPage;
  if (cudaMemcpy(slot, host_slots.data(), batch * 8, cudaMemcpyHostToDevice) != cudaSuccess) return false;
  a.slot_mapping = slots ? slot : nullptr;
  std::vector<T> host_rows(std::size_t(batch) * kHkv * kD);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (auto& x : host_rows) x = T(normal(rng));
  if (cudaMemcpy(bi, b.data(), batch * 4, cudaMemcpyHostToDevice) != cudaSuccess ||
      cudaMemcpy(pos, p.data(), batch * 4, cudaMemcpyHostToDevice) != cudaSuccess ||
      cudaMemcpy(rows, host_rows.data(), host_rows.size() * sizeof(T), cudaMemcpyHostToDevice) != cudaSuccess)
    return false;
  a.cache = {pool, tab.num_pages, PageLayout<P>{kPage, kHkv}};
  a.table = tab.view;
  a.keys = a.values = rows;
  a.num_tokens = batch;
  a.batch_indices = bi;
  a.positions = pos;
  return cudaDeviceSynchronize() == cudaSuccess;  // as setup_decode: before any non-blocking stream
}

// Fused quantize-append of `tokens` new tokens (decode step: one per sequence), addressed
// by batch index and position (slots:0) or by a slot_mapping (slots:1).
template <Policy P>
void BM_Append(benchmark::State& state) {
  const int tokens = state.range(0);
  Dev dev;
  Table tab;
  if (!tab.init(dev, tokens, 1, kPage)) return state.SkipWithError("allocation failed");
  const PageLayout<P> layout{kPage, kHkv};
  cuda::AppendArgs<P, T> a;
  if (!setup_append(dev, a, dev.alloc<std::byte>(layout.page_bytes() * tab.num_pages), tab, 0, state.range(1) != 0))
    return state.SkipWithError("setup failed");
  Status st;
  time_graph(state, [&](cudaStream_t s) { (void)(st = cuda::append_kv(a, s)); });
  if (!st.ok()) return state.SkipWithError(st.to_string().c_str());
  state.counters["Mtok/s"] = benchmark::Counter(tokens / 1e6, benchmark::Counter::kIsIterationInvariantRate);
}

// Per-launch µs of launch(stream) issued `reps` times back to back on `stream` (best of 5
// after a warm-up), for the ratios of BM_Step.
template <class F>
double host_us(cudaStream_t stream, F&& launch, int reps = 20) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int r = 0; r < reps; ++r) launch(stream);
  double best = NAN;
  for (int i = 0; i < 5; ++i) {
    cudaEventRecord(start, stream);
    for (int r = 0; r < reps; ++r) launch(stream);
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0.f;
    if (cudaEventElapsedTime(&ms, start, stop) == cudaSuccess && !(ms * 1e3 / reps >= best)) best = ms * 1e3 / reps;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

// One decode step: append one new row per sequence at its last position (ctx − 1), then
// decode through the tensor-core kernel; state.range(2) = launch_with_pdl, range(3) = the
// append addressed by a slot_mapping.
template <Policy P>
void BM_Step(benchmark::State& state) {
  const int batch = state.range(0), ctx = state.range(1);
  const bool pdl = state.range(2) != 0;
  Dev dev;
  const PageLayout<P> layout{kPage, kHkv};
  Table tab;
  std::byte* pool = random_cache(dev, tab, batch, ctx, layout);
  if (!pool) return state.SkipWithError("cache allocation or fill failed");
  cuda::AppendArgs<P, T> ap;
  if (!setup_append(dev, ap, pool, tab, ctx - 1, state.range(3) != 0)) return state.SkipWithError("setup failed");
  cuda::DecodeArgs<P, T, T> dc;
  dc.cache = {pool, tab.num_pages, layout};
  dc.table = tab.view;
  dc.kernel = cuda::DecodeKernel::tensor_core;
  if (!setup_decode(dev, dc, batch, ctx)) return state.SkipWithError("setup failed");
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Status st;
  auto step = [&](cudaStream_t s) {
    if (st.ok()) (void)(st = cuda::append_kv(ap, s, pdl));
    if (st.ok()) (void)(st = cuda::decode_attention(dc, s, pdl));
  };
  time_events(state, stream, [&] { for (int r = 0; r < 5; ++r) step(stream); }, 5);
  if (st.ok()) {
    const double step_us = host_us(stream, step);
    const double decode_us = host_us(stream, [&](cudaStream_t s) { (void)cuda::decode_attention(dc, s, pdl); });
    const double step_graph = graph_us(step);
    const double decode_graph = graph_us([&](cudaStream_t s) { (void)cuda::decode_attention(dc, s, pdl); });
    state.counters["step_us"] = step_us;
    state.counters["decode_us"] = decode_us;
    state.counters["append_%"] = 100.0 * (step_us / decode_us - 1.0);
    state.counters["graph_us"] = step_graph;
    state.counters["graph_append_%"] = 100.0 * (step_graph / decode_graph - 1.0);
  }
  cudaStreamDestroy(stream);
  if (!st.ok()) return state.SkipWithError(st.to_string().c_str());
}

void decode_shapes(benchmark::internal::Benchmark* b) {
  for (auto [batch, ctx] : {std::pair{1, 4096}, {1, 32768}, {8, 8192}, {16, 32768}, {64, 4096}, {64, 32768}})
    b->Args({batch, ctx});
  b->ArgNames({"batch", "ctx"})->UseManualTime()->Unit(benchmark::kMicrosecond);
}
// The small batches with the suggested split count (0) and others.
void split_shapes(benchmark::internal::Benchmark* b) {
  for (const int splits : {0, 16, 32, 64, 128}) b->Args({1, 32768, splits});
  for (const int splits : {0, 4, 8, 16, 32}) b->Args({8, 8192, splits});
  b->ArgNames({"batch", "ctx", "splits"})->UseManualTime()->Unit(benchmark::kMicrosecond);
}
// Pages of 16 at the shapes of issue 9's targets (pages of 64: decode_shapes).
void page_shapes(benchmark::internal::Benchmark* b) {
  for (auto [batch, ctx] : {std::pair{1, 32768}, {16, 32768}, {64, 4096}, {64, 32768}}) b->Args({batch, ctx, 16});
  b->ArgNames({"batch", "ctx", "page"})->UseManualTime()->Unit(benchmark::kMicrosecond);
}
// The shapes of issue 9's targets, for the pipeline sweep.
void target_shapes(benchmark::internal::Benchmark* b) {
  for (auto [batch, ctx] : {std::pair{1, 32768}, {8, 8192}, {16, 32768}, {64, 32768}}) b->Args({batch, ctx});
  b->ArgNames({"batch", "ctx"})->UseManualTime()->Unit(benchmark::kMicrosecond);
}

#define KVQ_BENCH(ID, POLICY, TT)                                                                      \
  BENCHMARK_TEMPLATE(BM_Decode, POLICY, cuda::DecodeKernel::simt)->Name("BM_Decode/" #ID)->Apply(decode_shapes); \
  BENCHMARK_TEMPLATE(BM_Decode, POLICY, cuda::DecodeKernel::tensor_core)                               \
      ->Name("BM_DecodeTC/" #ID)                                                                       \
      ->Apply(decode_shapes);                                                                          \
  BENCHMARK_TEMPLATE(BM_DecodeTCSplits, POLICY)->Name("BM_DecodeTCSplits/" #ID)->Apply(split_shapes);         \
  BENCHMARK_TEMPLATE(BM_DecodeTCPage, POLICY)->Name("BM_DecodeTCPage/" #ID)->Apply(page_shapes);               \
  BENCHMARK_TEMPLATE(BM_Decode, POLICY, cuda::DecodeKernel::tensor_core, cuda::DecodePrecision::exact) \
      ->Name("BM_DecodeTCExact/" #ID)                                                                  \
      ->Apply(decode_shapes);                                                                          \
  BENCHMARK_TEMPLATE(BM_Append, POLICY)                                                 \
      ->Name("BM_Append/" #ID)                                                          \
      ->ArgNames({"tokens", "slots"})                                                   \
      ->ArgsProduct({{64, 16384}, {0, 1}})                                              \
      ->UseManualTime()                                                                 \
      ->Unit(benchmark::kMicrosecond);                                                  \
  BENCHMARK_TEMPLATE(BM_Step, POLICY)                                                   \
      ->Name("BM_Step/" #ID)                                                            \
      ->ArgsProduct({{1, 64}, {4096}, {0, 1}, {0, 1}})                                  \
      ->ArgNames({"batch", "ctx", "pdl", "slots"})                                      \
      ->UseManualTime()                                                                 \
      ->Unit(benchmark::kMicrosecond);
KVQ_INSTANTIATIONS(KVQ_BENCH)
BENCHMARK_TEMPLATE(BM_Decode16, half_t, cuda::DecodeKernel::simt)->Name("BM_DecodeFP16")->Apply(decode_shapes);
BENCHMARK_TEMPLATE(BM_Decode16, half_t, cuda::DecodeKernel::tensor_core)->Name("BM_DecodeFP16TC")->Apply(decode_shapes);
BENCHMARK_TEMPLATE(BM_Decode16, bfloat16_t, cuda::DecodeKernel::simt)->Name("BM_DecodeBF16")->Apply(decode_shapes);
BENCHMARK_TEMPLATE(BM_Decode16, bfloat16_t, cuda::DecodeKernel::tensor_core)->Name("BM_DecodeBF16TC")->Apply(decode_shapes);
BENCHMARK_TEMPLATE(BM_Decode16TCPage, half_t)->Name("BM_DecodeFP16TCPage")->Apply(page_shapes);
// The pipeline sweep for 16-bit pages (the default, w2s2, is BM_DecodeFP16TC).
#define KVQ_BENCH_PIPE(W, S) \
  BENCHMARK_TEMPLATE(BM_Decode16, half_t, cuda::DecodeKernel::tensor_core, cuda::kernel::MmaPipeline<W, S>) \
      ->Name("BM_DecodePipeFP16TC/w" #W "s" #S)                                                             \
      ->Apply(target_shapes);
KVQ_BENCH_PIPE(1, 2)
KVQ_BENCH_PIPE(1, 3)
KVQ_BENCH_PIPE(1, 4)
KVQ_BENCH_PIPE(2, 3)

}  // namespace

int main(int argc, char** argv) {
  if (kvq::cuda::device_count() == 0) {
    std::printf("kvq CUDA benchmarks: no CUDA device found, nothing to run\n");
    return 0;
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
