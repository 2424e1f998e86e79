// kvq/cache/host_cache.hpp — a host-side KV cache for one layer of one sequence, for
// CPU integrations and examples (engines on GPUs own their pools; see kvq/cuda/).
//
//   positions:  [0, S)            attention-sink prefix, full precision
//               [S, S + Q)        quantized pages (the policy P)
//               [S + Q, N)        recent window, full precision
//
// The first `sink_tokens` appended tokens form the sink. Later tokens enter the recent
// window; once it holds recent_tokens + flush_block tokens, the oldest flush_block are
// quantized into pages. attend() runs the three parts and merges them by LSE.
// The cache owns its memory and grows it on append (amortized doubling); attend()
// allocates nothing.
#pragma once

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "kvq/attention/decode.hpp"
#include "kvq/attention/dense.hpp"
#include "kvq/attention/softmax.hpp"
#include "kvq/cache/append.hpp"
#include "kvq/core/dispatch.hpp"
#include "kvq/core/status.hpp"
#include "kvq/rotation/params.hpp"

namespace kvq {

struct HostCacheOptions {
  int num_kv_heads = 1;
  int num_qo_heads = 1;     // a multiple of num_kv_heads
  int sink_tokens = 64;     // ≥ 0
  int recent_tokens = 256;  // ≥ 0
  int flush_block = 16;     // ≥ 1: tokens quantized at a time
  int page_size = 16;
  float sm_scale = 0.f;     // 0 → 1/√head_dim
  int max_query_tokens = 64;  // largest n_q passed to attend(); sizes its scratch
  KeyScoring key_scoring = KeyScoring::fp32_tiles;  // how the quantized part scores keys
  ValueAccumulation value_accumulation = ValueAccumulation::fp32_tiles;  // and accumulates values
};

// Run-time-polymorphic cache interface (one layer, one sequence).
class KVCache {
 public:
  virtual ~KVCache() = default;
  // k, v: [n_tokens, Hkv, D] post-RoPE rows, appended in order.
  virtual void append(const float* k, const float* v, int n_tokens) = 0;
  // q, out: [n_q, Hq, D]; lse: [n_q, Hq] or null. The queries are the LAST n_q
  // appended positions (causal among themselves).
  virtual void attend(const float* q, int n_q, float* out, float* lse = nullptr) = 0;
  virtual int size() const = 0;
  // Tokens held in quantized pages (the rest are in the fp32 windows).
  virtual int quantized_tokens() const { return 0; }
  virtual void clear() = 0;
  // Bytes the cached K/V occupy (windows at fp32, quantized pages as packed).
  virtual std::size_t bytes() const = 0;
  virtual std::string_view policy_name() const = 0;
};

namespace detail {
// Owning 64-byte-aligned byte buffer (page pools need ≥ 16-byte alignment).
struct AlignedBytes {
  struct Free {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{64}); }
  };
  std::unique_ptr<std::byte[], Free> data;
  std::size_t size = 0;
  void grow(std::size_t n) {
    if (n <= size) return;
    std::size_t cap = size ? size : 4096;
    while (cap < n) cap *= 2;
    std::unique_ptr<std::byte[], Free> p(new (std::align_val_t{64}) std::byte[cap]);
    if (size) std::memcpy(p.get(), data.get(), size);
    data = std::move(p);
    size = cap;
  }
};

inline void validate_options(const HostCacheOptions& o, int head_dim) {
  auto fail = [](const std::string& m) { throw Error(StatusCode::invalid_argument, "host cache: " + m); };
  if (o.num_kv_heads < 1) fail("num_kv_heads must be >= 1");
  if (o.num_qo_heads < 1 || o.num_qo_heads % o.num_kv_heads) fail("num_qo_heads must be a positive multiple of num_kv_heads");
  if (o.sink_tokens < 0 || o.recent_tokens < 0) fail("window sizes must be >= 0");
  if (o.flush_block < 1) fail("flush_block must be >= 1");
  if (o.page_size < 1) fail("page_size must be >= 1");
  if (o.max_query_tokens < 1) fail("max_query_tokens must be >= 1");
  if (!std::isfinite(o.sm_scale)) fail("sm_scale must be finite");
  // attend() holds one call's max_query_tokens·num_qo_heads output rows of head_dim
  // floats in preallocated scratch and counts them with int.
  const long long rows = static_cast<long long>(o.max_query_tokens) * o.num_qo_heads;
  if (head_dim < 1 || rows > std::numeric_limits<int>::max() / head_dim)
    fail("max_query_tokens·num_qo_heads·head_dim (" + std::to_string(o.max_query_tokens) + "·" +
         std::to_string(o.num_qo_heads) + "·" + std::to_string(head_dim) + ") must be < 2^31");
}

// Full-precision windows shared by both cache kinds: rows [n, Hkv, D] fp32.
struct Window {
  std::vector<float> k, v;
  int len = 0;
};

// Attends q to one contiguous fp32 window, keys [0, len) at absolute offset `start`.
template <int D>
void attend_window(const Window& w, int start, int total, const float* q, int n_q, int hkv, int hq, float tau,
                   float* out, float* lse) {
  const std::int32_t q_indptr[2] = {0, n_q};
  const std::int32_t kv_indptr[2] = {0, w.len};
  const std::int32_t offset = total - n_q - start;
  DecodeParams<float, float> p{q, q_indptr, hq, &offset, tau, false, out, lse};
  throw_if_error(dense_attention<D>(w.k.data(), w.v.data(), kv_indptr, 1, hkv, p));
}
}  // namespace detail

// Cache with a quantized middle part under policy P.
template <Policy P>
class HostKVCache final : public KVCache {
  static_assert(check_policy<P>());
  static constexpr int D = P.head_dim;

 public:
  HostKVCache(const HostCacheOptions& options, LayerParams params = {}, std::string_view name = "")
      : opt_(options), params_(std::move(params)), name_(name) {
    detail::validate_options(opt_, D);
    const std::size_t hkv = opt_.num_kv_heads;
    // A missing parameter names what the policy does and where the values come from.
    const std::string policy = name_.empty() ? std::string("the policy") : "policy " + name_;
    auto check = [&](const std::vector<float>& v, bool needed, std::size_t n, const char* what, const char* why,
                     const char* shape) {
      if (needed && v.size() != n)
        throw Error(StatusCode::invalid_argument,
                    "host cache: " + policy + " " + why + ", so LayerParams::" + what + " must hold " + shape + " = " +
                        std::to_string(n) + " floats; it has " + std::to_string(v.size()) +
                        ". They come from calibration: an OptR artifact (kvq::calib::layer_params), or for means "
                        "the per-head mean of cached rows over calibration text");
    };
    check(params_.key_mean, P.key.centered, hkv * D, "key_mean", "centers keys", "num_kv_heads·head_dim");
    check(params_.key_rotation, P.key.rotation == Rotation::dense, hkv * D * D, "key_rotation",
          "rotates keys by a learned matrix", "num_kv_heads·head_dim²");
    check(params_.value_mean, P.value.centered, hkv * D, "value_mean", "centers values", "num_kv_heads·head_dim");
    check(params_.value_rotation, P.value.rotation == Rotation::dense, hkv * D * D, "value_rotation",
          "rotates values by a learned matrix", "num_kv_heads·head_dim²");
    layout_ = PageLayout<P>{opt_.page_size, opt_.num_kv_heads};
    const std::size_t rows = std::size_t(opt_.max_query_tokens) * opt_.num_qo_heads;
    part_out_.resize(rows * D);
    part_lse_.resize(rows);
    lse_scratch_.resize(rows);
  }

  void append(const float* k, const float* v, int n_tokens) override {
    if (n_tokens < 0 || (n_tokens > 0 && (!k || !v)))
      throw Error(StatusCode::invalid_argument, "host cache: append needs non-null k/v and n_tokens >= 0");
    const std::size_t row = std::size_t(opt_.num_kv_heads) * D;
    for (int i = 0; i < n_tokens; ++i) {
      detail::Window& w = sink_.len < opt_.sink_tokens ? sink_ : recent_;
      w.k.insert(w.k.end(), k + i * row, k + (i + 1) * row);
      w.v.insert(w.v.end(), v + i * row, v + (i + 1) * row);
      ++w.len;
      if (recent_.len >= opt_.recent_tokens + opt_.flush_block) flush(opt_.flush_block);
    }
  }

  void attend(const float* q, int n_q, float* out, float* lse = nullptr) override {
    if (n_q < 1 || n_q > size() || n_q > opt_.max_query_tokens || !q || !out)
      throw Error(StatusCode::invalid_argument,
                  "host cache: attend needs 1 <= n_q <= min(size(), max_query_tokens) and non-null q/out (n_q = " +
                      std::to_string(n_q) + ", size = " + std::to_string(size()) + ")");
    const int hkv = opt_.num_kv_heads, hq = opt_.num_qo_heads, total = size();
    const int rows = n_q * hq;
    const float tau = opt_.sm_scale != 0.f ? opt_.sm_scale : 1.f / std::sqrt(float(D));
    float* lse_acc = lse ? lse : lse_scratch_.data();
    // Sink part writes out/lse directly; the others are merged in.
    detail::attend_window<D>(sink_, 0, total, q, n_q, hkv, hq, tau, out, lse_acc);
    if (quantized_len_ > 0) {
      const std::int32_t q_indptr[2] = {0, n_q};
      const std::int32_t offset = total - n_q - sink_.len;
      DecodeParams<float, float> p{q, q_indptr, hq, &offset, tau, false, part_out_.data(), part_lse_.data()};
      throw_if_error(decode_attention<P>(ConstPagedCacheView<P>(pool_.data.get(), num_pages(), layout_), table(), p,
                                         params_.view(), {opt_.key_scoring, opt_.value_accumulation}));
      merge_states(out, lse_acc, part_out_.data(), part_lse_.data(), rows, D, out, lse_acc);
    }
    detail::attend_window<D>(recent_, sink_.len + quantized_len_, total, q, n_q, hkv, hq, tau, part_out_.data(),
                             part_lse_.data());
    merge_states(out, lse_acc, part_out_.data(), part_lse_.data(), rows, D, out, lse_acc);
  }

  int size() const override { return sink_.len + quantized_len_ + recent_.len; }
  int quantized_tokens() const override { return quantized_len_; }
  int sink_size() const { return sink_.len; }
  int recent_size() const { return recent_.len; }

  void clear() override {
    sink_ = {};
    recent_ = {};
    quantized_len_ = 0;
    indices_.clear();
  }

  std::size_t bytes() const override {
    return (std::size_t(sink_.len) + recent_.len) * opt_.num_kv_heads * D * 2 * sizeof(float) +
           std::size_t(quantized_len_) * opt_.num_kv_heads * PageLayout<P>::kBytesPerTokenHead;
  }
  std::string_view policy_name() const override { return name_; }

  // The quantized part as the engine-facing views (tests, inspection).
  ConstPagedCacheView<P> pages() const { return {pool_.data.get(), num_pages(), layout_}; }
  PageTableView table() const {
    table_indptr_[0] = 0;
    table_indptr_[1] = num_pages();
    last_page_len_ = quantized_len_ == 0 ? 0 : (quantized_len_ - 1) % opt_.page_size + 1;
    return {table_indptr_, indices_.data(), &last_page_len_, 1, opt_.page_size, num_pages()};
  }
  const LayerParams& params() const { return params_; }

 private:
  int num_pages() const { return static_cast<int>(indices_.size()); }

  // Moves the oldest n recent tokens into quantized pages.
  void flush(int n) {
    const int new_len = quantized_len_ + n;
    const int pages_needed = (new_len + opt_.page_size - 1) / opt_.page_size;
    if (pages_needed > num_pages()) {
      pool_.grow(layout_.page_bytes() * std::size_t(pages_needed));
      while (num_pages() < pages_needed) indices_.push_back(num_pages());
    }
    const int old_len = quantized_len_;
    quantized_len_ = new_len;  // grow the table first: append writes inside it
    std::vector<std::int32_t> batch(n, 0), pos(n);
    for (int i = 0; i < n; ++i) pos[i] = old_len + i;
    PagedCacheView<P> view{pool_.data.get(), num_pages(), layout_};
    throw_if_error(append_kv<P>(view, table(), recent_.k.data(), recent_.v.data(), n, batch.data(), pos.data(),
                                params_.view()));
    const std::size_t row = std::size_t(opt_.num_kv_heads) * D;
    recent_.k.erase(recent_.k.begin(), recent_.k.begin() + n * row);
    recent_.v.erase(recent_.v.begin(), recent_.v.begin() + n * row);
    recent_.len -= n;
  }

  HostCacheOptions opt_;
  LayerParams params_;
  std::string name_;
  PageLayout<P> layout_{};
  detail::Window sink_, recent_;
  detail::AlignedBytes pool_;
  std::vector<std::int32_t> indices_;
  int quantized_len_ = 0;
  mutable std::int32_t table_indptr_[2] = {0, 0};
  mutable std::int32_t last_page_len_ = 0;
  std::vector<float> part_out_, part_lse_, lse_scratch_;
};

// Full-precision (fp32) cache: the reference the quantized caches are compared with.
template <int D>
class FullPrecisionKVCache final : public KVCache {
 public:
  explicit FullPrecisionKVCache(const HostCacheOptions& options) : opt_(options) { detail::validate_options(opt_, D); }
  void append(const float* k, const float* v, int n_tokens) override {
    if (n_tokens < 0 || (n_tokens > 0 && (!k || !v)))
      throw Error(StatusCode::invalid_argument, "host cache: append needs non-null k/v and n_tokens >= 0");
    const std::size_t n = std::size_t(n_tokens) * opt_.num_kv_heads * D;
    all_.k.insert(all_.k.end(), k, k + n);
    all_.v.insert(all_.v.end(), v, v + n);
    all_.len += n_tokens;
  }
  void attend(const float* q, int n_q, float* out, float* lse = nullptr) override {
    if (n_q < 1 || n_q > size() || !q || !out)
      throw Error(StatusCode::invalid_argument, "host cache: attend needs 1 <= n_q <= size() and non-null q/out");
    const float tau = opt_.sm_scale != 0.f ? opt_.sm_scale : 1.f / std::sqrt(float(D));
    detail::attend_window<D>(all_, 0, size(), q, n_q, opt_.num_kv_heads, opt_.num_qo_heads, tau, out, lse);
  }
  int size() const override { return all_.len; }
  void clear() override { all_ = {}; }
  std::size_t bytes() const override { return std::size_t(all_.len) * opt_.num_kv_heads * D * 2 * sizeof(float); }
  std::string_view policy_name() const override { return "fp32"; }

 private:
  HostCacheOptions opt_;
  detail::Window all_;
};

// A cache for a policy chosen at run time: "fp32" or a policy spelling (parse_policy)
// that is one of Instantiated (default: every preset). Only head_dim D and the listed
// policies are instantiated. Throws kvq::Error for other spellings.
template <int D, const auto& Instantiated = presets::all>
std::unique_ptr<KVCache> make_kv_cache(std::string_view policy, const HostCacheOptions& options,
                                       LayerParams params = {}) {
  if (policy == "fp32") return std::make_unique<FullPrecisionKVCache<D>>(options);
  std::unique_ptr<KVCache> cache;
  throw_if_error(dispatch_preset<D, Instantiated>(policy, [&]<Policy P>() {
    cache = std::make_unique<HostKVCache<P>>(options, std::move(params), policy);
  }));
  return cache;
}

}  // namespace kvq
