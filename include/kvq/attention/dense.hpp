// kvq/attention/dense.hpp — full-precision decode attention (CPU), for the attention-
// sink and recent windows and as the fp16 baseline of the benchmarks. It uses the same
// online-softmax driver and GQA sharing as the quantized path (kvq/cpu/online.hpp).
//
// Two key/value sources:
//   ragged rows : k, v [kv_indptr[batch], Hkv, D] of T; sequence b owns rows
//                 kv_indptr[b] .. kv_indptr[b+1]
//   paged       : DensePageLayout<T, D> pages (kvq/layout/dense.hpp) addressed by a CSR
//                 page table
#pragma once

#include <algorithm>
#include <cmath>

#include "kvq/attention/params.hpp"
#include "kvq/attention/softmax.hpp"
#include "kvq/cpu/online.hpp"
#include "kvq/layout/dense.hpp"
#include "kvq/layout/page_table.hpp"

namespace kvq {

namespace detail {

// Keys and values of one sequence and KV head for attend_block. rows(t0, n, fn) calls
// fn(j, key, value, count, stride) for runs of tokens t0 + j .. t0 + j + count (j < n)
// whose [D] rows of T are key + u·stride and value + u·stride, u < count; q is
// [padded_rows(rows)][D], × τ.
//
// Up to kMaxDirectRows query rows, the products read the rows themselves and convert
// fp16/bf16 in registers (no fp32 tile goes through memory). Values are then accumulated
// optimistically: a block whose accumulators come out non-finite (a NaN/Inf value, which
// with zero weight would poison rows that give it none) is undone and redone through the
// tile path below, which adds such a token only to its rows with nonzero weight. Finite
// fp16/bf16/fp32 rows times weights in [0, 1] cannot overflow the fp32 sums.
template <int D, ActivationType T, class Rows>
struct DenseTileSource {
  static constexpr int kMaxDirectRows = 8;
  Rows rows;
  const float* q = nullptr;
  int rows_padded = 0;
  // Prefetch queues. prefetch_keys / prefetch_values record the next block's rows;
  // logits asks for the keys four tokens at a time between its token groups, and
  // accumulate_values for the values one token and column chunk at a time as each
  // column chunk walks the tokens (all in the first chunk, cold fp16 pages took ~4%
  // longer on a Zen 4). A burst of a whole block's lines into L1 (prefetcht0; 256 lines
  // for the keys and values of the 32-token blocks of then) fills the L1 miss buffers and
  // stalls: spread, fp16 pages from DRAM (32K tokens, 2 KV heads, one Zen 5 core) took
  // 3.0 → 1.9–2.1 ms.
  const T* next_key[kRowPointerSlots] = {};
  const T* next_value[kRowPointerSlots] = {};
  int next_keys = 0, next_values = 0;

  void prefetch_keys(int t0, int n) {
    row_pointers<true>(t0, n, next_key);
    next_keys = n;
  }
  void prefetch_values(int t0, int n) {
    row_pointers<false>(t0, n, next_value);
    next_values = n;
  }
  // One line of each 4 KB OS page of the rows of tokens t0 .. t0 + n, two blocks ahead:
  // the page walks happen here rather than under the next block's prefetches. fp16 pages
  // from DRAM on 4 KB pages (32K tokens, one Zen 4 core): 2.75 → 2.40 ms; on huge pages
  // ~2%; every other 4 KB page alone: no gain. (The quantized source touches too since
  // 2026-12-07: K4V2 fastest, 32K cold on a Xeon VM, 5–9% faster.)
  void touch_pages(int t0, int n) {
    std::uintptr_t key_page = 0, value_page = 0;
    rows(t0, n, [&](int, const T* key, const T* value, int count, std::size_t stride) {
      touch_os_pages(key, count, stride * sizeof(T), key_page);
      touch_os_pages(value, count, stride * sizeof(T), value_page);
    });
  }
  // out[j] = the key (kKeys) or value row of token t0 + j, j < n; out has
  // kRowPointerSlots (strided_rows).
  template <bool kKeys>
  KVQ_FORCE_INLINE void row_pointers(int t0, int n, const T** out) {
    rows(t0, n, [&](int j, const T* key, const T* value, int count, std::size_t stride) {
      strided_rows(out + j, kKeys ? key : value, stride * sizeof(T), count);
    });
  }
  static void ask_for(const T* const* row, int j0, int j1) {
    for (int j = j0; j < j1; ++j) prefetch_bytes(row[j], D * sizeof(T));
  }
  // RowsAt that asks for columns i .. i + kChunk of queued row j of the next block when
  // the column chunk at i reads token j: accumulate_rows' chunks of 4-row passes (8-row
  // passes take half of them, and ask at every other chunk for two).
  struct RowsAtAskingFor {
    const T* const* row;
    const T* const* next;
    int next_count;
    template <int W>
    KVQ_FORCE_INLINE FloatVec<W> load(int j, int i) const {
      constexpr int kChunk = accumulate_chunk_vectors<D, 4>() * lanes_for(D);
      if (i % kChunk == 0 && j < next_count) prefetch_bytes(next[j] + i, kChunk * sizeof(T));
      return load_as_float<W>(row[j] + i);
    }
  };

  void logits(int t0, int n, float* tile, float (*s)[kTokensPerBlock]) {
    if (rows_padded <= kMaxDirectRows) {
      alignas(64) static constexpr T zero_row[D] = {};
      const T* key[kRowPointerSlots];
      row_pointers<true>(t0, n, key);
      const int n_padded = (n + 3) / 4 * 4;
      std::fill(key + n, key + n_padded, zero_row);
      logits_of<D>(q, rows_padded, RowsAt<D, T>{key}, 0, n_padded, s,
                   [&](int j0) { ask_for(next_key, j0, std::min(j0 + 4, next_keys)); });
      ask_for(next_key, n_padded, next_keys);
      next_keys = 0;
      return;
    }
    ask_for(next_key, 0, next_keys);
    next_keys = 0;
    logits_from_tile<D>(q, rows_padded, t0, n, tile, s, [&](int t, int count, float* out) {
      rows(t, count, [&](int j, const T* key, const T*, int run, std::size_t stride) {
        for (int u = 0; u < run; ++u) convert_row<D>(key + u * stride, out + (j + u) * D);
      });
    });
  }
  bool accumulate_values(int t0, int n, const float (*p)[kTokensPerBlock], int padded, float* acc) {
    if (padded > kMaxDirectRows) return false;
    const T* value[kRowPointerSlots];
    row_pointers<false>(t0, n, value);
    alignas(64) float before[kMaxDirectRows * D];
    std::copy(acc, acc + padded * D, before);
    accumulate_of<D>(p, padded, RowsAtAskingFor{value, next_value, std::min(n, next_values)}, 0, n, acc);
    ask_for(next_value, n, next_values);
    next_values = 0;
    if (rows_are_finite<D>(acc, padded)) return true;
    std::copy(before, before + padded * D, acc);
    return false;
  }
  bool values(int t0, int n, float* tile) {
    ask_for(next_value, 0, next_values);
    next_values = 0;
    rows(t0, n, [&](int j, const T*, const T* value, int run, std::size_t stride) {
      for (int u = 0; u < run; ++u) convert_row<D>(value + u * stride, tile + (j + u) * D);
    });
    return rows_are_finite<D>(tile, n);
  }
};

// The rows of sequence b and KV head h for DenseTileSource (its rows(t0, n, fn)).
template <class RowsOf>
struct HeadRows {
  const RowsOf* rows_of = nullptr;
  int b = 0, h = 0;
  template <class Fn>
  KVQ_FORCE_INLINE void operator()(int t0, int n, Fn&& fn) const {
    (*rows_of)(b, h, t0, n, fn);
  }
};

// KV heads that dense_decode attends in lockstep, a block of every head before the next
// block: up to 8, as many as kLockstepRows rows of queries and sums hold (8 heads at
// GQA 4, 2 heads of 16 rows). A page holds each head's key and value regions one after
// the other, so the heads of a group read it in one long run instead of one 2·P·D run
// per head; from DRAM one core streams that faster (fp16 pages, d 128, GQA 4, one Zen 4
// core, cold, medians µs: 2 KV heads × 32K tokens 2500 → 2270 with both heads together;
// 8 KV heads × 8K tokens, 1 / 2 / 4 / 8 heads together 2440 / 2380 / 2330 / 2170). The
// quantized decode, bound by compute, got slower the same way (2 heads together, K4V2
// fastest 32K cold 800 → 970 µs, 4K warm 101 → 102 µs), so it keeps one head at a time.
// dense_decode's stack holds the group's queries and sums, 2·kLockstepRows·D floats (32 KB
// at d 128, 64 KB at d 256), beside the tile and the logits.
inline constexpr int kMaxLockstepKvHeads = 8;
inline constexpr int kLockstepRows = 2 * kMaxRowsPerPass;

// Attention of every sequence and KV head; rows_of(b, h, t0, n, fn) calls fn as
// DenseTileSource::rows does, for KV head h of sequence b; seq_len(b) is the part
// length. Each row's result is the same bits as with its head alone.
template <int D, ActivationType T, ActivationType QT, ActivationType OT, class SeqLen, class RowsOf>
void dense_decode(int batch, int hkv, const DecodeParams<QT, OT>& p, SeqLen&& seq_len, const RowsOf& rows_of) {
  static_assert(D >= 8 && D % 8 == 0, "kvq: dense attention needs head_dim a multiple of 8");
  using Source = DenseTileSource<D, T, HeadRows<RowsOf>>;
  const int hq = p.num_qo_heads, group = hq / hkv;
  const float tau = p.scale(D);
  // Head u of a lockstep group owns rows [u·rows_padded, (u + 1)·rows_padded) of these.
  alignas(64) float qs[kLockstepRows * D];   // τ·q
  alignas(64) float acc[kLockstepRows * D];  // Σ p·v
  float m[kLockstepRows], l[kLockstepRows];
  int limit[kMaxRowsPerPass];  // row rr's causal limit, the same for every KV head
  Source sources[kMaxLockstepKvHeads];
  PartState parts[kMaxLockstepKvHeads];
  alignas(64) float tile[kTileTokens * D];
  alignas(64) float s[kMaxRowsPerPass][kTokensPerBlock];  // logits, then probability weights
  for (int b = 0; b < batch; ++b) {
    const int q0 = p.q_indptr[b], nq = p.q_indptr[b + 1] - q0;
    const int len = seq_len(b);
    const int offset = p.causal_offset ? p.causal_offset[b] : len - nq;
    // Query row r of KV head h: query token r / group, query head h·group + r % group.
    auto row_of = [&](int h, int r) { return std::size_t(q0 + r / group) * hq + h * group + r % group; };
    for (int r0 = 0; r0 < nq * group; r0 += kMaxRowsPerPass) {
      const int rows = std::min(kMaxRowsPerPass, nq * group - r0), rows_padded = padded_rows(rows);
      for (int rr = 0; rr < rows; ++rr) {
        const long long lim = static_cast<long long>((r0 + rr) / group) + offset;
        limit[rr] = lim < 0 ? -1 : static_cast<int>(std::min<long long>(lim, len - 1));
      }
      const int heads_together = std::min(kMaxLockstepKvHeads, kLockstepRows / rows_padded);
      for (int h0 = 0; h0 < hkv; h0 += heads_together) {
        const int count = std::min(heads_together, hkv - h0);
        for (int u = 0; u < count; ++u) {
          const int first = u * rows_padded;
          std::fill(qs + first * D, qs + (first + rows_padded) * D, 0.f);
          for (int rr = 0; rr < rows; ++rr) {
            const QT* src = p.q + row_of(h0 + u, r0 + rr) * D;
            for (int d = 0; d < D; ++d) qs[(first + rr) * D + d] = tau * to_float(src[d]);
          }
          sources[u] = Source{HeadRows<RowsOf>{&rows_of, b, h0 + u}, qs + first * D, rows_padded};
          parts[u] = attend_begin<D>(len, rows, limit, acc + first * D, m + first, l + first);
        }
        // The heads share the limits, so their parts end together.
        for (int t0 = 0; t0 < parts[0].end; t0 += kTokensPerBlock)
          for (int u = 0; u < count; ++u) attend_block<D>(parts[u], t0, tile, s, sources[u]);
        for (int u = 0; u < count; ++u)
          for (int rr = 0; rr < rows; ++rr) {
            const int r = u * rows_padded + rr;
            const std::size_t row = row_of(h0 + u, r0 + rr);
            const bool empty = l[r] == 0.f;
            const float inv_l = empty ? 0.f : 1.f / l[r];
            OT* dst = p.out + row * D;
            for (int d = 0; d < D; ++d) dst[d] = from_float<OT>(acc[r * D + d] * inv_l);
            if (p.lse) p.lse[row] = empty ? neg_inf_f() : m[r] + std::log(l[r]);
          }
      }
    }
  }
}

}  // namespace detail

// Full-precision attention over ragged contiguous K/V rows (see file comment).
template <int D, ActivationType T, ActivationType QT, ActivationType OT>
Status dense_attention(const T* keys, const T* values, const std::int32_t* kv_indptr, int batch, int num_kv_heads,
                       const DecodeParams<QT, OT>& p) {
  using enum StatusCode;
  KVQ_CHECK_ARG(kv_indptr && batch >= 0, invalid_argument, "dense attention: kv_indptr is null");
  PageTableView shape{kv_indptr, nullptr, nullptr, batch, 1};
  KVQ_RETURN_IF_ERROR(validate_decode_params(p, shape, num_kv_heads));
  KVQ_CHECK_ARG(kv_indptr[0] == 0, invalid_argument, "dense attention: kv_indptr[0] must be 0");
  for (int b = 0; b < batch; ++b)
    KVQ_CHECK_ARG(kv_indptr[b + 1] >= kv_indptr[b], invalid_argument, "dense attention: kv_indptr must be non-decreasing");
  KVQ_CHECK_ARG(kv_indptr[batch] == 0 || (keys && values), invalid_argument, "dense attention: keys/values are null");
  const std::size_t hkv = num_kv_heads;
  detail::dense_decode<D, T>(
      batch, num_kv_heads, p, [&](int b) { return kv_indptr[b + 1] - kv_indptr[b]; },
      [&](int b, int h, int t0, int n, auto&& fn) {
        const std::size_t row = ((std::size_t(kv_indptr[b]) + t0) * hkv + h) * D;
        fn(0, keys + row, values + row, n, hkv * D);
      });
  return {};
}

// Full-precision attention over a paged cache with DensePageLayout<T, D> pages.
template <int D, ActivationType T, ActivationType QT, ActivationType OT>
Status dense_paged_attention(const std::byte* pool, int num_pages, const DensePageLayout<T, D>& layout,
                             const PageTableView& table, const DecodeParams<QT, OT>& p) {
  using enum StatusCode;
  KVQ_CHECK_ARG(pool || num_pages == 0, invalid_argument, "dense attention: pool is null");
  KVQ_CHECK_ARG(table.page_size == layout.page_size, invalid_argument,
                "dense attention: page table page_size differs from the layout's");
  KVQ_RETURN_IF_ERROR(validate_page_table(table, num_pages));
  KVQ_RETURN_IF_ERROR(validate_decode_params(p, table, layout.num_kv_heads));
  detail::dense_decode<D, T>(
      table.batch_size, layout.num_kv_heads, p, [&](int b) { return table.seq_len(b); },
      [&](int b, int h, int t0, int n, auto&& fn) {
        int j = 0;  // a page's slots are contiguous rows
        table.for_each_page_run(b, t0, n, [&](int page_index, int slot, int count) {
          const std::byte* page = pool + layout.page_bytes() * std::size_t(page_index);
          fn(j, layout.key_row(page, h, slot), layout.value_row(page, h, slot), count, std::size_t(D));
          j += count;
        });
      });
  return {};
}

}  // namespace kvq
