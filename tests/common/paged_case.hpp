// A seeded paged-cache test case shared by the CPU and CUDA tests: a ragged batch,
// pages scattered in a pool with spare pages, random K/V/Q (keys with outlier
// channels and a common offset, as real post-RoPE keys have), random per-head means
// and orthogonal rotations where the policy needs them.
#pragma once

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "common/orthogonal.hpp"
#include "common/test_utils.hpp"
#include "kvq/attention/params.hpp"
#include "kvq/attention/reference.hpp"
#include "kvq/cache/append.hpp"
#include "kvq/cache/host_cache.hpp"

namespace kvq::test {

inline constexpr std::byte kPoisonByte{0xCD};

template <Policy P>
struct PagedCase {
  static constexpr int D = P.head_dim;
  int page_size = 16, hkv = 1, hq = 1, num_pages = 0;
  std::vector<int> seq_lens, q_lens;
  std::vector<std::int32_t> indptr, indices, last_page_len, kv_rows, q_indptr;
  std::vector<std::byte> pool;
  std::vector<float> k, v;  // [Σ seq_lens, hkv, D], sequence b starts at row kv_rows[b]
  std::vector<float> q;     // [Σ q_lens, hq, D]
  LayerParams params;

  int batch() const { return int(seq_lens.size()); }
  PageLayout<P> layout() const { return {page_size, hkv}; }
  PageTableView table() const {
    return {indptr.data(), indices.data(), last_page_len.data(), batch(), page_size, int(indices.size())};
  }
  PagedCacheView<P> cache() { return {pool.data(), num_pages, layout()}; }
  ConstPagedCacheView<P> const_cache() const { return {pool.data(), num_pages, layout()}; }
  DecodeParams<float, float> decode_params(float* out, float* lse, float sm_scale = 0.f) const {
    return {q.data(), q_indptr.data(), hq, nullptr, sm_scale, false, out, lse};
  }

  // Appends every token in a shuffled order (append must not depend on order).
  Status append_all(std::uint32_t seed) {
    std::vector<std::int32_t> bi, pos;
    for (int b = 0; b < batch(); ++b)
      for (int t = 0; t < seq_lens[b]; ++t) bi.push_back(b), pos.push_back(t);
    std::vector<int> order(bi.size());
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), std::mt19937(seed));
    std::vector<float> ks, vs;
    std::vector<std::int32_t> bs, ps;
    for (int i : order) {
      const std::size_t row = (std::size_t(kv_rows[bi[i]]) + pos[i]) * hkv * D;
      ks.insert(ks.end(), k.begin() + row, k.begin() + row + hkv * D);
      vs.insert(vs.end(), v.begin() + row, v.begin() + row + hkv * D);
      bs.push_back(bi[i]);
      ps.push_back(pos[i]);
    }
    return append_kv<P>(cache(), table(), ks.data(), vs.data(), int(bs.size()), bs.data(), ps.data(), params.view());
  }

  // Exact fp64 attention of every query row over the dequantized K̂, V̂ of the cache
  // (or, with full_precision, over the original K, V). out: [Σ q_lens, hq, D],
  // lse: [Σ q_lens, hq].
  void reference(std::vector<double>& out, std::vector<double>& lse, const std::int32_t* causal_offset = nullptr,
                 float sm_scale = 0.f, bool full_precision = false) const {
    out.assign(q.size(), 0.0);
    lse.assign(q.size() / D, 0.0);
    const double tau = sm_scale != 0.f ? sm_scale : 1.0 / std::sqrt(double(D));
    for (int b = 0; b < batch(); ++b) {
      const int len = seq_lens[b];
      std::vector<float> kh(std::size_t(len) * hkv * D), vh(kh.size());
      if (full_precision) {
        const std::size_t first = std::size_t(kv_rows[b]) * hkv * D;
        std::copy(k.begin() + first, k.begin() + first + kh.size(), kh.begin());
        std::copy(v.begin() + first, v.begin() + first + vh.size(), vh.begin());
      } else {
        throw_if_error(dequantize_sequence<P>(const_cache(), table(), b, params.view(), kh.data(), vh.data()));
      }
      const int off = causal_offset ? causal_offset[b] : len - q_lens[b];
      for (int i = 0; i < q_lens[b]; ++i)
        for (int j = 0; j < hq; ++j) {
          const int h = j / (hq / hkv);
          const std::size_t row = std::size_t(q_indptr[b] + i) * hq + j;
          lse[row] = exact_attention_row(q.data() + row * D, kh.data() + h * D, vh.data() + h * D,
                                         std::size_t(hkv) * D, len, i + off, D, tau, out.data() + row * D);
        }
    }
  }
};

template <Policy P>
PagedCase<P> make_paged_case(std::uint32_t seed, int page_size, int hkv, int hq, std::vector<int> seq_lens,
                             std::vector<int> q_lens, int spare_pages = 3, float key_offset = 2.f) {
  constexpr int D = P.head_dim;
  PagedCase<P> c;
  c.page_size = page_size;
  c.hkv = hkv;
  c.hq = hq;
  c.seq_lens = std::move(seq_lens);
  c.q_lens = std::move(q_lens);
  int pages = 0, rows = 0, qrows = 0;
  c.indptr = {0};
  c.q_indptr = {0};
  for (int b = 0; b < c.batch(); ++b) {
    const int n = (c.seq_lens[b] + page_size - 1) / page_size;
    pages += n;
    c.indptr.push_back(pages);
    c.last_page_len.push_back(n == 0 ? 0 : c.seq_lens[b] - (n - 1) * page_size);
    c.kv_rows.push_back(rows);
    rows += c.seq_lens[b];
    qrows += c.q_lens[b];
    c.q_indptr.push_back(qrows);
  }
  c.num_pages = pages + spare_pages;
  c.indices.resize(pages);
  std::vector<int> perm(c.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(seed));
  std::copy(perm.begin(), perm.begin() + pages, c.indices.begin());
  c.pool.assign(c.layout().page_bytes() * c.num_pages, kPoisonByte);

  c.k = outlier_channels(rows, hkv, D, seed + 1);
  for (auto& x : c.k) x += key_offset;  // shared offset: what key centering removes
  c.v = random_normal(std::size_t(rows) * hkv * D, seed + 2);
  const auto value_offset = random_normal(std::size_t(hkv) * D, seed + 7);  // values share a per-channel mean
  for (std::size_t i = 0; i < c.v.size(); ++i) c.v[i] += value_offset[i % (std::size_t(hkv) * D)];
  c.q = random_normal(std::size_t(qrows) * hq * D, seed + 3);
  if (P.key.centered) {
    c.params.key_mean.assign(std::size_t(hkv) * D, 0.f);
    for (int t = 0; t < rows; ++t)
      for (int i = 0; i < hkv * D; ++i) c.params.key_mean[i] += c.k[std::size_t(t) * hkv * D + i] / std::max(rows, 1);
  }
  if (P.value.centered) c.params.value_mean = random_normal(std::size_t(hkv) * D, seed + 4, 0.1f);
  if (P.key.rotation == Rotation::dense) c.params.key_rotation = random_orthogonal(hkv, D, seed + 5);
  if (P.value.rotation == Rotation::dense) c.params.value_rotation = random_orthogonal(hkv, D, seed + 6);
  return c;
}

// max over rows of ‖o − ref‖ / ‖ref‖ (rows of D elements).
template <class A>
double max_row_rel_err(const A& out, const std::vector<double>& ref, int D) {
  double worst = 0;
  for (std::size_t r = 0; r < ref.size() / D; ++r) {
    double num = 0, den = 0;
    for (int d = 0; d < D; ++d) {
      const double e = double(out[r * D + d]) - ref[r * D + d];
      num += e * e;
      den += ref[r * D + d] * ref[r * D + d];
    }
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
  }
  return worst;
}

}  // namespace kvq::test
