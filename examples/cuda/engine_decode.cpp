// kvq CUDA engine integration: what an inference engine does per layer, end to end.
//
//  * The engine owns all memory: a quantized page pool (kvq::PageLayout), two
//    full-precision page pools for the attention-sink prefix and the recent window
//    (kvq::DensePageLayout), CSR page tables for a ragged batch, queries, outputs.
//  * Prefill: the first kSink tokens stay exact (sink), the last kRecent stay exact
//    (recent window), everything in between is quantized into pages with the fused
//    GPU quantize-append (center → Hadamard → clip → quantize → pack).
//  * Decode: each step appends one token per sequence to the recent window; when the
//    window holds kRecent + kBlock tokens, its oldest kBlock leave it and are
//    quantized into pages (grow the page table first, then append).
//  * Attention = sink part ⊕ quantized part ⊕ recent part, each from a split-KV
//    decode kernel returning (o, lse), joined by merge_states.
//  * Tensor parallelism: rank r of kTP serves KV heads [r·Hkv/TP, (r+1)·Hkv/TP) and
//    their query heads; it gets its own pools and page tables, and RotationParams
//    pointers offset to its first KV head (key_mean + first_head·D). Both ranks run on
//    one GPU here, one after the other.
//
// This file is plain C++ (g++): it only calls launchers declared in
// kvq/cuda/launch/api.hpp; the CMake helper kvq_add_instantiations() compiled them
// with nvcc for exactly this policy. It prints the error against the CPU reference
// (exact attention over the dequantized cache) and the bytes per token versus BF16.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kvq/cuda/launch/api.hpp"
#include "kvq/kvq.hpp"

namespace {

using kvq::half_t;
using T = half_t;
constexpr kvq::Policy P = kvq::presets::K4V2_HC.with_head_dim(128);
constexpr int D = P.head_dim;
constexpr int kHkvTotal = 8, kGroup = 4, kTP = 2, kHkv = kHkvTotal / kTP, kHq = kHkv * kGroup;
constexpr int kSink = 64, kRecent = 256, kBlock = 16, kPage = 16, kSteps = 20;

#define CHECK_CUDA(expr)                                                                   \
  do {                                                                                     \
    cudaError_t e_ = (expr);                                                               \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)
#define CHECK_OK(expr)                                                                          \
  do {                                                                                          \
    kvq::Status s_ = (expr);                                                                    \
    if (!s_.ok()) {                                                                             \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, s_.to_string().c_str()); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

template <class U>
U* device_alloc(std::size_t n) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, std::max<std::size_t>(n, 1) * sizeof(U)));
  return static_cast<U*>(p);
}
template <class U>
void upload(U* dst, const std::vector<U>& src) {
  if (!src.empty()) CHECK_CUDA(cudaMemcpy(dst, src.data(), src.size() * sizeof(U), cudaMemcpyHostToDevice));
}
template <class U>
std::vector<U> download(const U* src, std::size_t n) {
  std::vector<U> v(n);
  if (n) CHECK_CUDA(cudaMemcpy(v.data(), src, n * sizeof(U), cudaMemcpyDeviceToHost));
  return v;
}

// Paged storage of one part (sink, quantized or recent) for a ragged batch: a page
// allocator, per-sequence page lists and the CSR table mirrored on the device.
struct PagedPart {
  int page_size = kPage, capacity = 0, next_free = 0;
  std::vector<std::vector<std::int32_t>> pages;
  std::vector<int> len;
  std::int32_t *d_indptr = nullptr, *d_indices = nullptr, *d_last = nullptr;

  void init(int batch, int max_pages) {
    capacity = max_pages;
    pages.assign(batch, {});
    len.assign(batch, 0);
    d_indptr = device_alloc<std::int32_t>(batch + 1);
    d_indices = device_alloc<std::int32_t>(max_pages);
    d_last = device_alloc<std::int32_t>(batch);
  }
  // Makes room for `n` more tokens of sequence b; returns the first new position.
  int grow(int b, int n) {
    const int first = len[b];
    len[b] += n;
    while (int(pages[b].size()) * page_size < len[b]) {
      if (next_free == capacity) {
        std::fprintf(stderr, "page pool exhausted\n");
        std::exit(1);
      }
      pages[b].push_back(next_free++);
    }
    return first;
  }
  kvq::PageTableView sync() {  // upload the CSR table; returns its device view
    std::vector<std::int32_t> indptr{0}, indices, last;
    for (std::size_t b = 0; b < pages.size(); ++b) {
      indices.insert(indices.end(), pages[b].begin(), pages[b].end());
      indptr.push_back(int(indices.size()));
      last.push_back(len[b] == 0 ? 0 : len[b] - (int(pages[b].size()) - 1) * page_size);
    }
    upload(d_indptr, indptr);
    upload(d_indices, indices);
    upload(d_last, last);
    return {d_indptr, d_indices, d_last, int(pages.size()), page_size};
  }
  kvq::PageTableView host_view(std::vector<std::int32_t>& indptr, std::vector<std::int32_t>& indices,
                               std::vector<std::int32_t>& last) const {
    indptr = {0};
    indices.clear();
    last.clear();
    for (std::size_t b = 0; b < pages.size(); ++b) {
      indices.insert(indices.end(), pages[b].begin(), pages[b].end());
      indptr.push_back(int(indices.size()));
      last.push_back(len[b] == 0 ? 0 : len[b] - (int(pages[b].size()) - 1) * page_size);
    }
    return {indptr.data(), indices.data(), last.data(), int(pages.size()), page_size};
  }
};

// One tensor-parallel rank: its KV heads' caches and the device copies of its
// rotation parameters (a slice of the layer's, starting at its first KV head).
struct Rank {
  int first_head = 0;
  kvq::PageLayout<P> qlayout{kPage, kHkv};
  kvq::DensePageLayout<T, D> dlayout{kPage, kHkv};
  PagedPart quant, sink, recent;
  std::byte *qpool = nullptr, *spool = nullptr, *rpool = nullptr;
  std::vector<std::byte> sink_host, recent_host;  // host mirrors of the exact windows
  kvq::RotationParams rot{};
};

}  // namespace

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("kvq CUDA example: no CUDA device found (this example needs a GPU)\n");
    return 0;
  }
  const std::vector<int> prefill = {1200, 517, 333, 70};
  const int batch = int(prefill.size());
  int max_len = 0;
  for (int l : prefill) max_len = std::max(max_len, l + kSteps);

  // The layer's K/V of every position (post-RoPE, with outlier channels) and its
  // calibrated key means — the engine would produce these on the fly.
  std::mt19937 gen(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto rows_of = [&](std::size_t n, bool outliers) {
    std::vector<T> v(n);
    for (std::size_t i = 0; i < n; ++i) {
      float x = nd(gen);
      if (outliers && i % D == 5) x += 12.f;
      v[i] = T(x);
    }
    return v;
  };
  const std::size_t row = std::size_t(kHkvTotal) * D;  // one token, all KV heads
  std::vector<std::vector<T>> K(batch), V(batch);
  for (int b = 0; b < batch; ++b) K[b] = rows_of(max_len * row, true), V[b] = rows_of(max_len * row, false);
  std::vector<float> key_mean(kHkvTotal * D);
  for (int h = 0; h < kHkvTotal; ++h)
    for (int d = 0; d < D; ++d) key_mean[h * D + d] = d == 5 ? 12.f : 0.f;
  float* d_key_mean = device_alloc<float>(key_mean.size());
  upload(d_key_mean, key_mean);

  std::vector<Rank> ranks(kTP);
  for (int r = 0; r < kTP; ++r) {
    Rank& R = ranks[r];
    R.first_head = r * kHkv;
    R.rot.key_mean = d_key_mean + std::size_t(R.first_head) * D;  // this rank's slice
    const int qpages = batch * (max_len / kPage + 2), wpages = batch * ((kRecent + kBlock) / kPage + 2);
    R.quant.init(batch, qpages);
    R.sink.init(batch, batch * (kSink / kPage + 1));
    R.recent.init(batch, wpages);
    R.qpool = device_alloc<std::byte>(R.qlayout.page_bytes() * qpages);
    R.spool = device_alloc<std::byte>(R.dlayout.page_bytes() * R.sink.capacity);
    R.rpool = device_alloc<std::byte>(R.dlayout.page_bytes() * wpages);
    R.sink_host.assign(R.dlayout.page_bytes() * R.sink.capacity, std::byte{0});
    R.recent_host.assign(R.dlayout.page_bytes() * wpages, std::byte{0});
  }

  // The exact windows live in host mirrors uploaded before attention, and the recent
  // window is rebuilt when tokens leave it; an engine writes rows with its own copy
  // kernel (or keeps a ring buffer) instead.
  std::vector<int> window_start(batch), total(batch, 0);
  auto write_window = [&](Rank& R, PagedPart& part, std::vector<std::byte>& host, int b, int pos, const T* src) {
    const int page = part.pages[b][pos / kPage], slot = pos % kPage;
    std::byte* pg = host.data() + R.dlayout.page_bytes() * page;
    for (int h = 0; h < kHkv; ++h) {
      std::memcpy(R.dlayout.key_row(pg, h, slot), src + std::size_t(R.first_head + h) * D, D * sizeof(T));
    }
  };
  auto write_window_v = [&](Rank& R, PagedPart& part, std::vector<std::byte>& host, int b, int pos, const T* src) {
    const int page = part.pages[b][pos / kPage], slot = pos % kPage;
    std::byte* pg = host.data() + R.dlayout.page_bytes() * page;
    for (int h = 0; h < kHkv; ++h)
      std::memcpy(R.dlayout.value_row(pg, h, slot), src + std::size_t(R.first_head + h) * D, D * sizeof(T));
  };

  // Quantizes tokens [from, to) of sequence b into rank R's pages (grow table, append).
  auto quantize_tokens = [&](Rank& R, int b, int from, int to) {
    if (to <= from) return;
    const int n = to - from;
    const int first = R.quant.grow(b, n);
    const kvq::PageTableView table = R.quant.sync();  // the table covers the new positions first
    std::vector<T> k(std::size_t(n) * kHkv * D), v(k.size());
    std::vector<std::int32_t> bi(n, b), pos(n);
    for (int i = 0; i < n; ++i) {
      pos[i] = first + i;
      for (int h = 0; h < kHkv; ++h)
        for (int d = 0; d < D; ++d) {
          const std::size_t src = std::size_t(from + i) * row + std::size_t(R.first_head + h) * D + d;
          k[(std::size_t(i) * kHkv + h) * D + d] = K[b][src];
          v[(std::size_t(i) * kHkv + h) * D + d] = V[b][src];
        }
    }
    T* dk = device_alloc<T>(k.size());
    T* dv = device_alloc<T>(v.size());
    auto* dbi = device_alloc<std::int32_t>(n);
    auto* dpos = device_alloc<std::int32_t>(n);
    upload(dk, k), upload(dv, v), upload(dbi, bi), upload(dpos, pos);
    kvq::cuda::AppendArgs<P, T> a;
    a.cache = {R.qpool, R.quant.capacity, R.qlayout};
    a.table = table;
    a.keys = dk, a.values = dv;
    a.num_tokens = n;
    a.batch_indices = dbi, a.positions = dpos;
    a.rotation = R.rot;
    CHECK_OK(kvq::cuda::append_kv(a, nullptr));
    CHECK_CUDA(cudaDeviceSynchronize());  // example only: the staging buffers are freed next
    cudaFree(dk), cudaFree(dv), cudaFree(dbi), cudaFree(dpos);
  };

  // Appends tokens [from, to) of sequence b: the first kSink go to the sink; the rest
  // to the recent window, which keeps kRecent..kRecent+kBlock−1 tokens: whole blocks of
  // its oldest tokens leave it and are quantized into pages (at prefill, the whole
  // middle of the prompt goes straight to the quantized pages in one append).
  std::fill(window_start.begin(), window_start.end(), kSink);
  auto append_tokens = [&](int b, int from, int to) {
    for (Rank& R : ranks)
      for (int t = from; t < std::min(to, kSink); ++t) {
        const int pos = R.sink.grow(b, 1);
        write_window(R, R.sink, R.sink_host, b, pos, K[b].data() + std::size_t(t) * row);
        write_window_v(R, R.sink, R.sink_host, b, pos, V[b].data() + std::size_t(t) * row);
      }
    if (to > kSink) {
      const int excess = to - window_start[b] - kRecent;
      const int leave = excess >= kBlock ? excess / kBlock * kBlock : 0;
      const int ws = window_start[b] + leave;
      for (Rank& R : ranks) {
        quantize_tokens(R, b, window_start[b], ws);
        if (leave) R.recent.len[b] = 0;  // rebuild the window from its new start
        for (int t = leave ? ws : std::max(from, kSink); t < to; ++t) {
          const int pos = R.recent.grow(b, 1);
          write_window(R, R.recent, R.recent_host, b, pos, K[b].data() + std::size_t(t) * row);
          write_window_v(R, R.recent, R.recent_host, b, pos, V[b].data() + std::size_t(t) * row);
        }
      }
      window_start[b] = ws;
    }
    total[b] = to;
  };

  for (int b = 0; b < batch; ++b) append_tokens(b, 0, prefill[b]);

  // ---- decode steps ------------------------------------------------------------------
  double worst_vs_cpu = 0, worst_quant_error = 0;
  std::vector<std::int32_t> qi(batch + 1);
  for (int b = 0; b <= batch; ++b) qi[b] = b;
  auto* d_qi = device_alloc<std::int32_t>(batch + 1);
  upload(d_qi, qi);
  T* d_q = device_alloc<T>(std::size_t(batch) * kHq * D);
  T* d_o[3];
  float* d_lse[3];
  for (int i = 0; i < 3; ++i) d_o[i] = device_alloc<T>(std::size_t(batch) * kHq * D), d_lse[i] = device_alloc<float>(batch * kHq);
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

  for (int step = 0; step < kSteps; ++step) {
    for (int b = 0; b < batch; ++b) append_tokens(b, total[b], total[b] + 1);  // the new token
    const std::vector<T> q_all = rows_of(std::size_t(batch) * kHkvTotal * kGroup * D, false);
    for (Rank& R : ranks) {
      // This rank's query heads: [first_head·g, (first_head + Hkv)·g).
      std::vector<T> q(std::size_t(batch) * kHq * D);
      for (int b = 0; b < batch; ++b)
        std::memcpy(&q[std::size_t(b) * kHq * D], &q_all[(std::size_t(b) * kHkvTotal * kGroup + R.first_head * kGroup) * D],
                    std::size_t(kHq) * D * sizeof(T));
      upload(d_q, q);
      upload(R.spool, R.sink_host);
      upload(R.rpool, R.recent_host);
      const kvq::PageTableView st = R.sink.sync(), rt = R.recent.sync(), qt = R.quant.sync();

      auto params = [&](int i) { return kvq::DecodeParams<T, T>{d_q, d_qi, kHq, nullptr, 0.f, false, d_o[i], d_lse[i]}; };
      // Quantized part, split-KV.
      kvq::cuda::DecodeArgs<P, T, T> qa;
      qa.cache = {R.qpool, R.quant.capacity, R.qlayout};
      qa.table = qt;
      qa.params = params(1);
      qa.rotation = R.rot;
      qa.total_q = batch;
      qa.num_splits = kvq::cuda::suggest_num_splits(batch, kHkv, 1, max_len, sms);
      void* ws = qa.num_splits > 1 ? device_alloc<std::byte>(kvq::cuda::decode_workspace_bytes(qa)) : nullptr;
      qa.workspace = ws;
      qa.workspace_bytes = kvq::cuda::decode_workspace_bytes(qa);
      CHECK_OK(kvq::cuda::decode_attention(qa, nullptr));
      // Exact windows.
      for (auto [i, table, pool, cap] : {std::tuple{0, st, R.spool, R.sink.capacity}, std::tuple{2, rt, R.rpool, R.recent.capacity}}) {
        kvq::cuda::DenseDecodeArgs<T, D, T, T> da;
        da.pool = pool, da.num_pages = cap, da.layout = R.dlayout, da.table = table;
        da.params = params(i);
        da.total_q = batch;
        CHECK_OK(kvq::cuda::dense_decode_attention(da, nullptr));
      }
      // o = sink ⊕ quantized ⊕ recent (in place into part 0).
      const int rows = batch * kHq;
      CHECK_OK(kvq::cuda::merge_states<T>(d_o[0], d_lse[0], d_o[1], d_lse[1], rows, D, d_o[0], d_lse[0], nullptr));
      CHECK_OK(kvq::cuda::merge_states<T>(d_o[0], d_lse[0], d_o[2], d_lse[2], rows, D, d_o[0], d_lse[0], nullptr));
      const std::vector<T> o = download(d_o[0], std::size_t(rows) * D);
      if (ws) cudaFree(ws);

      // CPU reference: exact attention over sink ⊕ dequantized middle ⊕ recent.
      const std::vector<std::byte> qpool = download(R.qpool, R.qlayout.page_bytes() * R.quant.capacity);
      std::vector<std::int32_t> ip, ix, il;
      const kvq::PageTableView hq_table = R.quant.host_view(ip, ix, il);
      std::vector<float> key_mean_rank(key_mean.begin() + R.first_head * D, key_mean.end());
      const kvq::RotationParams hrot{key_mean_rank.data(), nullptr, nullptr, nullptr};
      for (int b = 0; b < batch; ++b) {
        const int nq = R.quant.len[b];
        std::vector<float> kq(std::size_t(nq) * kHkv * D + 1), vq(kq.size());
        CHECK_OK(kvq::dequantize_sequence<P>(kvq::ConstPagedCacheView<P>{qpool.data(), R.quant.capacity, R.qlayout},
                                             hq_table, b, hrot, kq.data(), vq.data()));
        const int n = total[b];
        std::vector<float> kk(std::size_t(n) * kHkv * D), vv(kk.size()), kx(kk.size()), vx(kk.size());
        for (int t = 0; t < n; ++t)
          for (int h = 0; h < kHkv; ++h)
            for (int d = 0; d < D; ++d) {
              const std::size_t dst = (std::size_t(t) * kHkv + h) * D + d;
              const std::size_t src = std::size_t(t) * row + std::size_t(R.first_head + h) * D + d;
              kx[dst] = float(K[b][src]), vx[dst] = float(V[b][src]);
              const bool quantized = t >= kSink && t < kSink + nq;
              const std::size_t qs = (std::size_t(t - kSink) * kHkv + h) * D + d;
              kk[dst] = quantized ? kq[qs] : kx[dst];
              vv[dst] = quantized ? vq[qs] : vx[dst];
            }
        for (int j = 0; j < kHq; ++j) {
          const int h = j / kGroup;
          std::vector<float> qf(D);
          for (int d = 0; d < D; ++d) qf[d] = float(q[(std::size_t(b) * kHq + j) * D + d]);
          double ref[D], exact[D];
          const double tau = 1.0 / std::sqrt(double(D));
          kvq::exact_attention_row(qf.data(), kk.data() + h * D, vv.data() + h * D, std::size_t(kHkv) * D, n, n - 1, D,
                                   tau, ref);
          kvq::exact_attention_row(qf.data(), kx.data() + h * D, vx.data() + h * D, std::size_t(kHkv) * D, n, n - 1, D,
                                   tau, exact);
          double e1 = 0, e2 = 0, n1 = 0, n2 = 0;
          for (int d = 0; d < D; ++d) {
            const double g = float(o[(std::size_t(b) * kHq + j) * D + d]);
            e1 += (g - ref[d]) * (g - ref[d]), n1 += ref[d] * ref[d];
            e2 += (g - exact[d]) * (g - exact[d]), n2 += exact[d] * exact[d];
          }
          worst_vs_cpu = std::max(worst_vs_cpu, std::sqrt(e1 / n1));
          worst_quant_error = std::max(worst_quant_error, std::sqrt(e2 / n2));
        }
      }
    }
  }

  const double qbytes = double(kvq::PageLayout<P>::kBytesPerTokenHead), bf16 = 2.0 * D * 2;
  std::printf("kvq CUDA engine example: policy K4V2_HC, d=%d, %d KV heads (TP=%d → %d per rank), GQA %d\n", D,
              kHkvTotal, kTP, kHkv, kGroup);
  std::printf("batch %d, final lengths", batch);
  for (int b = 0; b < batch; ++b) std::printf(" %d", total[b]);
  std::printf(" (sink %d + quantized + recent %d..%d), %d decode steps\n", kSink, kRecent, kRecent + kBlock - 1, kSteps);
  std::printf("max rel. error vs CPU reference (exact attention, same quantized cache): %.2e\n", worst_vs_cpu);
  std::printf("max rel. error vs full-precision attention (quantization error):         %.2e\n", worst_quant_error);
  std::printf("bytes per token per KV head: %.0f quantized vs %.0f BF16 (%.2fx smaller, %.2f bits/element)\n",
              qbytes, bf16, bf16 / qbytes, P.bits_per_element());
  return worst_vs_cpu < 5e-3 ? 0 : 1;
}
