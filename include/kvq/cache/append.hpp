// kvq/cache/append.hpp — quantize-append of new K/V rows into the paged cache (CPU
// reference). The CUDA kernel (kvq/cuda/kernel/rows.cuh) has warp versions of these per-row
// steps that give the same bits.
//
// For every new token i:  k_i, v_i : [Hkv, D] rows of type T (fp32 / fp16 / bf16)
//   → center → rotate → clip → group-quantize → pack → page indices[indptr[b] + pos/P],
//     slot pos % P, with b = batch_indices[i], pos = positions[i]
//     (or page s/P, slot s % P of a pool slot s = slot_mapping[i]).
// The engine grows the page table (and last_page_len) before appending; positions must
// lie inside the sequence it describes.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "kvq/core/numeric.hpp"
#include "kvq/core/quantizer.hpp"
#include "kvq/core/status.hpp"
#include "kvq/cpu/executor.hpp"
#include "kvq/cpu/quantize.hpp"
#include "kvq/cpu/tile.hpp"
#include "kvq/layout/page_table.hpp"
#include "kvq/layout/paged.hpp"
#include "kvq/rotation/transform.hpp"

namespace kvq {

// Quantizes one key row and one value row of KV head h into `page`, slot `slot`.
// k, v: [D] fp32 raw rows (copied; the caller's rows are not modified).
template <Policy P>
KVQ_HOST_DEVICE void quantize_token_head(const float* k, const float* v, int h, int slot,
                                         const RotationParams& r, const PageLayout<P>& layout,
                                         std::byte* page) {
  constexpr int D = P.head_dim;
  float row[D], scratch[D];
  for (int i = 0; i < D; ++i) row[i] = k[i];
  transform_key<P>(row, h, r, scratch);
  quantize_row<P.key, D>(row, reinterpret_cast<std::uint8_t*>(layout.key_codes(page, h, slot)),
                         reinterpret_cast<meta_storage_t<P.key.meta>*>(layout.key_meta_bytes(page, h, slot)));
  for (int i = 0; i < D; ++i) row[i] = v[i];
  transform_value<P>(row, h, r, scratch);
  quantize_row<P.value, D>(row, reinterpret_cast<std::uint8_t*>(layout.value_codes(page, h, slot)),
                           reinterpret_cast<meta_storage_t<P.value.meta>*>(layout.value_meta_bytes(page, h, slot)));
}

// Checks an append request; writes nothing.
template <Policy P>
Status validate_append(const PagedCacheView<P>& cache, const PageTableView& table, const void* keys,
                       const void* values, int num_tokens, const std::int32_t* batch_indices,
                       const std::int32_t* positions, const RotationParams& r) {
  using enum StatusCode;
  KVQ_CHECK_ARG(num_tokens >= 0, invalid_argument, "append: negative num_tokens");
  if (num_tokens == 0) return {};
  KVQ_CHECK_ARG(keys && values && batch_indices && positions, invalid_argument,
                "append: keys, values, batch_indices and positions must not be null");
  KVQ_CHECK_ARG(cache.pool, invalid_argument, "append: cache pool is null");
  KVQ_CHECK_ARG(cache.layout.num_kv_heads >= 1, invalid_argument, "append: num_kv_heads must be >= 1");
  KVQ_CHECK_ARG(table.page_size == cache.layout.page_size, invalid_argument,
                "append: page table page_size differs from the cache layout's");
  KVQ_RETURN_IF_ERROR(validate_page_table(table, cache.num_pages));
  KVQ_RETURN_IF_ERROR(validate_rotation_params<P>(r));
  for (int i = 0; i < num_tokens; ++i) {
    const int b = batch_indices[i];
    if (b < 0 || b >= table.batch_size)
      return {out_of_range, "append: batch_indices[" + std::to_string(i) + "] = " + std::to_string(b) +
                                " outside [0, " + std::to_string(table.batch_size) + ")"};
    if (positions[i] < 0 || positions[i] >= table.seq_len(b))
      return {out_of_range, "append: positions[" + std::to_string(i) + "] = " + std::to_string(positions[i]) +
                                " outside sequence " + std::to_string(b) + " of length " +
                                std::to_string(table.seq_len(b)) + " (grow the page table first)"};
  }
  return {};
}

namespace detail {

// The (token, KV head) items of an append (token i at locate(i) = {page, slot}; page < 0
// skips it) for which owns(head, page) holds, 16 at a time through the SIMD path
// (bit-identical to quantize_token_head), each head's in token order.
// 16 rows fill the 16 lanes of the quantizer's range transpose even for one group per
// row (value group = head_dim); the rows take 2·16·D floats of stack. At d 256, 8 rows
// (the presets' 128-wide value groups still fill 16 lanes) keep them at 16 KiB, half of
// L1: K2V2_HC's append on a Zen 4 (AVX-512, the FWHT in two parts) went 197 → 180 ns per
// token·head.
template <Policy P, ActivationType T, class Locate, class Owns>
void append_items(const PagedCacheView<P>& cache, const T* keys, const T* values, int num_tokens,
                  const RotationParams& r, Locate locate, Owns owns) {
  constexpr int D = P.head_dim, kBatch = D > 128 ? 8 : 16;  // (token, head) items quantized together
  const int hkv = cache.layout.num_kv_heads;
  alignas(64) float k[kBatch][D], v[kBatch][D];  // the transformed rows
  float* k_rows[kBatch];
  float* v_rows[kBatch];
  const T* k_src[kBatch];
  const T* v_src[kBatch];
  int heads[kBatch], slots[kBatch];
  std::byte* pages[kBatch];
  for (int j = 0; j < kBatch; ++j) k_rows[j] = k[j], v_rows[j] = v[j];
  int n = 0;
  auto flush = [&] {
    cpu::quantize_token_heads_fast<P, kBatch>(n, k_src, v_src, k_rows, v_rows, heads, slots, pages, r, cache.layout);
    n = 0;
  };
  auto add = [&](int i, int h, std::byte* page, int slot) {
    const std::size_t row = (std::size_t(i) * hkv + h) * D;
    k_src[n] = keys + row, v_src[n] = values + row;
    heads[n] = h, slots[n] = slot, pages[n] = page;
    if (++n == kBatch) flush();
  };
  // Chunks of kBatch tokens. Where a kind can go across lanes (cpu::detail::kAppendByHead),
  // a chunk with every token present goes head by head (batches of one KV head, whose
  // means are then broadcasts); otherwise items go token by token, batches spanning
  // chunks (a decode step's few tokens make one batch, not one per head). Either way a
  // head's rows go in token order.
  constexpr bool kByHead = cpu::detail::kAppendByHead<P, T, kBatch>;
  for (int i0 = 0; i0 < num_tokens; i0 += kBatch) {
    const int count = num_tokens - i0 < kBatch ? num_tokens - i0 : kBatch;
    std::byte* chunk_pages[kBatch];
    int chunk_page_index[kBatch], chunk_slots[kBatch], present = 0;
    for (int c = 0; c < count; ++c) {
      const auto [page_index, slot] = locate(i0 + c);  // page_index < 0: skip the token
      chunk_page_index[c] = page_index, chunk_slots[c] = slot;
      chunk_pages[c] = page_index < 0 ? nullptr : cache.page(page_index);
      present += page_index >= 0;
    }
    if (kByHead && present == kBatch) {
      if (n > 0) flush();
      for (int h = 0; h < hkv; ++h) {
        for (int c = 0; c < count; ++c)
          if (owns(h, chunk_page_index[c])) add(i0 + c, h, chunk_pages[c], chunk_slots[c]);
        if (n > 0) flush();
      }
    } else {
      for (int c = 0; c < count; ++c)
        if (chunk_pages[c])
          for (int h = 0; h < hkv; ++h)
            if (owns(h, chunk_page_index[c])) add(i0 + c, h, chunk_pages[c], chunk_slots[c]);
    }
  }
  if (n > 0) flush();
}

// The (page, slot) of token i, by batch index and position or by pool slot.
inline auto locate_by_position(const PageTableView& table, const std::int32_t* batch_indices,
                               const std::int32_t* positions) {
  return [=](int i) {
    const int b = batch_indices[i], pos = positions[i];
    return std::pair{table.page_of(b, pos), pos % table.page_size};
  };
}
inline auto locate_by_slot(const std::int64_t* slot_mapping, int page_size, int num_pages) {
  return [=](int i) {
    const PoolSlot p = pool_slot(slot_mapping[i], page_size, num_pages);  // validated: never outside
    return std::pair{p.page, p.row};
  };
}

}  // namespace detail

// Quantize-append on the CPU (SIMD where the engine's flags allow, bit-identical to the
// scalar reference and to CUDA).
//   keys, values  : [num_tokens, Hkv, D] of T
//   batch_indices : [num_tokens] sequence of each token
//   positions     : [num_tokens] position of each token inside its sequence
// Two tokens at the same (sequence, position): the later one's rows are stored.
template <Policy P, ActivationType T>
Status append_kv(const PagedCacheView<P>& cache, const PageTableView& table, const T* keys, const T* values,
                 int num_tokens, const std::int32_t* batch_indices, const std::int32_t* positions,
                 const RotationParams& r = {}) {
  static_assert(check_policy<P>());
  KVQ_RETURN_IF_ERROR(validate_append(cache, table, keys, values, num_tokens, batch_indices, positions, r));
  detail::append_items(cache, keys, values, num_tokens, r, detail::locate_by_position(table, batch_indices, positions),
                       [](int, int) { return true; });
  return {};
}

// The same append as `tasks` tasks on the engine's threads (kvq/cpu/executor.hpp),
// writing the same bytes. Task t owns the (KV head h, pool page p) pairs with
// (p·Hkv + h) mod tasks = t: the rows of one page and head always go to one task, in
// token order, so tasks never write the same bytes and repeated positions resolve as
// in the serial call. Each task scans the token list (cheap next to quantizing), so
// tasks ≈ threads is enough: the decode step's one token per sequence spreads over
// its sequences' pages, a prefill's tokens over their pages and heads.
template <Policy P, ActivationType T, cpu::Executor Exec>
Status append_kv(const PagedCacheView<P>& cache, const PageTableView& table, const T* keys, const T* values,
                 int num_tokens, const std::int32_t* batch_indices, const std::int32_t* positions,
                 const RotationParams& r, int tasks, Exec&& ex) {
  static_assert(check_policy<P>());
  KVQ_CHECK_ARG(tasks >= 1, StatusCode::invalid_argument, "append: tasks must be >= 1, got " + std::to_string(tasks));
  KVQ_RETURN_IF_ERROR(validate_append(cache, table, keys, values, num_tokens, batch_indices, positions, r));
  const long long hkv = cache.layout.num_kv_heads;
  ex(tasks, [&](int t) {
    detail::append_items(cache, keys, values, num_tokens, r, detail::locate_by_position(table, batch_indices, positions),
                         [&](int h, int page) { return (page * hkv + h) % tasks == t; });
  });
  return {};
}

// The same append addressed by pool slot, as vLLM's slot_mapping and llama.cpp's cell
// indices: token i goes to page s / P, row s % P of s = slot_mapping[i] (P = the layout's
// page size); s < 0 skips the token (padding). No page table: the engine owns which slots
// a sequence has. The same bytes as the append by position into the same slots, and as
// cuda::append_kv with AppendArgs::slot_mapping. A slot past the pool is out_of_range.
template <Policy P, ActivationType T>
Status append_kv(const PagedCacheView<P>& cache, const T* keys, const T* values, int num_tokens,
                 const std::int64_t* slot_mapping, const RotationParams& r = {}) {
  using enum StatusCode;
  static_assert(check_policy<P>());
  KVQ_CHECK_ARG(num_tokens >= 0, invalid_argument, "append: negative num_tokens");
  if (num_tokens == 0) return {};
  KVQ_CHECK_ARG(keys && values && slot_mapping, invalid_argument,
                "append: keys, values and slot_mapping must not be null");
  KVQ_CHECK_ARG(cache.pool, invalid_argument, "append: cache pool is null");
  KVQ_CHECK_ARG(cache.layout.num_kv_heads >= 1, invalid_argument, "append: num_kv_heads must be >= 1");
  KVQ_CHECK_ARG(cache.layout.page_size >= 1, invalid_argument, "append: page_size must be >= 1");
  KVQ_RETURN_IF_ERROR(validate_rotation_params<P>(r));
  const int page_size = cache.layout.page_size;
  for (int i = 0; i < num_tokens; ++i)
    if (pool_slot(slot_mapping[i], page_size, cache.num_pages).outside)
      return {out_of_range, "append: slot_mapping[" + std::to_string(i) + "] = " + std::to_string(slot_mapping[i]) +
                                " outside the pool's " + std::to_string(std::int64_t(cache.num_pages) * page_size) +
                                " slots"};
  detail::append_items(cache, keys, values, num_tokens, r,
                       detail::locate_by_slot(slot_mapping, page_size, cache.num_pages), [](int, int) { return true; });
  return {};
}

// Dequantizes sequence b into rows (tests, debugging, CPU extras).
//   keys, values : [seq_len(b), Hkv, D] fp32 in the ORIGINAL basis (inverse rotation
//                  applied, means added back) — the K̂, V̂ that attention effectively uses.
template <Policy P>
Status dequantize_sequence(const ConstPagedCacheView<P>& cache, const PageTableView& table, int b,
                           const RotationParams& r, float* keys, float* values) {
  using enum StatusCode;
  KVQ_CHECK_ARG(table.page_size == cache.layout.page_size, invalid_argument,
                "dequantize: page table page_size differs from the cache layout's");
  KVQ_RETURN_IF_ERROR(validate_page_table(table, cache.num_pages));
  KVQ_RETURN_IF_ERROR(validate_rotation_params<P>(r));
  KVQ_CHECK_ARG(b >= 0 && b < table.batch_size, out_of_range, "dequantize: sequence index out of range");
  KVQ_CHECK_ARG(table.seq_len(b) == 0 || (keys && values), invalid_argument, "dequantize: null output");
  constexpr int D = P.head_dim;
  const int hkv = cache.layout.num_kv_heads;
  float scratch[D];
  for (int t = 0; t < table.seq_len(b); ++t) {
    const std::byte* page = cache.page(table.page_of(b, t));
    const int slot = t % table.page_size;
    for (int h = 0; h < hkv; ++h) {
      float* k = keys + (std::size_t(t) * hkv + h) * D;
      float* v = values + (std::size_t(t) * hkv + h) * D;
      dequantize_row<P.key, D>(reinterpret_cast<const std::uint8_t*>(cache.layout.key_codes(page, h, slot)),
                               reinterpret_cast<const meta_storage_t<P.key.meta>*>(cache.layout.key_meta_bytes(page, h, slot)), k);
      dequantize_row<P.value, D>(reinterpret_cast<const std::uint8_t*>(cache.layout.value_codes(page, h, slot)),
                                 reinterpret_cast<const meta_storage_t<P.value.meta>*>(cache.layout.value_meta_bytes(page, h, slot)), v);
      // Keys: k̂ = u·R_Kᵀ + μ_K.
      detail::unrotate_uncenter<P.key, D>(k, h, r.key_mean, r.key_rotation, scratch);
      untransform_output<P>(v, h, r, scratch);
    }
  }
  return {};
}

}  // namespace kvq
